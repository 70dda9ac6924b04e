"""Tool-call parsers: a model's output text -> OpenAI tool calls, whole or as it streams.

Chosen by name (`HTTPOptions.tool_call_parser`, `TOOL_PARSERS`):
- "hermes" (Hermes, Qwen 2.5 / 3): any number of `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; the text around them is content.
- "llama3_json" (Llama 3.x): the whole output is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`; an output that starts otherwise is content.
"json_array" is the server's own format for constrained calls (tool_choice "required" or a named
function): the output is `[{"name": ..., "arguments": {...}}, ...]`, nothing else. Every parser
takes "arguments" or "parameters" for the arguments."""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from types import MappingProxyType
from typing import Any, ClassVar

import msgspec

from engine.errors import InvalidRequestError

ARGUMENT_KEYS = ("arguments", "parameters")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str  # a JSON object, as text

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallDelta(msgspec.Struct, frozen=True):
    """A piece of the call at `index`: its first piece has the id and the name."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class ParsedOutput(msgspec.Struct, frozen=True):
    content: str | None  # None when there is none (or only whitespace beside calls)
    tool_calls: list[ToolCall]


class StreamParts(msgspec.Struct):
    content: str = ""
    tool_calls: list[ToolCallDelta] = msgspec.field(default_factory=list)

    def add(self, other: StreamParts) -> None:
        self.content += other.content
        self.tool_calls += other.tool_calls


class ToolCallStream(ABC):
    """One output's incremental parse. `feed(text)` takes the next text delta and returns what can
    be sent now; `finish()` returns what was held back (call it once, at the end). A call's first
    delta carries its id and name, the next ones fragments of its arguments, which add up to the
    arguments text. What was sent is never taken back: a call the output cuts short stays cut."""

    def __init__(self) -> None:
        self.calls: list[_CallObject] = []  # every call object begun, in order
        self.cut = False  # the output ended inside a call object
        self.buf = ""  # text not parsed yet

    @abstractmethod
    def feed(self, text: str) -> StreamParts: ...

    def _feed_open_call(self, out: StreamParts) -> _CallObject | None:
        """Feed the buffer to the last (open) call object; its new deltas go to `out`. Returns
        the call once it has closed, None while it needs more text."""
        call = self.calls[-1]
        self.buf = self.buf[call.feed(self.buf):]
        out.tool_calls += call.deltas()
        return call if call.closed else None

    @abstractmethod
    def finish(self) -> StreamParts: ...

    @property
    def called(self) -> bool:
        """A call has been sent (its name at least): the output's finish_reason is "tool_calls"."""
        return any(c.call_id is not None for c in self.calls)


class ToolParser(ABC):
    """The contract: `stream()` -> a fresh ToolCallStream for one output; `parse(text)` -> the
    ParsedOutput of a whole output, the same content and calls the stream gives, except that a
    call that is not complete JSON with a string name and an object of arguments makes the whole
    text content with no calls (as vLLM's parsers do); JSON nested too deeply for `json` is no
    call either, streamed or not."""

    name: ClassVar[str]

    @abstractmethod
    def stream(self) -> ToolCallStream: ...

    def parse(self, text: str) -> ParsedOutput:
        s = self.stream()
        parts = s.feed(text)
        parts.add(s.finish())
        calls: dict[int, list] = {}
        for d in parts.tool_calls:
            if d.id is not None:
                calls[d.index] = [d.id, d.name, ""]
            calls[d.index][2] += d.arguments
        if s.cut or len(calls) != len(s.calls):
            return ParsedOutput(content=text or None, tool_calls=[])
        out = []
        for call_id, name, arguments in calls.values():
            try:
                valid = isinstance(json.loads(arguments), dict)
            except (ValueError, RecursionError):  # deep nesting too: then it is text, not a call
                valid = False
            if not valid:
                return ParsedOutput(content=text or None, tool_calls=[])
            out.append(ToolCall(call_id, name, arguments))
        content = parts.content
        return ParsedOutput(content=content if content.strip() or not out else None, tool_calls=out)


class _CallObject:
    """One call's JSON object as its text arrives, scanned once, character by character: where
    the "name" value and the arguments value are. It takes text from its "{" to its "}"."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.text = ""
        self.depth = 0
        self.in_string = self.escape = False
        self.expect = "key"  # at depth 1: key, colon, value, in_value, in_scalar, comma
        self.reading_key = False
        self.token_start = 0  # where the depth-1 key or value being read starts
        self.key: str | None = None
        self.values: dict[str, tuple[int, int]] = {}  # key -> its value's span, once complete
        self.open_value: tuple[str, int] | None = None  # (key, start) of the value being read
        self.closed = False  # its "}" was read
        self.call_id: str | None = None  # set when its name went out
        self.sent_args = 0  # how far (in text) the arguments have gone out
        self.args_done = False

    def feed(self, text: str) -> int:
        """Scan text; returns how much of it belongs to this object (all of it until the "}")."""
        base = len(self.text)
        self.text += text
        for k, c in enumerate(text):
            if self._step(c, base + k):
                self.text = self.text[:base + k + 1]
                self.closed = True
                return k + 1
        return len(text)

    def _step(self, c: str, i: int) -> bool:
        """One character at index i; True when it closes the object."""
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    if self.reading_key:
                        self.reading_key = False
                        self.key = self._loads(self.token_start, i + 1)
                        self.expect = "colon"
                    else:
                        self._close_value(i + 1)
            return False
        if c == '"':
            self.in_string = True
            if self.depth == 1:
                if self.expect == "key":
                    self.reading_key, self.token_start = True, i
                elif self.expect == "value":
                    self._open(i)
            return False
        if c in "{[":
            if self.depth == 1 and self.expect == "value":
                self._open(i)
            self.depth += 1
            return False
        if c in "}]":
            if self.depth == 1 and self.expect == "in_scalar":
                self._close_value(i)
            self.depth -= 1
            if self.depth == 1 and self.expect == "in_value":
                self._close_value(i + 1)
            return self.depth == 0
        if self.depth != 1:
            return False
        if self.expect == "in_scalar" and (c == "," or c.isspace()):
            self._close_value(i)
        if c == ":" and self.expect == "colon":
            self.expect = "value"
        elif c == "," and self.expect == "comma":
            self.expect = "key"
        elif self.expect == "value" and not c.isspace():
            self._open(i)
            self.expect = "in_scalar"
        return False

    def _open(self, i: int) -> None:
        self.open_value, self.expect = (self.key or "", i), "in_value"

    def _close_value(self, end: int) -> None:
        if self.open_value is not None:
            key, start = self.open_value
            self.values.setdefault(key, (start, end))
            self.open_value = None
        self.expect = "comma"

    def _loads(self, start: int, end: int) -> Any:
        try:
            return json.loads(self.text[start:end])
        except (ValueError, RecursionError):  # not JSON we take (too deep too): no name, no arguments
            return None

    @property
    def name(self) -> str | None:
        span = self.values.get("name")
        if span is None:
            return None
        name = self._loads(*span)
        return name if isinstance(name, str) and name else None

    def _args_span(self) -> tuple[str, int, int | None] | None:
        """(key, start, end or None while it is being read) of the arguments value."""
        for key in ARGUMENT_KEYS:
            if key in self.values:
                return key, *self.values[key]
        if self.open_value is not None and self.open_value[0] in ARGUMENT_KEYS:
            return self.open_value[0], self.open_value[1], None
        return None

    def deltas(self) -> list[ToolCallDelta]:
        """What of this call can go out now: its name (once), then new argument text."""
        out: list[ToolCallDelta] = []
        if self.call_id is None:
            name = self.name
            if name is None:
                return out
            self.call_id = new_call_id()
            out.append(ToolCallDelta(self.index, self.call_id, name))
        if self.args_done:
            return out
        span = self._args_span()
        if span is None:
            if self.closed:  # no arguments given: none
                self.args_done = True
                out.append(ToolCallDelta(self.index, arguments="{}"))
            return out
        _, start, end = span
        if self.text[start] == '"':  # arguments as a JSON string holding the object: decoded, whole
            if end is not None:
                self.args_done = True
                value = self._loads(start, end)
                out.append(ToolCallDelta(self.index, arguments=value if isinstance(value, str) else ""))
            return out
        upto = len(self.text) if end is None else end
        first = max(self.sent_args, start)
        if upto > first:
            out.append(ToolCallDelta(self.index, arguments=self.text[first:upto]))
            self.sent_args = upto
        self.args_done = end is not None
        return out


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that may begin `tag` (held until more text comes)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class _HermesStream(ToolCallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self.state = "content"  # content, call (inside a tag), after (object read, before the end tag)
        self.space = ""  # whitespace after a call, sent only if more content follows

    def feed(self, text: str) -> StreamParts:
        self.buf += text
        out = StreamParts()
        while self.buf:
            if self.state == "content":
                i = self.buf.find(self.START)
                if i < 0:
                    keep = _held_prefix(self.buf, self.START)
                    self._content(out, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                self._content(out, self.buf[:i])
                self.buf, self.state = self.buf[i + len(self.START):], "call"
            elif self.state == "call":
                if not self.calls or self.calls[-1].closed:
                    body = self.buf.lstrip()
                    if not body:
                        break
                    if body[0] != "{":  # not a JSON call: the tag was content
                        self._content(out, self.START)
                        self.state = "content"
                        continue
                    self.buf = body
                    self.calls.append(_CallObject(len(self.calls)))
                call = self._feed_open_call(out)
                if call is None:
                    break
                if call.call_id is None:  # no name: it was not a call
                    self.calls.pop()
                    self._content(out, self.START + call.text)
                self.state = "after"
            else:
                i = self.buf.find(self.END)
                if i < 0:
                    self.buf = self.buf[len(self.buf) - _held_prefix(self.buf, self.END):]
                    break
                self.buf, self.state = self.buf[i + len(self.END):], "content"
        return out

    def _content(self, out: StreamParts, text: str) -> None:
        if self.called and not text.strip():  # whitespace between or after calls: only before more text
            self.space += text
            return
        out.content += self.space + text
        self.space = ""

    def finish(self) -> StreamParts:
        out = StreamParts()
        self.cut = bool(self.calls) and not self.calls[-1].closed
        if self.state == "content":
            self._content(out, self.buf)
        elif self.cut and self.calls[-1].call_id is None:
            self._content(out, self.START + self.calls.pop().text)  # cut before its name: text
        self.buf = ""
        return out


class _JsonCallsStream(ToolCallStream):
    """Bare JSON call objects: between them only whitespace and `separators`. With `prefix`
    (llama3_json), an output that does not start with "{" or the prefix is all content."""

    def __init__(self, separators: str, prefix: str | None) -> None:
        super().__init__()
        self.separators, self.prefix = separators, prefix
        self.state = "start" if prefix is not None else "calls"  # start, calls, content

    def feed(self, text: str) -> StreamParts:
        self.buf += text
        out = StreamParts()
        while self.buf:
            if self.state == "content":
                out.content += self.buf
                self.buf = ""
            elif self.state == "start":
                body = self.buf.lstrip()
                if not body or (self.prefix.startswith(body) and body != self.prefix):
                    break  # more text decides
                if body.startswith(self.prefix):
                    self.buf, self.state = body[len(self.prefix):], "calls"
                else:
                    self.state = "calls" if body[0] == "{" else "content"
            elif self.calls and not self.calls[-1].closed:
                call = self._feed_open_call(out)
                if call is None:
                    break
                if call.call_id is None:  # an object that is no call: what follows is content
                    self.calls.pop()
                    out.content += call.text
                    self.state = "content"
            else:
                body = self.buf.lstrip(self.separators + " \t\r\n")
                if self.prefix and body.startswith(self.prefix):
                    body = body[len(self.prefix):]
                    self.buf = body
                    continue
                self.buf = body
                if not body or (self.prefix and self.prefix.startswith(body)):
                    break
                if body[0] != "{":
                    self.state = "content"
                    continue
                self.calls.append(_CallObject(len(self.calls)))
        return out

    def finish(self) -> StreamParts:
        out = StreamParts()
        self.cut = bool(self.calls) and not self.calls[-1].closed
        if self.cut and self.calls[-1].call_id is None:
            text = self.calls.pop().text
            if self.prefix is not None:  # cut before its name: it was text (the constrained array has none)
                out.content += text
        # Between calls only separators (dropped); before the first, whatever it held back.
        out.content += self.buf.strip(self.separators + " \t\r\n") if self.state == "calls" else self.buf
        self.buf = ""
        return out


class HermesToolParser(ToolParser):
    name = "hermes"

    def stream(self) -> ToolCallStream:
        return _HermesStream()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def stream(self) -> ToolCallStream:
        return _JsonCallsStream(";", "<|python_tag|>")


class JsonArrayToolParser(ToolParser):
    """The constrained format: a JSON array of {"name", "arguments"} objects."""

    name = "json_array"

    def stream(self) -> ToolCallStream:
        return _JsonCallsStream("[,]", None)


# The --tool-call-parser choices (HTTPOptions.tool_call_parser lists the same names).
TOOL_PARSERS: MappingProxyType[str, type[ToolParser]] = MappingProxyType(
    {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser)})


def parser_for(tool_mode: str, configured: str | None) -> ToolParser | None:
    """The parser of a chat output under `tool_mode` (OpenAITools.tool_mode) when the server's
    tool_call_parser is `configured`; None: plain content. "auto" without one is refused."""
    if tool_mode in ("required", "named"):  # constrained to the JSON array of calls
        return JsonArrayToolParser()
    if tool_mode != "auto":
        return None
    if configured is None:
        raise InvalidRequestError("tool_choice 'auto' (the default with tools) needs --tool-call-parser "
                                  f"({' or '.join(TOOL_PARSERS)}) on the server or batch job", "tool_choice")
    if configured not in TOOL_PARSERS:
        raise InvalidRequestError(f"unknown tool_call_parser {configured!r}", "tool_choice")
    return TOOL_PARSERS[configured]()
