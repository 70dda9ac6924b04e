"""The llguidance backend (a Rust library with no Python dependencies): JSON schema, regex and
EBNF (GBNF or Lark syntax) grammars, masks computed on the fly over the tokenizer's token trie."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from engine.grammar.base import GrammarBackend, GrammarError, GrammarMatcher

# Whitespace between JSON tokens: a short run, or a newline and an indentation of up to 24. A
# model that keeps choosing whitespace (small and random models do, greedily) must then go on,
# while compact, spaced and pretty-printed JSON all still fit.
JSON_WHITESPACE = r"(?:\r?\n[ \t]{0,24}|[ \t]{1,2})"


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("m",)

    def __init__(self, m, backend: GrammarBackend) -> None:
        super().__init__(backend)
        self.m = m  # llguidance.LLMatcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self.m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def accept(self, token: int) -> bool:
        return self.m.consume_token(token)

    def accept_prefix(self, tokens: list[int]) -> int:
        return self.m.try_consume_tokens(tokens)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise GrammarError(f"grammar rollback of {num_tokens} tokens failed: {self.m.get_error()}")


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 num_threads: int | None = None) -> None:
        import llguidance  # here: an engine that never sees a constraint does not load it

        super().__init__(vocab_size)
        self._llg = llguidance
        eos = sorted(set(eos_token_ids))
        # n_vocab is the model's: ids past the tokenizer's (padding rows of the embedding) are
        # never allowed. EOS is allowed exactly where the grammar may end.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self._executor = llguidance.LLExecutor(num_threads) if num_threads else llguidance.LLExecutor()

    def _compile(self, kind: str, spec: str) -> object:
        llg = self._llg
        try:
            if kind == "json_schema":
                schema = json.loads(spec)
                if not isinstance(schema, dict | bool):
                    raise TypeError("the JSON schema must be an object")
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_pattern": JSON_WHITESPACE})
            elif kind == "regex":
                grammar = llg.LLMatcher.grammar_from_regex(spec)
            else:  # GBNF-style EBNF (`root ::= ...`, as SGLang takes it) or Lark
                grammar = llg.grammar_from("ebnf", spec)
        except (ValueError, TypeError, RecursionError) as e:  # (json.JSONDecodeError is a ValueError)
            raise GrammarError(str(e) or type(e).__name__) from None
        # A prototype matcher (building it checks the grammar): new requests copy it, which skips
        # parsing the grammar again.
        proto = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if proto.is_error():
            raise GrammarError(proto.get_error())
        return proto

    def matcher(self, grammar: object) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(grammar.deep_copy(), self)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        # One call for the batch: llguidance spreads the rows over its threads, without the GIL.
        pairs = [(m.m, i) for i, m in enumerate(matchers) if m is not None]
        if pairs:
            rows, width = bitmask.shape
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), width * 4, rows)
