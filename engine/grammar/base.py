"""The grammar backend interface: compile a constraint once (cached), give each request a matcher,
and turn the matchers' states into a batched token bitmask that the sampler adds to the logits.

Bitmask layout (the one llguidance and xgrammar share): int32 [rows, ceil(vocab / 32)], bit
`t % 32` of word `t // 32` set when token t is allowed. A row of all ones (-1) masks nothing."""

from __future__ import annotations

import importlib.util
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import ClassVar, Literal, TypeVar

import torch
import torch.nn.functional as F

from engine.errors import ConfigError, RadixRayError

GrammarKind = Literal["json_schema", "regex", "ebnf"]
GRAMMAR_KINDS: tuple[str, ...] = ("json_schema", "regex", "ebnf")


class GrammarError(RadixRayError, ValueError):
    """A constraint does not compile, or a matcher was fed a token its grammar forbids."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used by one thread at a time (the scheduler's,
    or the forward side while the scheduler waits for it)."""

    __slots__ = ("backend",)

    def __init__(self, backend: GrammarBackend) -> None:
        self.backend = backend  # what compiled its grammar: it builds and applies batch bitmasks

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a host int32 bitmask."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one token; False (and the matcher is unusable) if the grammar forbids it."""

    def accept_prefix(self, tokens: list[int]) -> int:
        """Accept the longest prefix of `tokens` the grammar allows; returns its length. Unlike a
        refused `accept`, stopping at a forbidden token leaves the matcher usable."""
        n = 0
        while n < len(tokens) and not self.is_terminated() and self.accept(tokens[n]):
            n += 1
        return n

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and can take nothing more (EOS aside): the request ends."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative verification tries drafts)."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary; compiled grammars are cached by
    (kind, spec), so a schema is compiled once per process however many requests carry it.

    A subclass registered with `@register_backend(name)` is created by
    `create_grammar_backend(name, tokenizer_json, vocab_size, eos_token_ids, json_whitespace_pattern)`.
    JSON schemas compile to compact JSON (one space after each ',' and ':', as `json.dumps` writes
    it) unless `json_whitespace_pattern` (a regex) allows whitespace between tokens."""

    name: ClassVar[str] = ""  # set by register_backend
    package: ClassVar[str] = ""  # the Python package it needs (imported only when created)
    CACHE_SIZE = 512  # compiled grammars kept (least recently used dropped first)

    def __init__(self, vocab_size: int, json_whitespace_pattern: str | None = None) -> None:
        self.vocab_size = vocab_size  # the model's: the width of its logits
        self.json_whitespace_pattern = json_whitespace_pattern
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._unpack_tables: dict[torch.device, torch.Tensor] = {}
        self.compiles = 0  # cache misses that compiled

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def compile(self, kind: str, spec: str) -> object:
        """The compiled grammar of a constraint (cached). Raises GrammarError when it does not compile."""
        key = (kind, spec)
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        if kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {kind!r}")
        grammar = self._compile(kind, spec)  # outside the lock: compiles may run in parallel
        with self._lock:
            self.compiles += 1
            self._cache[key] = grammar
            while len(self._cache) > self.CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    @classmethod
    def check_whitespace_pattern(cls, pattern: str) -> None:
        """Raise a ConfigError if this backend cannot take `pattern` as JSON's whitespace."""
        raise ConfigError(f"grammar_backend {cls.name!r} takes no constrained_json_whitespace_pattern")

    def cached(self, kind: str, spec: str) -> bool:
        with self._lock:
            return (kind, spec) in self._cache

    @abstractmethod
    def _compile(self, kind: str, spec: str) -> object:
        """Compile one constraint; raise GrammarError with a message for the user if it fails."""

    @abstractmethod
    def matcher(self, grammar: object) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        """Row i gets matchers[i]'s allowed tokens; rows of None are left as they are. Backends
        with a parallel batch call override this."""
        for i, m in enumerate(matchers):
            if m is not None:
                m.fill_bitmask(bitmask, i)

    def new_bitmask(self, rows: int, pin: bool = False) -> torch.Tensor:
        """A host bitmask that allows everything (pinned when it is to be copied to a GPU)."""
        return torch.full((rows, self.bitmask_width), -1, dtype=torch.int32, pin_memory=pin)

    def batch_bitmask(self, matchers: Sequence[GrammarMatcher | None], device: torch.device) -> torch.Tensor:
        """The filled bitmask of a batch (all ones for unconstrained rows), on `device`. The
        host work comes first and the copy does not block, so on a GPU it overlaps a forward
        still running."""
        bitmask = self.new_bitmask(len(matchers), pin=device.type == "cuda")
        self.fill_bitmasks(matchers, bitmask)
        return bitmask.to(device, non_blocking=True)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, inplace: bool = False) -> torch.Tensor:
        """float logits [rows, vocab] + -inf where the bitmask (on the logits' device) forbids.
        Each mask byte picks a row of a 256 x 8 table of 0/-inf (one gather, one add), which is
        much faster on a CPU than unpacking bits into a bool mask."""
        table = self._unpack_table(logits.device, logits.dtype)
        rows, vocab = logits.shape
        add = F.embedding(bitmask.view(torch.uint8).long(), table).view(rows, -1)[:, :vocab]
        return logits.add_(add) if inplace else logits + add

    def _unpack_table(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._unpack_tables.get(device)
        if table is None or table.dtype != dtype:
            # Row b, column k: 0 if bit k of byte b is set, else -inf (little-endian words, so
            # byte j of the row holds tokens 8j .. 8j + 7).
            bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
            table = torch.zeros(256, 8, dtype=dtype).masked_fill(bits == 0, float("-inf")).to(device)
            self._unpack_tables[device] = table
        return table


# The one module-level mutable object: name -> backend class, filled by @register_backend.
GRAMMAR_BACKENDS: dict[str, type[GrammarBackend]] = {}

B = TypeVar("B", bound=type[GrammarBackend])


def register_backend(name: str) -> Callable[[B], B]:
    """Class decorator: make the backend creatable as `create_grammar_backend(name, ...)`."""

    def deco(cls: B) -> B:
        if not (isinstance(cls, type) and issubclass(cls, GrammarBackend)):
            raise TypeError(f"{cls!r} is not a GrammarBackend subclass")
        if GRAMMAR_BACKENDS.get(name, cls) is not cls:
            raise ValueError(f"grammar backend {name!r} is already registered ({GRAMMAR_BACKENDS[name].__qualname__})")
        cls.name = name
        GRAMMAR_BACKENDS[name] = cls
        return cls

    return deco


def grammar_backend_class(name: str, json_whitespace_pattern: str | None = None) -> type[GrammarBackend]:
    """The registered backend `name`, checked to be installed and to take the options; raises a
    ConfigError naming the choice (EngineConfig calls it at validation)."""
    cls = GRAMMAR_BACKENDS.get(name)
    if cls is None:
        raise ConfigError(f"unknown grammar_backend {name!r}; registered: {', '.join(sorted(GRAMMAR_BACKENDS))}")
    if cls.package and importlib.util.find_spec(cls.package) is None:
        raise ConfigError(f"grammar_backend {name!r} needs the {cls.package!r} package, which is not installed "
                          f"(pip install {cls.package})")
    if json_whitespace_pattern is not None:
        cls.check_whitespace_pattern(json_whitespace_pattern)
    return cls


def create_grammar_backend(name: str, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                           json_whitespace_pattern: str | None = None) -> GrammarBackend:
    """A backend for one tokenizer (its tokenizer.json text) and the model's vocabulary size."""
    cls = grammar_backend_class(name, json_whitespace_pattern)
    return cls(tokenizer_json, vocab_size, eos_token_ids, json_whitespace_pattern=json_whitespace_pattern)


def bitmask_allows(bitmask: torch.Tensor, row: int, token: int) -> bool:
    """Whether `token` is allowed in row `row` of a host bitmask (tests, speculative checks)."""
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
