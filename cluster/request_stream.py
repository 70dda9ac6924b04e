"""One request's life in a Cluster: routed, submitted, its deltas read from its inbox and sent
on at most once per stream interval; re-routed when its engine dies or drains before a token
was streamed, ended with an explicit error when it dies later or the deadline passes, and
aborted on its engine however its reader leaves."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import ray

from actors.protocol import GenerateRequest, encode
from cluster.channels import ENGINE_DIED, FLUSH, TIMED_OUT, Channels, Inbox, merge_deltas
from cluster.config import ClusterConfig
from cluster.routing import Router
from engine import SamplingParams, StreamDelta
from engine.errors import EngineDeadError

log = logging.getLogger("radixray.cluster")
ABORT_CONFIRM_TIMEOUT_S = 10.0  # an abort not acknowledged by then is sent again


def engine_is_gone(error: ray.exceptions.RayError) -> bool:
    """The engine, not just this request, is lost: its actor died or its loop is dead."""
    if isinstance(error, ray.exceptions.RayActorError | ray.exceptions.ActorUnavailableError):
        return True
    return isinstance(getattr(error, "cause", None), EngineDeadError)


async def stream_request(input_ids: list[int], params: SamplingParams, rid: str | None, *, priority: int = 0,
                         lora_name: str | None = None, config: ClusterConfig, lock: threading.Lock,
                         router: Router, channels: Channels, engines: list, consumer: str,
                         send_abort: Callable[[int, str], None]) -> AsyncIterator[StreamDelta]:
    """Route one validated request and stream its deltas. Re-routes if its engine dies
    before a token was streamed; ends with an explicit error if it dies after. `lora_name`: its
    LoRA adapter (None: the base model), routed to an engine that serves it.

    `lock` guards `router` and `channels`; `engines[i].actor` is engine i's actor, which sends
    this request's deltas to its output channel `consumer`; `send_abort(i, rid)` aborts the
    request on engine i.

    Cancel-safe: the only awaits are queue.take() (a plain future) and the submit call, so a
    cancellation always reaches the `finally` that aborts the request on its engine (the
    deadline is a sentinel put on the queue by a timer, not asyncio.wait_for, which can
    swallow a cancellation that races with the item it waits for)."""
    rid = rid or uuid.uuid4().hex
    n_prompt = len(input_ids)
    cost = n_prompt + params.max_new_tokens
    try:
        payload = encode(GenerateRequest(rid=rid, input_ids=input_ids, sampling_params=params, priority=priority,
                                         lora_name=lora_name))
    except (OverflowError, TypeError, ValueError) as e:
        yield StreamDelta.aborted(rid, error=f"invalid request: {e}", kind="invalid_request", prompt_tokens=n_prompt)
        return
    loop = asyncio.get_running_loop()
    interval = config.stream_interval_s
    flush: asyncio.TimerHandle | None = None
    tried: set[int] = set()
    queue = Inbox()
    timer = loop.call_later(config.request_timeout_s, lambda: queue.put_nowait(TIMED_OUT))
    try:
        while True:
            # Picked and subscribed under one lock: an engine retired meanwhile either was
            # not picked or finds this request among those it must re-route.
            # Each attempt reads its own subscription: a late message about an earlier
            # engine is dropped by Channels.deliver, never read as this attempt's.
            with lock:
                idx = router.pick(input_ids, cost, exclude=frozenset(tried), lora_name=lora_name)
                prefill = None  # disaggregated: the prefill engine for the decode engine `idx`
                missing = "engine"
                if idx is not None and router.disaggregated:
                    prefill = router.pick(input_ids, n_prompt, pool="prefill")
                    if prefill is None:
                        router.done(idx, cost, input_ids, lora_name)
                        idx, missing = None, "prefill engine"
                if idx is not None:
                    channels.subscribe_locked(rid, idx, loop, queue)
            if idx is None:
                if lora_name is not None and missing == "engine":
                    missing = f"engine serving LoRA adapter {lora_name!r}"
                yield StreamDelta.aborted(rid, error=f"no {missing} available", kind="overloaded",
                                          prompt_tokens=n_prompt)
                return
            if prefill is not None:  # the decode engine fetches the KV from this one
                payload = encode(GenerateRequest(rid=rid, input_ids=input_ids, sampling_params=params,
                                                 prefill_engine=engines[prefill].name, priority=priority,
                                                 lora_name=lora_name))

            def prefill_done() -> None:  # its part ends with the first token (or the request)
                nonlocal prefill
                if prefill is not None:
                    with lock:
                        router.done(prefill, n_prompt, input_ids)
                    prefill = None

            streamed = finished = rerouted = False
            try:
                channels.taken(rid, await engines[idx].actor.submit.remote(payload, consumer))
                held: list[StreamDelta] = []  # tokens waiting out the stream interval
                while not rerouted:
                    for item in await queue.take():
                        if item is FLUSH:  # an interval since the last event
                            flush = None
                            if held:
                                yield merge_deltas(held)
                                held = []
                                flush = loop.call_later(interval, queue.put_nowait, FLUSH)
                            else:  # nothing came meanwhile: the next delta goes out as it comes
                                queue.quiet = False
                            continue
                        if item is TIMED_OUT or item is ENGINE_DIED:
                            if held:  # what was produced reaches the client first
                                yield merge_deltas(held)
                                held = []
                            if item is ENGINE_DIED:
                                raise ray.exceptions.RayActorError()
                            yield StreamDelta.aborted(rid, error=f"request timed out after {config.request_timeout_s}s",
                                                      kind="timeout", prompt_tokens=n_prompt)
                            return
                        held.append(item)
                        prefill_done()
                        finished = item.finish_reason is not None
                        if item.error_kind == "draining" and not streamed:  # handed back: elsewhere
                            rerouted = True
                            break
                        # The first tokens and the end go out at once; the rest at most once per
                        # stream interval, merged: after an event, deltas wait (without waking
                        # us) for the flush an interval later, unless the end comes first.
                        if finished or not queue.quiet:
                            delta = merge_deltas(held)
                            held = []
                            streamed = streamed or bool(delta.token_ids)
                            yield delta
                            if finished:
                                return
                            if streamed and interval > 0:
                                queue.quiet = True
                                flush = loop.call_later(interval, queue.put_nowait, FLUSH)
            except ray.exceptions.TaskCancelledError:
                # Inside a Serve request the submit is a child task of the request, which Serve
                # cancels with it when the client goes away: the request was cancelled, not failed
                # (an explicit end: our own task's cancellation may come later, or not at all).
                yield StreamDelta.aborted(rid, error="request cancelled", kind="aborted", prompt_tokens=n_prompt)
                return
            except ray.exceptions.RayError as e:  # the actor died, or its engine loop is dead
                if not engine_is_gone(e):  # this request's failure, not the engine's
                    log.error("request %s failed on engine %d", rid, idx, exc_info=e)
                    yield StreamDelta.aborted(rid, error=f"engine error: {type(e).__name__}", kind="engine_error",
                                              prompt_tokens=n_prompt)
                    return
                with lock:
                    router.set_healthy(idx, False)
                if streamed:
                    yield StreamDelta.aborted(rid, error=f"engine {idx} died mid-stream: {type(e).__name__}",
                                              kind="engine_error", prompt_tokens=n_prompt)
                    return
                tried.add(idx)  # nothing streamed yet: try another engine
                log.warning("engine %d died before streaming request %s; re-routing", idx, rid)
            finally:
                if flush is not None:
                    flush.cancel()
                    flush = None
                channels.unsubscribe(rid)
                if not finished:  # cancelled, timed out, or given up on: free its KV there
                    send_abort(idx, rid)
                with lock:
                    router.done(idx, cost, input_ids, lora_name)
                prefill_done()
            if rerouted:
                tried.add(idx)
                log.info("engine %d is draining; re-routing request %s", idx, rid)
            queue = Inbox()
    finally:
        timer.cancel()


def send_abort(loop: asyncio.AbstractEventLoop, actor: Any, idx: int, rid: str) -> None:
    """Abort `rid` on engine idx (`actor`) from `loop`, the cluster's own, until the engine confirms it.

    Not from the caller's context: inside a Ray Serve request, an actor call is a child task
    of that request (Ray keeps an async actor's current task in a context variable), and when
    the client goes away Serve cancels the request *recursively*, which can cancel the abort
    itself before the engine runs it. So: another thread, and an empty context."""
    loop.call_soon_threadsafe(lambda: asyncio.ensure_future(_abort_confirmed(actor, idx, rid)),
                              context=contextvars.Context())


async def _abort_confirmed(actor: Any, idx: int, rid: str, attempts: int = 5) -> None:
    for _ in range(attempts):
        try:
            await asyncio.wait_for(asyncio.wrap_future(actor.abort.remote(rid).future()),
                                   timeout=ABORT_CONFIRM_TIMEOUT_S)
            return
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            return  # the engine is gone, and the request with it
        except Exception as e:  # cancelled or lost on the way, or slow: send it again
            log.warning("abort of %s on engine %d not confirmed (%s); sending it again", rid, idx,
                        type(e).__name__)
    log.error("abort of %s on engine %d was never confirmed", rid, idx)
