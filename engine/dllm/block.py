"""One request's block diffusion state: the block being denoised, where the next forward's extend
starts, and the commit of a finished block into the request's output."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.req import Req


@dataclass
class DllmBlock:
    """The block a request is denoising: positions [start, end), start a multiple of the block
    size B (blocks are aligned to absolute positions, the prompt's included). The first block
    of a request holds the prompt's last partial block: `tokens[:first_free]` are prompt tokens,
    fixed; every other position starts as the mask token. A block clipped by the context length
    is shorter than B.

    `prefix_len`: the request's KV before this position is final, and the next DLLM_EXTEND
    forward extends from here to `end`. After a forward it is `start`: the block's own KV saw its
    tokens of that moment (masks included), and block-causal attention means nothing before the
    block saw them. When the block commits, the next block's first forward recomputes it with its
    final tokens (exact: it attends to nothing after itself), so a committed block's KV is that of
    its final tokens."""

    start: int
    tokens: list[int]
    first_free: int
    mask_token_id: int
    prefix_len: int

    @classmethod
    def first(
        cls,
        prompt: list[int],
        prefix_len: int,
        block_size: int,
        mask_token_id: int,
        max_context_len: int,
    ) -> DllmBlock:
        """The block holding the first position after `prompt`; `prefix_len`: KV already held
        (a cached prefix, a multiple of the block size, at most the block's start)."""
        start = len(prompt) // block_size * block_size
        end = min(start + block_size, max_context_len)
        if end <= len(prompt):
            raise ValueError(
                f"a prompt of {len(prompt)} tokens leaves no room in a context of {max_context_len}"
            )
        if prefix_len % block_size or prefix_len > start:
            raise ValueError(
                f"prefix_len {prefix_len} is not a block boundary at or before {start}"
            )
        fixed = prompt[start:]
        return cls(
            start,
            fixed + [mask_token_id] * (end - len(prompt)),
            len(fixed),
            mask_token_id,
            prefix_len,
        )

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def masked(self) -> list[int]:
        """Indices (in the block) of the positions still masked, in order."""
        return [
            i
            for i in range(self.first_free, len(self.tokens))
            if self.tokens[i] == self.mask_token_id
        ]

    def generated(self) -> list[int]:
        """The block's output tokens (the positions after the prompt)."""
        return self.tokens[self.first_free :]

    def unmask(self, index: int, token: int) -> None:
        if token == self.mask_token_id:
            raise ValueError("a position cannot be unmasked to the mask token")
        if index < self.first_free or self.tokens[index] != self.mask_token_id:
            raise ValueError(f"position {self.start + index} is not masked")
        self.tokens[index] = token

    def advance(self, block_size: int, max_context_len: int) -> None:
        """The block committed: the next one begins after it, all masked. `prefix_len` stays at
        the committed block's start: the next forward recomputes it with its final tokens."""
        self.start = self.end
        self.tokens = [self.mask_token_id] * (
            min(self.start + block_size, max_context_len) - self.start
        )
        self.first_free = 0


def commit(
    req: Req,
    block: DllmBlock,
    eos_token_ids: frozenset[int],
    max_context_len: int,
    decode_tail: Callable[[list[int]], str] | None = None,
) -> list[int]:
    """Append a denoised block's tokens to the request's output one at a time, with the stop
    checks of autoregressive decoding: output stops at max_new_tokens (the block was denoised
    whole, then is truncated), at EOS or a stop token or string inside the block, or at the
    context's end. Returns the tokens appended."""
    if block.masked():
        raise ValueError("a block with masked positions cannot commit")
    appended = []
    for token in block.generated():
        req.output_ids.append(token)
        appended.append(token)
        req.check_finished(eos_token_ids, max_context_len, decode_tail)
        if req.finished():
            break
    return appended
