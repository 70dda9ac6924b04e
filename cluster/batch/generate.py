"""The engine stage: one Ray Data actor per engine runs windows of work rows on an `engine.Engine`
it hosts (`Generate`) and turns each request's deltas into its result row (`result_row`)."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from typing import Any

import msgspec
import pyarrow as pa

from cluster.batch.shards import RESULT_SCHEMA, ResultRow
from engine.errors import InvalidRequestError
from openai_api.tool_parsers import TOOL_PARSERS, JsonArrayToolParser, ToolParser


class Generate:
    """Ray Data stage: one actor per engine, hosting an engine.Engine directly (its loop on a
    background thread). A call is one window, submitted at once in token order; several windows
    are in flight, so the engine's batch never drains between them."""

    def __init__(self, engine_config: dict, prefill_peers: dict | None = None) -> None:
        """prefill_peers: a decode engine's prefill engine actors ({"names": [...], "namespace": ...})."""
        from actors.kv_transfer import RayPrefillSource
        from engine import Engine, EngineConfig, SamplingParams
        from engine.logs import log_to_stderr

        log_to_stderr()
        self._params_decoder = msgspec.msgpack.Decoder(SamplingParams)
        config = EngineConfig.from_kwargs(**engine_config)
        source = None
        if prefill_peers is not None:  # its requests' KV comes from those (any of them: no router here)
            source = RayPrefillSource(config.disaggregation_transfer_backend, prefill_peers["namespace"],
                                      prefill_peers["names"], timeout_s=config.disaggregation_transfer_timeout_s)
        self.engine = Engine(config, kv_source=source)
        self.engine.on_fatal = self._die
        self.engine.start_loop()

    @staticmethod
    def _die(error: BaseException) -> None:
        # A dead loop cannot resume: exit, so Ray Data restarts the actor and retries its windows
        # (rather than writing engine failures as the rows' results).
        print(f"radixray: batch engine failed ({type(error).__name__}: {error}); exiting",
              file=sys.stderr, flush=True)
        os._exit(1)

    async def __call__(self, batch: pa.Table) -> pa.Table:
        loop = asyncio.get_running_loop()
        ids, errors = batch.column("id").to_pylist(), batch.column("error").to_pylist()
        prompts, params = batch.column("input_ids").to_pylist(), batch.column("params").to_pylist()
        echoes, parsers = batch.column("echo").to_pylist(), batch.column("tool_parser").to_pylist()
        loras = batch.column("lora_name").to_pylist()
        rows: list[ResultRow | None] = [None] * len(ids)
        pending: list[tuple[int, list, asyncio.Future]] = []
        for i, rid in enumerate(ids):  # in token order (Preprocess sorted them)
            if errors[i] is not None:
                rows[i] = ResultRow(id=rid, error=errors[i])
                continue
            deltas: list = []
            done = loop.create_future()

            def sink(delta: Any, deltas: list = deltas, done: asyncio.Future = done) -> None:
                deltas.append(delta)  # engine thread; read only after `done` resolves
                if delta.finish_reason is not None:
                    loop.call_soon_threadsafe(done.set_result, None)

            try:  # own request ids: the engine refuses two in flight with one id
                self.engine.submit(prompts[i], self._params_decoder.decode(params[i]), sink, rid=uuid.uuid4().hex,
                                   lora_name=loras[i])
            except InvalidRequestError as e:  # an adapter this engine does not serve included
                rows[i] = ResultRow(id=rid, error=f"invalid request: {e}")
                continue
            pending.append((i, deltas, done))
        await asyncio.gather(*(done for _, _, done in pending))
        for i, deltas, _ in pending:
            try:
                rows[i] = result_row(ids[i], deltas, prompts[i], echoes[i], _tool_parser(parsers[i]))
            except Exception as e:  # one row's output failing fails that row, never its window
                rows[i] = ResultRow(id=ids[i], error=f"output failed: {type(e).__name__}: {e}")
        return pa.Table.from_pylist([msgspec.structs.asdict(r) for r in rows], schema=RESULT_SCHEMA)


def result_row(rid: str, deltas: list, prompt_ids: list[int], echo: str | None = None,
               parser: ToolParser | None = None) -> ResultRow:
    """One request's output row from its engine deltas."""
    last = deltas[-1]
    if last.error:
        return ResultRow(id=rid, error=last.error)
    text, finish, calls = "".join(d.text for d in deltas), last.finish_reason, None
    if parser is not None:
        parsed = parser.parse(text)
        text = parsed.content or ""
        if parsed.tool_calls:
            calls = [c.as_openai() for c in parsed.tool_calls]
            finish = "tool_calls" if finish == "stop" else finish
    plp = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
    if plp is not None:
        plp = [None] + [{"token_id": t, "logprob": e.logprob, "rank": e.rank,
                         "top_logprobs": [{"token_id": x, "logprob": v} for x, v in e.top_logprobs]}
                        for t, e in zip(prompt_ids[1:], plp[1:])]
    return ResultRow(id=rid, text=(echo or "") + text, prompt_tokens=last.prompt_tokens,
                     completion_tokens=last.completion_tokens, cached_tokens=last.cached_tokens,
                     finish_reason=finish, tool_calls=calls, prompt_logprobs=plp)


def _tool_parser(parser: str | None) -> ToolParser | None:
    """A parser by its name in WORK_SCHEMA's tool_parser column."""
    if parser is None:
        return None
    return JsonArrayToolParser() if parser == JsonArrayToolParser.name else TOOL_PARSERS[parser]()
