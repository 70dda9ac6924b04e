"""The xgrammar backend, for comparison (not a dependency: `pip install xgrammar` pulls torch,
transformers and triton). Grammars are compiled ahead (token masks precomputed per grammar state),
so a compile is slow and a mask is cheap. A grammar that is complete waits for EOS: its request
ends when the model samples it (llguidance ends it as soon as nothing but EOS could follow). Its
JSON strings admit raw control characters, which strict JSON parsers refuse. Its JSON is compact,
in the llguidance backend's form (one space after each ',' and ':'); it takes no whitespace pattern."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

import torch

from engine.grammar.base import GrammarBackend, GrammarError, GrammarMatcher, register_backend


class XGrammarMatcher(GrammarMatcher):
    __slots__ = ("m",)

    def __init__(self, m, backend: GrammarBackend) -> None:
        super().__init__(backend)
        self.m = m  # xgrammar.GrammarMatcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(token)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.m.rollback(num_tokens)


@register_backend("xgrammar")
class XGrammarBackend(GrammarBackend):
    package = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int], *,
                 json_whitespace_pattern: str | None = None) -> None:
        import xgrammar
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if json_whitespace_pattern is not None:
            self.check_whitespace_pattern(json_whitespace_pattern)
        super().__init__(vocab_size)
        self._xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(set(eos_token_ids)) or None)
        # Our cache sits in front; xgrammar's own would hold a second copy.
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self._batch = xgrammar.BatchGrammarMatcher()

    def _compile(self, kind: str, spec: str) -> object:
        try:
            if kind == "json_schema":
                if not isinstance(json.loads(spec), dict | bool):
                    raise GrammarError("the JSON schema must be an object")
                return self.compiler.compile_json_schema(spec, any_whitespace=False, separators=(", ", ": "))
            if kind == "regex":
                return self.compiler.compile_regex(spec)
            return self.compiler.compile_grammar(spec)
        except GrammarError:
            raise
        except (ValueError, RuntimeError, TypeError) as e:
            raise GrammarError(str(e) or type(e).__name__) from None

    def matcher(self, grammar: object) -> XGrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(grammar), self)

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if rows:
            self._batch.batch_fill_next_token_bitmask([matchers[i].m for i in rows], bitmask, rows)
