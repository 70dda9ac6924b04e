"""Structured outputs: grammar backends behind one interface (engine/grammar/base.py), created by
name from a registry.

Importing this package registers the built-in backends (their libraries are imported only when
one is created). `llguidance` is the default: it compiles a schema orders of magnitude faster than
xgrammar (whose masks are cheaper once compiled), keeps pace per decode step, and has no Python
dependencies. `xgrammar` is there for comparison when that package is installed. EngineConfig's
`grammar_backend` picks one."""

from __future__ import annotations

from engine.grammar.base import (
    GRAMMAR_BACKENDS,
    GRAMMAR_KINDS,
    GrammarBackend,
    GrammarError,
    GrammarKind,
    GrammarMatcher,
    bitmask_allows,
    create_grammar_backend,
    grammar_backend_class,
    register_backend,
)
from engine.grammar.llguidance_backend import LLGuidanceBackend
from engine.grammar.xgrammar_backend import XGrammarBackend

__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_KINDS", "GrammarBackend", "GrammarError", "GrammarKind", "GrammarMatcher",
           "LLGuidanceBackend", "XGrammarBackend", "bitmask_allows", "create_grammar_backend", "grammar_backend_class",
           "register_backend"]
