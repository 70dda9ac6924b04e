"""Structured outputs: grammar backends behind one interface (engine/grammar/base.py).

`create_grammar_backend(name, tokenizer_json, vocab_size, eos_ids)` builds one for a tokenizer.
`llguidance` is the default: it compiles a schema orders of magnitude faster than xgrammar (whose
masks are cheaper once compiled), keeps pace per decode step, and has no Python dependencies.
`xgrammar` is there for comparison when that package is installed."""

from __future__ import annotations

from collections.abc import Iterable

from engine.grammar.base import (
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    bitmask_allows,
)

GRAMMAR_BACKENDS: tuple[str, ...] = ("llguidance", "xgrammar")


def create_grammar_backend(name: str, tokenizer_json: str, vocab_size: int,
                           eos_token_ids: Iterable[int]) -> GrammarBackend:
    """A backend for one tokenizer (its tokenizer.json text) and the model's vocabulary size."""
    if name == "llguidance":
        from engine.grammar.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer_json, vocab_size, eos_token_ids)
    if name == "xgrammar":
        from engine.grammar.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer_json, vocab_size, eos_token_ids)
    raise GrammarError(f"unknown grammar backend {name!r}; choose one of {GRAMMAR_BACKENDS}")


__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_KINDS", "GrammarBackend", "GrammarError", "GrammarKind", "GrammarMatcher",
           "bitmask_allows", "create_grammar_backend"]
