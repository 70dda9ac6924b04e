"""Denoising algorithms by name: how a DLLM_EXTEND forward's logits unmask each request's block."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch

from engine.dllm.block import DllmBlock
from engine.errors import ConfigError
from engine.req import Req
from engine.sampling import filtered_probs


class DllmAlgorithm(abc.ABC):
    """Picks, after each DLLM_EXTEND forward, which masked positions of each block become which
    tokens.

    Contract:
    - `unmask(logits, blocks, reqs)`: `logits` [M, vocab] holds one row per position that was
      masked when the forward ran, block by block (`blocks[i]` is `reqs[i]`'s), each block's in
      position order (`DllmBlock.masked()`). It sets positions of each block to tokens with
      `DllmBlock.unmask` (never to the mask token) and returns how many it set per block. It
      sets at least one per block, so a block takes at most as many forwards as it has masked
      positions.
    - A request that samples (not greedy) draws only from its own `req.generator`, in a fixed
      order, so a seeded request gets the same tokens whatever else is in the batch.
    - No per-request state between calls: a block's state is its DllmBlock.
    """

    name: ClassVar[str] = ""  # set by register_algorithm

    @abc.abstractmethod
    def unmask(self, logits: torch.Tensor, blocks: list[DllmBlock], reqs: list[Req]) -> list[int]:
        """Unmask positions of every block; returns how many per block."""

    @staticmethod
    def candidates(
        logits: torch.Tensor, req: Req, mask_token_id: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each masked position's candidate token and its confidence, the probability the model
        gives that token: the argmax for a greedy request, else a draw from the temperature,
        top-k, top-p and min-p filtered distribution (one per row, in order, from the request's
        generator). The mask token is never a candidate: a position set to it would stay masked."""
        logits = logits.float().clone()
        logits[:, mask_token_id] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        params = req.sampling_params
        if params.is_greedy:
            tokens = torch.argmax(logits, dim=-1)
        else:
            filtered = filtered_probs(logits, [params] * logits.shape[0])
            tokens = torch.multinomial(filtered, 1, generator=req.generator).squeeze(1)
        return tokens, probs.gather(1, tokens.unsqueeze(1)).squeeze(1)


# name -> algorithm class, filled by @register_algorithm.
DLLM_ALGORITHMS: dict[str, type[DllmAlgorithm]] = {}

A = TypeVar("A", bound=type[DllmAlgorithm])


def register_algorithm(name: str) -> Callable[[A], A]:
    """Class decorator: make the algorithm creatable as `create_dllm_algorithm(name, ...)`."""

    def deco(cls: A) -> A:
        if not (isinstance(cls, type) and issubclass(cls, DllmAlgorithm)):
            raise TypeError(f"{cls!r} is not a DllmAlgorithm subclass")
        if DLLM_ALGORITHMS.get(name, cls) is not cls:
            raise ValueError(
                f"dllm algorithm {name!r} is already registered ({DLLM_ALGORITHMS[name].__qualname__})"
            )
        cls.name = name
        DLLM_ALGORITHMS[name] = cls
        return cls

    return deco


def create_dllm_algorithm(name: str, threshold: float | None = None) -> DllmAlgorithm:
    """The algorithm registered as `name` (SGLang's `dllm_algorithm`); `threshold` for those that
    take one (None: the algorithm's default)."""
    cls = DLLM_ALGORITHMS.get(name)
    if cls is None:
        raise ConfigError(
            f"unknown dllm algorithm {name!r}; registered: {', '.join(sorted(DLLM_ALGORITHMS))}"
        )
    return cls() if threshold is None else cls(threshold=threshold)


@register_algorithm("low_confidence")
class LowConfidence(DllmAlgorithm):
    """Every masked position whose candidate's confidence exceeds `threshold` takes its candidate;
    if none does, the single most confident position does (the lowest one on a tie). Threshold
    0 unmasks a whole block per forward; 1 one position per forward."""

    def __init__(self, threshold: float = 0.95) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"dllm_threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def unmask(self, logits: torch.Tensor, blocks: list[DllmBlock], reqs: list[Req]) -> list[int]:
        counts, row = [], 0
        for block, req in zip(blocks, reqs):
            masked = block.masked()
            tokens, confidence = self.candidates(
                logits[row : row + len(masked)], req, block.mask_token_id
            )
            row += len(masked)
            chosen = (confidence > self.threshold).nonzero().flatten().tolist()
            if not chosen:
                chosen = [int(torch.argmax(confidence))]  # argmax: the first of equal maxima
            tokens = tokens.tolist()
            for j in chosen:
                block.unmask(masked[j], tokens[j])
            counts.append(len(chosen))
        if row != logits.shape[0]:
            raise RuntimeError(f"{logits.shape[0]} logit rows for {row} masked positions")
        return counts
