"""The OpenAI-compatible HTTP app: front-end replicas (tokenize, route, stream) in front of the
engine deployment (deploy/engines.py), found through the Fleet registry.

`build_app(args)` is the import path for `serve run` / `serve deploy` / RayService
(`deploy.app:build_app`); `python -m cluster serve` calls it too."""


import asyncio
import concurrent.futures
import contextlib
import hmac
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from types import MappingProxyType
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cluster import Cluster
from deploy.engines import Fleet, engine_deployment, frontend_options, gang_size
from deploy.metrics import ServerMetrics, StatsCache
from deploy.options import AppArgs
from engine import InvalidRequestError, SamplingParams, StreamDelta
from engine.errors import invalid_request_from
from engine.logs import log_to_stderr
from engine.lora import UnknownLoRAError
from engine.tokenizer import LONG_TEXT_CHARS
from openai_api.outputs import RequestOutput
from openai_api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from openai_api.served_model import served_model_name
from openai_api.tool_parsers import JsonArrayToolParser, parser_for

log = logging.getLogger("radixray.http")

# The deployments' shape, not the replicas' arguments: changing them rescales (or re-tunes the
# autoscalers) instead of restarting every replica with new arguments.
FLEET_SIZE_FIELDS = ("num_engines", "prefill_engines", "decode_engines", "frontends", "max_frontends", "min_engines", "max_engines",
                     "target_requests_per_frontend", "target_waiting_per_engine", "target_kv_use",
                     "upscale_delay_s", "downscale_delay_s", "max_prefill_engines", "max_decode_engines",
                     "target_waiting_tokens_per_prefill_engine")
SSE_KEEPALIVE_S = 1.0  # longest silence on a stream while tokens without text are generated
CHUNK_END = b"}\n\n"  # closes an event whose choices (and usage) follow the shared head


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status)


# How an engine-side error kind reaches the client (StreamDelta.error_kind).
ERROR_STATUS = MappingProxyType({"invalid_request": (400, "invalid_request_error"), "overloaded": (503, "server_error"),
                "timeout": (504, "server_error"), "aborted": (503, "server_error"),
                "engine_error": (500, "server_error"), "draining": (503, "server_error")})


def internal_error_message(rid: str) -> str:
    """What a client is told of a failure inside the server: the request id to quote, never the
    exception's text (it may name internals); the log has the details under that id."""
    return f"internal error while serving the request (request id {rid}); the server log has the details"


def invalid_response(e: InvalidRequestError) -> JSONResponse:
    """A 400 naming the parameter (and, for a request over a limit, the limit: code limit_exceeded)."""
    return error_response(400, str(e), param=e.param, code=getattr(e, "code", None))


async def read_body(request: Request, limit: int) -> bytearray | None:
    """The body as it arrives, or None as soon as more than `limit` bytes have come: a body without
    Content-Length (chunked) is cut there too, and the rest of it is never read or held."""
    body = bytearray()
    async with contextlib.aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            if len(body) + len(chunk) > limit:
                return None
            body += chunk
    return body


def allowed_lora_path(path: str, root: str) -> str:
    """`path` resolved (symbolic links, `..`) if it lies under folder `root` (resolved too), and
    so does every entry in it (a link inside may not lead out); InvalidRequestError naming
    lora_path otherwise."""
    real, top = os.path.realpath(path), os.path.realpath(root)

    def outside(p: str) -> bool:
        return os.path.commonpath([p, top]) != top

    if not os.path.isabs(path) or outside(real):
        raise InvalidRequestError(f"lora_path {path!r} is not an absolute path under the allowed LoRA root "
                                  "(allowed_lora_root)", "lora_path")
    if os.path.isdir(real) and any(outside(os.path.realpath(e.path)) for e in os.scandir(real)):
        raise InvalidRequestError(f"lora_path {path!r} holds a link that leads out of the allowed LoRA root "
                                  "(allowed_lora_root)", "lora_path")
    return real


def delta_error_response(delta: StreamDelta) -> JSONResponse:
    status, type_ = ERROR_STATUS.get(delta.error_kind or "engine_error", (500, "server_error"))
    return error_response(status, delta.error or "request failed", type_, code=delta.error_kind)


def bearer_ok(request: Request, api_key: str | None) -> bool:
    """The one API-key check of every endpoint (constant-time compare of the bearer token)."""
    if api_key is None:
        return True
    auth = request.headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return hmac.compare_digest(token.encode(), api_key.encode())


class ClientDisconnected(Exception):
    """The client of a request went away while it was generating."""


class ClientWatch:
    """Reads the connection for the client's disconnect, then cancels the task serving the
    request: Serve need not cancel a handler when its client goes away, and a response waiting
    for its next event never sees the disconnect. Whoever catches the CancelledError calls
    `absorb()` to tell this cancellation (the request ends quietly) from any other."""

    def __init__(self, receive: Receive) -> None:
        self.gone = False
        self._task = asyncio.current_task()
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._task is not None:
            self._task.cancel()

    def absorb(self) -> bool:
        """In `except CancelledError`: whether the client's disconnect caused it (then undone)."""
        if not self.gone:
            return False
        self.gone = False  # one cancellation, absorbed once
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            task.uncancel()
        return True

    def close(self) -> None:
        self._watcher.cancel()


SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))


class SSEResponse(Response):
    """A text/event-stream response: one ASGI send per event, nothing in between (no task
    group, no extra queue). `events(watch)` makes the body; the watch cancels it when the client
    disconnects. The body generator is closed however the response ends (a generator abandoned
    at a `yield` would run its cleanup, aborting the request, only when garbage-collected)."""

    def __init__(self, events: Callable[[ClientWatch], AsyncIterator[bytes]], metrics: ServerMetrics) -> None:
        super().__init__(status_code=200)
        self.raw_headers = [*SSE_HEADERS]
        self.events, self.metrics = events, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ClientWatch(receive)
        body = self.events(watch)
        metrics = self.metrics
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in body:
                await send({"type": "http.response.body", "body": event, "more_body": True})
                metrics.sse_events += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
        except OSError:  # the server found the client gone while writing
            pass
        finally:
            watch.close()
            await body.aclose()


class FrontendHeader:
    """Names the front-end replica that answered (x-radixray-frontend), for operators tracing a
    request across replicas. Plain ASGI: Starlette's @app.middleware("http") would pipe every
    streamed event through an extra task and memory stream."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (b"x-radixray-frontend", serve.get_replica_context().replica_id.unique_id.encode())

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), header]
            await send(message)

        await self.app(scope, receive, send_named)


app = FastAPI(title="radixray", description="OpenAI-compatible API over radixray engine actors")


app.add_middleware(FrontendHeader)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes (404), wrong methods (405): the OpenAI error shape, not FastAPI's."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = {404: f"no route {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code,
                                                                                         str(exc.detail))
    response = error_response(exc.status_code, message, code=code)
    if exc.headers:
        response.headers.update(exc.headers)
    return response


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(400, f"invalid request: {exc}")


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(app)
class OpenAIServer:
    """One front-end replica: every replica routes on the same view of the same engines."""

    def __init__(self, args: dict[str, Any] | None = None, fleet: Any = None, engines: Any = None) -> None:
        log_to_stderr()
        self.args = AppArgs.from_dict(args)
        self.http = self.args.http
        self.fleet = fleet
        self.cluster = Cluster(self.args.cluster, fleet=fleet)
        self.model_name = served_model_name(self.args.cluster.model_path, self.http.served_model_name)
        self.metrics = ServerMetrics(serve.get_replica_context().replica_id.unique_id)
        self.engine_stats = StatsCache(self._fetch_stats, self.http.metrics_refresh_s)
        self.encoder = msgspec.json.Encoder()  # one per replica: reused by every event
        self.limits = self.args.cluster.limits
        # Long prompts' tokenization, chat templates and grammars run here, off the event loop
        # (they would stall every stream of this replica), at most tokenize_threads at once;
        # short ones run inline (_tokenizing).
        self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(self.limits.tokenize_threads,
                                                                   thread_name_prefix="radixray-tokenize")
        self.created = int(time.time())

    def __del__(self) -> None:  # Serve calls it when the replica stops (the engines stay)
        pool = getattr(self, "tokenize_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            cluster.shutdown()

    # ---- plumbing --------------------------------------------------------------------------
    async def _read(self, request: Request, schema: type) -> Any:
        """Size, auth and body checks; returns the parsed body or an error response."""
        if not bearer_ok(request, self.http.api_key):
            return error_response(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        limit = self.limits.max_body_bytes
        length = request.headers.get("content-length")
        too_large = length is not None and length.isdigit() and int(length) > limit
        body = None if too_large else await read_body(request, limit)
        if body is None:
            return error_response(413, f"request body over {limit} bytes (limit max_body_bytes={limit})",
                                  code="body_too_large")
        try:
            parsed = msgspec.json.decode(body, type=schema)
            parsed.validate()
        except msgspec.ValidationError as e:
            err = invalid_request_from(e, "invalid request: ")
            return error_response(400, err.message, param=err.param)
        except InvalidRequestError as e:
            return error_response(400, e.message, param=e.param)
        except msgspec.DecodeError as e:
            return error_response(400, f"malformed JSON body: {e}")
        except RecursionError:
            return error_response(400, "malformed JSON body: nested too deeply")
        model = getattr(parsed, "model", None)
        if model is not None and model != self.model_name and not await self._serves_adapter(model):
            return error_response(404, f"model {model!r} does not exist (serving {self.model_name!r} and its "
                                  "LoRA adapters)", param="model", code="model_not_found")
        return parsed

    async def _serves_adapter(self, name: str) -> bool:
        """Whether `name` is a LoRA adapter of the engines (a name this front end does not know
        asks them: another front end may have loaded it)."""
        return (self.cluster.has_lora_adapter(name, refresh=False)
                or await asyncio.to_thread(self.cluster.has_lora_adapter, name))

    def _lora_name(self, model: str | None) -> str | None:
        """The adapter a request runs under (`model` checked by _read): None for the base model."""
        return None if model is None or model == self.model_name else model

    def _no_engine(self) -> JSONResponse | None:
        if not any(self.cluster.healthy()):
            return error_response(503, "no engine is available", "server_error", code="no_engine")
        return None

    async def _merged(self, rid: str, choices: list[tuple[list[int], SamplingParams]],
                      watch: ClientWatch, req: Any) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Stream several choices (prompt ids, sampling) of request body `req` (its priority, and
        its model: a LoRA adapter or the base model) at once: (choice index, delta) as they
        come; every choice ends with a final delta, whatever stream_ids does. Raises
        ClientDisconnected when `watch` cancels us (the client went away): cancelling our task
        reaches each stream_ids's `finally`, which aborts its request on its engine."""
        rids = [f"{rid}-{i}" for i in range(len(choices))]
        priority, lora_name = req.priority, self._lora_name(req.model)

        def failed(i: int, e: Exception) -> StreamDelta:  # a bug: an explicit error, never a choice with no end
            log.exception("request %s failed", rids[i])
            return StreamDelta.aborted(rids[i], error=internal_error_message(rids[i]), kind="engine_error",
                                       prompt_tokens=len(choices[i][0]))

        try:
            if len(choices) == 1:  # straight from stream_ids: no task or queue per delta
                ids, params = choices[0]
                try:
                    async with contextlib.aclosing(self.cluster.stream_ids(ids, params, rids[0], priority,
                                                                           lora_name)) as deltas:
                        async for d in deltas:
                            if d.error:
                                log.warning("request %s ended with an error (%s): %s", rids[0], d.error_kind, d.error)
                            yield 0, d
                except Exception as e:
                    yield 0, failed(0, e)
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, ids: list[int], params: SamplingParams) -> None:
                try:
                    async with contextlib.aclosing(self.cluster.stream_ids(ids, params, rids[i], priority,
                                                                           lora_name)) as deltas:
                        async for d in deltas:
                            queue.put_nowait((i, d))
                except Exception as e:
                    queue.put_nowait((i, failed(i, e)))
                finally:
                    queue.put_nowait((i, None))

            tasks = [asyncio.create_task(pump(i, ids, p)) for i, (ids, p) in enumerate(choices)]
            try:
                live = len(choices)
                while live:
                    i, d = await queue.get()
                    if d is None:
                        live -= 1
                        continue
                    if d.error:
                        log.warning("request %s ended with an error (%s): %s", rids[i], d.error_kind, d.error)
                    yield i, d
            finally:
                # A disconnect, a client timeout or a shutdown cancels us here. Cancelling a pump
                # raises CancelledError inside stream_ids, whose finally aborts the request on
                # its engine (stream_ids has no await that could swallow the cancellation).
                for t in tasks:
                    t.cancel()
        except asyncio.CancelledError:
            if not watch.absorb():
                raise
            raise ClientDisconnected(rid) from None

    def _client_left(self, rid: str, choices: int) -> None:
        """Every choice of a request whose client went away before its response counts as aborted."""
        self.metrics.requests["aborted"] += choices
        log.info("request %s aborted: the client went away", rid)

    def _record(self, last: StreamDelta, tokens: int) -> None:
        """A choice that ended: its final delta and how many tokens it generated."""
        status = "ok" if not last.error else ("aborted" if last.error_kind == "aborted" else "error")
        self.metrics.requests[status] += 1
        self.metrics.prompt_tokens += last.prompt_tokens
        self.metrics.generation_tokens += tokens

    def _token_str(self, token_id: int) -> str:
        return self.cluster.tokenizer.decode([token_id], skip_special_tokens=False)

    @staticmethod
    def _usage(lasts: list[StreamDelta | None], n: int) -> dict:
        """Usage from each choice's latest delta (None: none yet). A prompt counts once for its
        n choices; its cached tokens are the most any of its choices found in the cache."""
        if len(lasts) == 1:  # one choice (every event of most streams with continuous usage)
            d = lasts[0]
            prompt, completion, cached = (d.prompt_tokens, d.completion_tokens, d.cached_tokens) if d else (0, 0, 0)
            return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                    "prompt_tokens_details": {"cached_tokens": cached}}
        prompt = cached = 0
        for start in range(0, len(lasts), n):
            group = [d for d in lasts[start:start + n] if d is not None]
            if group:
                prompt += group[0].prompt_tokens
                cached += max(d.cached_tokens for d in group)
        completion = sum(d.completion_tokens for d in lasts if d is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    # ---- endpoints -------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        healthy = self.cluster.healthy()
        ok = bool(healthy) and all(healthy)  # an empty fleet (all replaced at once) serves nothing
        status = 200 if ok else 503
        return JSONResponse({"healthy": ok, "engines": healthy,
                             "engine_actors": self.cluster.actor_names}, status_code=status)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        if not bearer_ok(request, self.http.api_key):
            return error_response(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")
        card = {"object": "model", "created": self.created, "owned_by": "radixray",
                "max_model_len": self.cluster.inputs.max_len}
        adapters = await asyncio.to_thread(self.cluster.lora_adapters)
        # vLLM's cards: each LoRA adapter names the base model as its `parent`.
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, **card, "parent": None},
            *({"id": name, **card, "parent": self.model_name} for name in adapters if name != self.model_name)]})

    # ---- LoRA adapters at run time (vLLM's endpoints) ------------------------------------------
    def _runtime_lora_refused(self) -> JSONResponse | None:
        if self.http.allowed_lora_root is None:
            return error_response(403, "loading and unloading LoRA adapters at run time is off on this server: "
                                  "start it with allowed_lora_root (--allowed-lora-root) naming the folder "
                                  "that holds them", "permission_error", code="lora_updates_disabled")
        return None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, request: Request) -> Response:
        """Load a PEFT adapter on every engine; requests then name it as their `model`."""
        req = await self._read(request, LoadLoRAAdapterRequest)
        if isinstance(req, Response):
            return req
        if (refused := self._runtime_lora_refused()) is not None:
            return refused
        if req.lora_name == self.model_name:
            return error_response(400, f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
        try:
            path = allowed_lora_path(req.lora_path, self.http.allowed_lora_root)
            await asyncio.to_thread(self.cluster.load_lora_adapter, req.lora_name, path, req.pinned)
        except InvalidRequestError as e:  # LoRAAdapterError included: a bad adapter, a name in use
            return invalid_response(e)
        except Exception:
            log.exception("loading LoRA adapter %r failed", req.lora_name)
            return error_response(503, f"LoRA adapter {req.lora_name!r} could not be loaded: no engine answered",
                                  "server_error", code="no_engine")
        log.info("LoRA adapter %r loaded from %s", req.lora_name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, request: Request) -> Response:
        """Unload an adapter from every engine (its running requests finish with it)."""
        req = await self._read(request, UnloadLoRAAdapterRequest)
        if isinstance(req, Response):
            return req
        if (refused := self._runtime_lora_refused()) is not None:
            return refused
        try:
            gone = await asyncio.to_thread(self.cluster.unload_lora_adapter, req.lora_name)
        except UnknownLoRAError:
            return error_response(404, f"LoRA adapter {req.lora_name!r} is not loaded", param="lora_name",
                                  code="model_not_found")
        except Exception:
            log.exception("unloading LoRA adapter %r failed", req.lora_name)
            return error_response(503, f"LoRA adapter {req.lora_name!r} could not be unloaded: no engine answered",
                                  "server_error", code="no_engine")
        log.info("LoRA adapter %r unloaded", req.lora_name)
        later = "" if gone else " (the requests running under it finish first)"
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.{later}")

    async def _fetch_stats(self) -> tuple[Any, Any]:
        """Every engine's stats and the fleet registry's events: what /metrics caches."""
        stats = await asyncio.to_thread(self.cluster.stats)
        try:
            fleet = await asyncio.wait_for(self.fleet.stats.remote(), timeout=5) if self.fleet is not None else None
        except Exception:  # the registry is restarting: the rest of the page still renders
            fleet = None
        return stats, fleet

    @app.get("/metrics")
    async def metrics_endpoint(self) -> Response:
        # Open without the API key, as vLLM's: Prometheus scrapes without the inference
        # credential, the page holds counts only, and a scrape costs no engine call (cached).
        stats, fleet = await self.engine_stats.get()
        return PlainTextResponse(self.metrics.render(stats, fleet, self.engine_stats.refreshes),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(self, request: Request) -> Response:
        req = await self._read(request, TokenizeRequest)
        if isinstance(req, Response):
            return req
        try:
            if req.messages is not None:
                self.limits.check_messages(len(req.messages))
            prompt = req.prompt_input()
            size = self.cluster.inputs.check_prompt_chars(prompt.get("prompt"), prompt.get("messages"),
                                                          prompt.get("tools"))
            ids = await self._tokenizing(size, self.cluster.inputs.tokenize, **prompt)
        except InvalidRequestError as e:
            return invalid_response(e)
        except RecursionError:  # a chat template over deeply nested content
            return error_response(400, "request nested too deeply")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.cluster.inputs.max_len})

    @app.post("/detokenize")
    async def detokenize(self, request: Request) -> Response:
        req = await self._read(request, DetokenizeRequest)
        if isinstance(req, Response):
            return req
        try:
            self.cluster.inputs.validate_input_ids(req.tokens)
        except InvalidRequestError as e:
            return error_response(400, str(e).replace("the prompt", "tokens"), param="tokens")
        text = await self._tokenizing(len(req.tokens), self.cluster.tokenizer.decode, req.tokens,
                                      skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, ChatCompletionRequest, chat=True)

    async def _handle(self, request: Request, schema: type, chat: bool) -> Response:
        """Everything is validated here, before anything is queued on an engine."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        response = await self._validated_response(request, schema, chat, rid)
        response.headers["x-radixray-request-id"] = rid  # (Serve sets x-request-id)
        return response

    async def _validated_response(self, request: Request, schema: type, chat: bool, rid: str) -> Response:
        req = await self._read(request, schema)
        if isinstance(req, Response):
            return self._rejected(rid, req)
        try:
            # The limits first, cheapest first: nothing is copied, tokenized or queued for a
            # request over one of them.
            if chat:
                self.limits.check_messages(len(req.messages))
            self.limits.check_stops(req.stop, req.stop_token_ids)
            params = req.sampling(self.http.default_max_tokens)
            self.limits.check_grammar(params.constraint)  # before it is compiled
            self.limits.check_choices(req.num_prompts(), req.n)
            parser = parser_for(req.tool_mode, self.http.tool_call_parser) if chat else None
            prompts = req.prompts()
            size = 0
            for p in prompts:
                size += self.cluster.inputs.check_prompt_chars(p.get("prompt"), p.get("messages"), p.get("tools"))
                size += len(p.get("input_ids") or ())
            # A grammar (or a tool schema) may take long to compile, whatever the prompt's size.
            compiles = params.constraint is not None or isinstance(parser, JsonArrayToolParser)
            inputs = await self._tokenizing(LONG_TEXT_CHARS if compiles else size, self._tokenize_and_check,
                                            prompts, params, parser)
        except InvalidRequestError as e:
            return self._rejected(rid, invalid_response(e))
        except RecursionError:  # a chat template over deeply nested content
            return self._rejected(rid, error_response(400, "request nested too deeply"))
        if (busy := self._no_engine()) is not None:
            return self._rejected(rid, busy)
        obj = "chat.completion" if chat else "text_completion"
        echo = not chat and req.echo
        out = RequestOutput(self._token_str, chat, req.n, [
            (ids, self._echo_text(p, ids, params) if echo else "") for p, ids in zip(prompts, inputs)],
            parser=parser, echo=echo, echo_logprobs=req.logprobs if echo else None,
            prompt_logprobs=req.prompt_logprobs)
        # n choices per prompt (index = prompt * n + j), each with its own seed stream; they share
        # the prompt's prefill through the radix cache, so only the first computes prompt logprobs
        # (streamed, each its own: a choice's first chunk may come before the first choice's).
        choices = [(ids, self._choice_params(params, j, share_prompt_logprobs=not req.stream))
                   for ids in inputs for j in range(req.n)]
        return await self._respond(request, req, rid, obj, choices, out)

    async def _tokenizing(self, size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn inline on the event loop when its input is short (`size` characters or token ids
        under LONG_TEXT_CHARS), else on the tokenizer pool: a short request never waits behind
        long ones holding every thread of the pool, and a short one stalls no stream for long."""
        if size < LONG_TEXT_CHARS:
            return fn(*args, **kwargs)
        return await self._off_loop(fn, *args, **kwargs)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn on the tokenizer pool (bounded: tokenize_threads at once): the event loop, and every
        stream it serves, goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, lambda: fn(*args, **kwargs))

    def _tokenize_and_check(self, prompts: list[dict[str, Any]], params: SamplingParams,
                            parser: Any) -> list[list[int]]:
        """On the tokenizer pool: chat templates, tokenization, the tool schema and the per-prompt
        checks (context, vocabulary, grammar)."""
        inputs = [self.cluster.inputs.tokenize(**p) for p in prompts]
        if isinstance(parser, JsonArrayToolParser):
            self._compile_tool_schema(params)
        for ids in inputs:
            self.cluster.inputs.validate_request(len(ids), params)
        return inputs

    @staticmethod
    def _choice_params(params: SamplingParams, j: int, share_prompt_logprobs: bool) -> SamplingParams:
        """The sampling of the j-th choice of a prompt."""
        if j == 0:
            return params
        changes: dict[str, Any] = {}
        if params.seed is not None:
            changes["seed"] = (params.seed + j) % (1 << 64)
        if share_prompt_logprobs and params.prompt_logprobs is not None:
            changes["prompt_logprobs"] = None
        return msgspec.structs.replace(params, **changes) if changes else params

    def _compile_tool_schema(self, params: SamplingParams) -> None:
        """A tool whose parameters schema does not compile is the `tools` parameter's fault."""
        try:
            self.cluster.inputs.compile_grammar(params)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"a tool's parameters schema does not compile: {e.message}", "tools") from None

    def _echo_text(self, prompt: dict[str, Any], ids: list[int], params: SamplingParams) -> str:
        text = prompt.get("prompt")
        return text if isinstance(text, str) else self.cluster.tokenizer.decode(ids, params.skip_special_tokens)

    def _rejected(self, rid: str, response: JSONResponse) -> JSONResponse:
        self.metrics.requests["invalid" if response.status_code < 500 else "error"] += 1
        log.info("request %s rejected (%d): %s", rid, response.status_code,
                 msgspec.json.decode(response.body)["error"]["message"][:200])
        return response

    # ---- responses ---------------------------------------------------------------------------
    async def _respond(self, request: Request, req, rid: str, obj: str,
                       choices: list[tuple[list[int], SamplingParams]], out: RequestOutput) -> Response:
        if req.stream:
            return SSEResponse(lambda watch: self._sse(req, rid, choices, out, watch), self.metrics)
        t0 = time.monotonic()
        per_choice: list[list[StreamDelta]] = [[] for _ in choices]
        watch = ClientWatch(request.receive)
        try:
            async with contextlib.aclosing(self._merged(rid, choices, watch, req)) as merged:
                async for i, d in merged:
                    if not per_choice[i] and d.token_ids:
                        self.metrics.ttft.observe(time.monotonic() - t0)
                    per_choice[i].append(d)
        except ClientDisconnected:
            self._client_left(rid, len(choices))
            return Response(status_code=499)  # nobody reads it
        except Exception:  # a failure here, not a client that left
            log.exception("request %s failed", rid)
            self.metrics.requests["error"] += len(choices)
            return error_response(500, internal_error_message(rid), "server_error", code="internal_error")
        except BaseException:  # cancelled: the client timed out or went away, or a shutdown
            self._client_left(rid, len(choices))
            raise
        finally:
            watch.close()
        if watch.absorb():  # the client left as the last delta came (its stream may end in an error)
            self._client_left(rid, len(choices))
            return Response(status_code=499)
        finals = [c[-1] for c in per_choice]
        for c in per_choice:
            self._record(c[-1], sum(len(d.token_ids) for d in c))
        failed = next((f for f in finals if f.error), None)
        if failed is not None:
            return delta_error_response(failed)
        body = {"id": rid, "object": obj, "created": int(time.time()), "model": req.model or self.model_name,
                "choices": [out.choice(i, deltas, per_choice) for i, deltas in enumerate(per_choice)],
                "usage": self._usage(finals, req.n)}
        if (plp := out.chat_prompt_logprobs(per_choice)) is not None:
            body["prompt_logprobs"] = plp
        return JSONResponse(body)

    async def _sse(self, req, rid: str, choices: list[tuple[list[int], SamplingParams]], out: RequestOutput,
                   watch: ClientWatch) -> AsyncIterator[bytes]:
        """The events of a streamed response. What every event of the request shares (id,
        object, created, model) is encoded once; an event encodes only its choices (and usage)."""
        chat, encode, metrics = out.chat, self.encoder.encode, self.metrics
        n = len(choices)
        head = b"data: " + encode({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": int(time.time()), "model": req.model or self.model_name,
                                   "choices": ()})[:-3]
        continuous, group = req.continuous_usage, req.n
        t0 = time.monotonic()
        last_token_at: list[float | None] = [None] * n
        lasts: list[StreamDelta | None] = [None] * n  # each choice's latest delta (counts are running totals)
        generated = [0] * n
        streams = [out.stream(i) for i in range(n)]

        def chunk(parts: list[dict], usage: dict | None = None) -> bytes:
            if usage is None and continuous and parts:
                usage = self._usage(lasts, group)
            return head + encode(parts) + (CHUNK_END if usage is None else b',"usage":' + encode(usage) + CHUNK_END)

        if chat:
            for i in range(n):  # one chunk per choice, as the other servers send it
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
        last_write = time.monotonic()
        failure: Exception | None = None
        try:
            async with contextlib.aclosing(self._merged(rid, choices, watch, req)) as merged:
                async for i, d in merged:
                    lasts[i] = d
                    now = time.monotonic()
                    if d.token_ids:
                        count = len(d.token_ids)
                        generated[i] += count
                        metrics.streamed_tokens += count
                        at = last_token_at[i]
                        if at is None:
                            metrics.ttft.observe(now - t0)
                        else:
                            metrics.itl.observe(now - at)
                        last_token_at[i] = now
                    if d.error:  # after the 200: the text it still carries, an error event, a finish_reason
                        if d.text:
                            part = {"index": i, "logprobs": None, "finish_reason": None}
                            yield chunk([{**part, "delta": {"content": d.text}} if chat else {**part, "text": d.text}])
                        _, type_ = ERROR_STATUS.get(d.error_kind or "engine_error", (500, "server_error"))
                        yield b"data: " + encode({"error": {
                            "message": d.error, "type": type_, "param": None, "code": d.error_kind}}) + b"\n\n"
                        finish = {"index": i, "logprobs": None, "finish_reason": d.finish_reason}
                        yield chunk([{**finish, "delta": {}} if chat else {**finish, "text": ""}])
                        continue
                    parts = streams[i].parts(d)
                    if not parts:
                        # Tokens with no text to send yet send nothing; an SSE comment now and then keeps
                        # the connection written to, which is how a client disconnect gets noticed (then
                        # the request is aborted). Clients ignore comment lines.
                        if now - last_write > SSE_KEEPALIVE_S:
                            last_write = now
                            yield b": keep-alive\n\n"
                        continue
                    last_write = now
                    for part in parts:
                        yield chunk([part])
        except ClientDisconnected:
            self._client_left(rid, n)
            return  # the client is gone: nothing more to write
        except Exception as e:  # a failure here, not a client that left: the stream ends with an error
            failure = e
            log.exception("request %s failed while streaming", rid)
        except BaseException:  # cancelled (a client timeout, a shutdown), or closed at a yield (a failed write)
            self._client_left(rid, n)
            raise
        ended = 0
        for last, tokens in zip(lasts, generated):
            if last is not None and (failure is None or last.finish_reason is not None):
                self._record(last, tokens)
                ended += 1
        if failure is not None:
            self.metrics.requests["error"] += n - ended  # the choices it left without an end
            yield b"data: " + encode({"error": {"message": internal_error_message(rid), "type": "server_error",
                                                "param": None, "code": "internal_error"}}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        if req.include_usage:
            yield chunk([], self._usage(lasts, group))
        yield b"data: [DONE]\n\n"


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """Serve app builder: `serve run deploy.app:build_app num_engines=2 ...` or serve_config.yaml."""
    parsed = AppArgs.from_dict(args)  # validate before anything starts
    # The fleet's size is the deployments' replica counts, not a replica's argument: changing it
    # scales the deployments instead of restarting every replica with new arguments.
    # Each replica sees the fleet as one engine group (a DP gang, or a lone engine).
    gang = gang_size(parsed.cluster)
    args = {**{k: v for k, v in (args or {}).items() if k not in FLEET_SIZE_FIELDS}, "num_engines": gang}
    if parsed.cluster.enable_dp_attention:
        args["dp_group_size"] = gang
    fleet = Fleet.bind()
    if parsed.cluster.disaggregated:  # two pools: the decode deployment holds the prefill one
        prefill = engine_deployment(parsed.cluster, parsed.fleet, "prefill").bind(
            {**args, "disaggregation_mode": "prefill"}, fleet)
        engines = engine_deployment(parsed.cluster, parsed.fleet, "decode").bind(
            {**args, "disaggregation_mode": "decode"}, fleet, prefill)
    else:
        engines = engine_deployment(parsed.cluster, parsed.fleet).bind(args, fleet)
    # The front end holds no handle to the engines' deployment, only to the registry; binding it
    # makes Serve deploy the engines as part of this application.
    return OpenAIServer.options(**frontend_options(parsed.fleet)).bind(args, fleet, engines)
