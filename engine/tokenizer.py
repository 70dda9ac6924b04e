"""Tokenizer (HF `tokenizers`), chat templates (jinja2) and incremental detokenization."""

from __future__ import annotations

import json
import os
import re

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ConfigError, InvalidRequestError
from engine.model_path import resolve_model_path

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Longer texts are tokenized without holding the GIL, so a tokenizer thread does not stall the
# others (a front end's event loop).
LONG_TEXT_CHARS = 16384

# Used when a checkpoint ships no chat template: plain "role: content" turns.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, model_dir: str) -> None:
        model_dir = resolve_model_path(model_dir)  # a folder, or a built-in model's name
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no tokenizer.json in model folder {model_dir!r}")
        self.tok = HFTokenizer.from_file(path)
        # Byte-fallback pieces ("<0xE2>"): a run of them decodes as a group that may still change.
        model = json.load(open(path)).get("model", {})
        self.byte_token_ids = frozenset(
            i for t, i in self.tok.get_vocab().items() if _BYTE_PIECE.fullmatch(t)
        ) if model.get("byte_fallback") else frozenset()
        specials = frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        # Tokens a held-back byte run may extend over (skipped specials do not end the group).
        self.byte_run_ids = self.byte_token_ids | specials if self.byte_token_ids else frozenset()
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg = json.load(open(cfg_path)) if os.path.isfile(cfg_path) else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.bos_token_id = self.tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self.tok.token_to_id(self.eos_token) if self.eos_token else None
        # None: trust tokenizer.json's post-processor, as transformers does.
        self.add_bos_token: bool | None = cfg.get("add_bos_token")
        # Whether the post-processor itself prepends BOS: only such a BOS is dropped when the
        # config says add_bos_token=False (a text may begin with the BOS token's own text).
        self._post_adds_bos = self.bos_token_id is not None and self.tok.encode("").ids[:1] == [self.bos_token_id]
        template = cfg.get("chat_template")
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        if template is None and os.path.isfile(jinja_file):
            template = open(jinja_file).read()
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        env.filters["tojson"] = _tojson  # transformers' version: no HTML escaping (tool schemas, arguments)
        self._template = env.from_string(template or FALLBACK_CHAT_TEMPLATE)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT_CHARS:
            # The batch calls release the GIL while they run (encode does not); the fast one skips
            # the offsets, which saves a third of the memory a long text takes to tokenize.
            batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
            ids = batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self.tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.bos_token_id is not None:
            if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
                ids = [self.bos_token_id] + ids
            elif self.add_bos_token is False and self._post_adds_bos and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """`tools` (OpenAI tool objects) reach the template as `tools`, as transformers passes them."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                                         tools=tools)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}", "messages") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Render and tokenize as transformers does: the template writes BOS itself if it wants one."""
        return self.encode(self.apply_chat_template(messages, tools=tools), add_special_tokens=False)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: object, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas whose concatenation is exactly the
    final text: it holds back an incomplete UTF-8 character (U+FFFD at the end) and, when stop
    strings are set, the last len(longest stop) - 1 characters, which may start a stop string.
    A trailing run of byte-fallback pieces is held too: the group decodes as one unit.

    Each step decodes only a window: the tokens since the last emitted text plus a few before
    them (`prefix_offset`..`read_offset`), whose text is subtracted, so what a tokenizer does
    at the start of a decode (a stripped leading space, an unfinished byte run) cancels out. A
    step costs the window, not the whole output. The last step decodes everything once, so
    the deltas add up to exactly the full decode."""

    WINDOW = 6  # tokens of context decoded before the unread ones

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens whose text has been taken (sent or held)
        self.held = ""  # text taken but not sent: it may begin a stop string
        self.sent: list[str] = []
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens)

    def _cut_at_stop(self, text: str) -> str:
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text if cut < 0 else text[:cut]

    def final_text(self) -> str:
        return self._cut_at_stop(self._decode(self.ids))

    def _new_text(self) -> str:
        """Text of the tokens after read_offset that is final (no partial character or byte run)."""
        end, byte_ids = len(self.ids), self.tokenizer.byte_run_ids
        while end > self.read_offset and self.ids[end - 1] in byte_ids:
            end -= 1
        if end <= self.read_offset:
            return ""
        # Start the window where its own text is not empty and not inside a byte run.
        start = min(self.prefix_offset, max(self.read_offset - self.WINDOW, 0))
        while start > 0 and self.ids[start] in byte_ids:
            start -= 1
        prefix = self._decode(self.ids[start:self.read_offset])
        while start > 0 and not prefix:
            start = max(start - self.WINDOW, 0)
            prefix = self._decode(self.ids[start:self.read_offset])
        text = self._decode(self.ids[start:end])
        if len(text) <= len(prefix) or not text.startswith(prefix) or text.endswith("\ufffd"):
            return ""  # nothing final yet: wait for more tokens
        self.prefix_offset, self.read_offset = self.read_offset, end
        return text[len(prefix):]

    def step(self, new_ids: list[int], finished: bool) -> str:
        self.ids.extend(new_ids)
        if finished:  # one full decode: the deltas add up to exactly the final text
            final, sent = self.final_text(), "".join(self.sent)
            if not final.startswith(sent):
                return ""
            self.sent = [final]
            return final[len(sent):]
        if self.stopped:
            return ""
        pending = self.held + self._new_text()
        if self.stop:
            # A stop string not seen before ends in the new text and starts within the held tail.
            cut = self._cut_at_stop(pending)
            if len(cut) < len(pending):
                self.stopped, pending, self.held = True, cut, ""
            else:
                keep = max(len(pending) - self.hold, 0)
                pending, self.held = pending[:keep], pending[keep:]
        if pending:
            self.sent.append(pending)
        return pending
