"""The llguidance backend (a Rust library with no Python dependencies): JSON schema, regex and
EBNF (GBNF or Lark syntax) grammars, masks computed on the fly over the tokenizer's token trie."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from engine.errors import ConfigError
from engine.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, register_backend

# JSON as json.dumps writes it: one space after each ',' and ':', none elsewhere. A model that
# favours whitespace (small and random ones do, greedily) cannot spend its tokens on it, and the
# form is the one chat templates show models (`tojson`). Overrides, not defaults: a schema's
# "x-guidance" options cannot loosen it.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def json_options(whitespace_pattern: str | None) -> dict:
    """llguidance's JSON compile options: compact, or `whitespace_pattern` (optional) between tokens
    with bare ',' and ':'."""
    if whitespace_pattern is None:
        return COMPACT_JSON
    return {"whitespace_flexible": True, "whitespace_pattern": whitespace_pattern,
            "item_separator": ",", "key_separator": ":"}


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


@register_backend("llguidance")
class LLGuidanceBackend(GrammarBackend):
    package = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int], *,
                 json_whitespace_pattern: str | None = None, num_threads: int | None = None) -> None:
        import llguidance  # here: an engine that never sees a constraint does not load it

        super().__init__(vocab_size, json_whitespace_pattern)
        self._json_options = json_options(json_whitespace_pattern)
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
                grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=self._json_options)
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

    @classmethod
    def check_whitespace_pattern(cls, pattern: str) -> None:
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=json_options(pattern))
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ConfigError(f"constrained_json_whitespace_pattern {pattern!r} is not a valid regex: {error}")

    def matcher(self, grammar: object) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(grammar.deep_copy(), self)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        # One call for the batch: llguidance spreads the rows over its threads, without the GIL.
        pairs = [(m.m, i) for i, m in enumerate(matchers) if m is not None]
        if pairs:
            rows, width = bitmask.shape
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), width * 4, rows)
