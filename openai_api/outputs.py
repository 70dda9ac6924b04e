"""How one request's engine deltas become OpenAI choices: text or tool calls, logprobs, echo and
prompt logprobs, whole (`choice`) or as stream chunks (`ChoiceStream`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from engine import PromptLogprob, StreamDelta
from openai_api.tool_parsers import ToolCallStream, ToolParser

# What a logprob of -inf (or NaN) becomes in JSON, as vLLM writes it.
MIN_LOGPROB = -9999.0


def _finite(lp: float) -> float:
    return lp if math.isfinite(lp) else MIN_LOGPROB


class RequestOutput:
    """The response shape of one request. Choice i answers prompt i // n; `prompts` holds each
    prompt's token ids and its text (what echo prepends)."""

    def __init__(self, token_str: Callable[[int], str], chat: bool, n: int, prompts: list[tuple[list[int], str]],
                 parser: ToolParser | None = None, echo: bool = False, echo_logprobs: int | None = None,
                 prompt_logprobs: int | None = None) -> None:
        self.token_str, self.chat, self.n, self.prompts = token_str, chat, n, prompts
        self.parser = parser  # chat with tools: the calls are parsed out of the text
        self.echo = echo
        self.echo_logprobs = echo_logprobs  # echo with logprobs=k: the prompt's, top k
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs=k (completions: per choice)

    # ---- logprobs ------------------------------------------------------------------------------
    def logprobs(self, deltas: list[StreamDelta], echo_of: list[PromptLogprob | None] | None = None,
                 prompt_ids: list[int] | None = None) -> dict | None:
        """The choice's `logprobs` for these deltas; `echo_of` (completions) puts the prompt's first."""
        lps = [lp for d in deltas for lp in (d.logprobs or [])]
        if not any(d.logprobs is not None for d in deltas) and echo_of is None:
            return None
        tok = self.token_str
        if self.chat:
            return {"content": [{
                "token": tok(lp.token_id), "logprob": _finite(lp.logprob), "bytes": list(tok(lp.token_id).encode()),
                "top_logprobs": [{"token": tok(t), "logprob": _finite(v), "bytes": list(tok(t).encode())}
                                 for t, v in lp.top_logprobs]} for lp in lps]}
        tokens = [tok(lp.token_id) for lp in lps]
        values: list[float | None] = [_finite(lp.logprob) for lp in lps]
        tops: list[dict | None] = [{tok(t): _finite(v) for t, v in lp.top_logprobs} for lp in lps]
        if echo_of is not None and prompt_ids is not None:
            k = self.echo_logprobs or 0
            head_values: list[float | None] = [None]
            head_tops: list[dict | None] = [None]
            for t, e in zip(prompt_ids[1:], echo_of[1:]):
                head_values.append(_finite(e.logprob))
                head_tops.append({**{tok(x): _finite(v) for x, v in e.top_logprobs[:k]}, tok(t): _finite(e.logprob)})
            tokens = [tok(t) for t in prompt_ids] + tokens
            values, tops = head_values + values, head_tops + tops
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": []}

    def prompt_logprobs_of(self, prompt_ids: list[int], entries: list[PromptLogprob | None]) -> list[dict | None]:
        """vLLM's prompt_logprobs: None, then per prompt token {token id: {logprob, rank,
        decoded_token}} for the token itself and the top k."""
        k = self.prompt_logprobs or 0
        out: list[dict | None] = [None]
        for t, e in zip(prompt_ids[1:], entries[1:]):
            d = {str(t): {"logprob": _finite(e.logprob), "rank": e.rank, "decoded_token": self.token_str(t)}}
            for rank, (x, v) in enumerate(e.top_logprobs[:k], 1):
                d.setdefault(str(x), {"logprob": _finite(v), "rank": rank, "decoded_token": self.token_str(x)})
            out.append(d)
        return out

    def group_prompt_logprobs(self, per_choice: list[list[StreamDelta]], i: int) -> list | None:
        """The prompt logprobs of choice i's prompt (whichever of its n choices computed them)."""
        start = (i // self.n) * self.n
        for deltas in per_choice[start:start + self.n]:
            for d in deltas:
                if d.prompt_logprobs is not None:
                    return d.prompt_logprobs
        return None

    # ---- whole responses ------------------------------------------------------------------------
    def choice(self, i: int, deltas: list[StreamDelta], per_choice: list[list[StreamDelta]]) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason
        ids, prompt_text = self.prompts[i // self.n]
        if self.chat:
            choice: dict[str, Any] = {"index": i, "finish_reason": finish, "logprobs": self.logprobs(deltas)}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.parser is not None:
                parsed = self.parser.parse(text)
                message["content"] = parsed.content
                if parsed.tool_calls:
                    message["tool_calls"] = [c.as_openai() for c in parsed.tool_calls]
                    if finish == "stop":
                        choice["finish_reason"] = "tool_calls"
            choice["message"] = message
            return choice
        plp = self.group_prompt_logprobs(per_choice, i) if self.echo_logprobs is not None or \
            self.prompt_logprobs is not None else None
        echo_of = plp if self.echo and self.echo_logprobs is not None else None
        choice = {"index": i, "text": prompt_text + text if self.echo else text, "finish_reason": finish,
                  "logprobs": self.logprobs(deltas, echo_of, ids)}
        if self.prompt_logprobs is not None and plp is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_of(ids, plp)
        return choice

    def chat_prompt_logprobs(self, per_choice: list[list[StreamDelta]]) -> list | None:
        """Chat: vLLM puts the (one) prompt's logprobs beside the choices."""
        if not self.chat or self.prompt_logprobs is None:
            return None
        plp = self.group_prompt_logprobs(per_choice, 0)
        return None if plp is None else self.prompt_logprobs_of(self.prompts[0][0], plp)

    def stream(self, i: int) -> ChoiceStream:
        return ChoiceStream(self, i)


class ChoiceStream:
    """One choice's stream chunks: `parts(delta)` -> the choice objects to send now (none while
    a tool parser holds text back). Logprobs of tokens whose text is held go with the next chunk."""

    def __init__(self, out: RequestOutput, i: int) -> None:
        self.out, self.i = out, i
        self.tools: ToolCallStream | None = out.parser.stream() if out.parser is not None else None
        self.unsent: list[StreamDelta] = []  # deltas whose logprobs have not gone out
        self.started = False
        # Text only (no echo, no tool parser): most streams, on a path that builds nothing else.
        self.plain = out.parser is None and not out.echo

    def parts(self, d: StreamDelta) -> list[dict[str, Any]]:
        if self.plain and d.logprobs is None and not self.unsent:
            return self._plain_parts(d)
        out, i = self.out, self.i
        first = not self.started
        self.started = True
        chunks: list[dict[str, Any]] = []
        if first and out.echo and not out.chat and not d.error:  # the prompt goes first
            ids, prompt_text = out.prompts[i // out.n]
            echo_of = d.prompt_logprobs if out.echo_logprobs is not None else None
            chunks.append({"index": i, "text": prompt_text, "finish_reason": None,
                           "logprobs": out.logprobs([], echo_of, ids) if echo_of is not None else None})
        finish = d.finish_reason
        if not out.chat:
            if d.text or finish is not None:
                chunks.append({"index": i, "text": d.text, "logprobs": out.logprobs(self.unsent + [d]),
                               "finish_reason": finish})
                self.unsent = []
            else:
                self.unsent.append(d)
            return chunks
        delta: dict[str, Any] = {}
        if self.tools is None:
            if d.text:
                delta["content"] = d.text
        else:
            got = self.tools.feed(d.text)
            if finish is not None:
                got.add(self.tools.finish())
                if finish == "stop" and self.tools.called:
                    finish = "tool_calls"
            if got.content:
                delta["content"] = got.content
            if got.tool_calls:
                delta["tool_calls"] = [t.as_openai() for t in got.tool_calls]
        if not delta and finish is None:
            self.unsent.append(d)
            return chunks
        chunks.append({"index": i, "delta": delta, "logprobs": out.logprobs(self.unsent + [d]),
                       "finish_reason": finish})
        self.unsent = []
        return chunks

    def _plain_parts(self, d: StreamDelta) -> list[dict[str, Any]]:
        """parts() for a delta without logprobs on a text-only stream."""
        self.started = True
        finish = d.finish_reason
        if not self.out.chat:
            if d.text or finish is not None:
                return [{"index": self.i, "text": d.text, "logprobs": None, "finish_reason": finish}]
            return []
        if d.text or finish is not None:
            return [{"index": self.i, "delta": {"content": d.text} if d.text else {}, "logprobs": None,
                     "finish_reason": finish}]
        return []
