"""Engine: one device's serving engine (scheduler + radix cache + KV pool + model runner).

Thread model: `submit` and `abort` may be called from any thread (they go through an inbox);
`step` runs on one thread at a time. `generate`/`stream` drive `step` themselves unless a
background loop (`start_loop`) owns it, as in the Ray actor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import random
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import torch

from engine.builtin_model import builtin_model_path
from engine.config import EngineConfig
from engine.disaggregation.transfer import KVSender, KVSource
from engine.errors import ConfigError, EngineDeadError, ErrorKind, InvalidRequestError
from engine.forward_batch import ForwardMode
from engine.hicache.config import model_identity
from engine.hicache.hiradix_cache import HiCacheStats
from engine.inputs import InputProcessor
from engine.lora import LoRAAdapterError, LoRAConfig, LoRAManager, UnknownLoRAError
from engine.model_path import resolve_model_path
from engine.model_runner import ModelRunner
from engine.req import Req
from engine.sampling import PromptLogprob, SamplingParams
from engine.scheduler import OverlapStep, Scheduler, StepStrategy
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from engine.tp.comm import TPGroup

log = logging.getLogger("radixray.engine")


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]


class StreamDelta(msgspec.Struct):
    """What one step added to one request; the last one has finish_reason set."""

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None  # set with error
    # With prompt_logprobs, on the first delta: None for the first prompt token, then one per token.
    prompt_logprobs: list[PromptLogprob | None] | None = None

    @classmethod
    def aborted(cls, rid: str, *, error: str, kind: ErrorKind, prompt_tokens: int = 0) -> StreamDelta:
        """The last delta of a request that ends with an error: no tokens, finish_reason "abort"."""
        return cls(rid=rid, text="", token_ids=[], finish_reason="abort", prompt_tokens=prompt_tokens,
                   error=error, error_kind=kind)


class GenerateOutput(msgspec.Struct):
    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    error_kind: ErrorKind | None = None
    prompt_logprobs: list[PromptLogprob | None] | None = None


class EngineStats(msgspec.Struct, kw_only=True):
    """One engine's queue, KV pool and lifetime counters. Every field has a default, so a
    caller that cannot reach an engine reports one built from the defaults."""

    waiting: int = 0  # queued requests, a chunked prefill in progress included
    waiting_prompt_tokens: int = 0  # the prompt tokens those still have to compute (or fetch)
    running: int = 0  # requests in the decode batch
    kv_used: int = 0  # KV slots held by requests
    kv_total: int = 0
    kv_cached: int = 0  # KV slots in the radix cache (evictable, or locked by running requests)
    cached_tokens: int = 0  # prompt tokens served from the radix cache
    prompt_tokens: int = 0
    generated_tokens: int = 0
    num_retracted: int = 0
    num_aborted: int = 0
    num_failed: int = 0  # requests ended by an engine-side error
    num_received: int = 0  # requests that reached the loop (aborted early or not)
    overlapped_steps: int = 0  # decode batches launched while the previous one still ran
    # Split prefill: the bytes of the hidden state the prefill in flight by layers carries
    # between steps now (beside the KV pool: an unsplit prefill holds it only during its
    # forward), and the layers split prefills have run (one per layer per step).
    split_prefill_hidden_bytes: int = 0
    split_prefill_layers: int = 0
    spec_draft_tokens: int = 0  # speculative decoding: drafts scored by verify forwards
    spec_accepted_tokens: int = 0  # drafts kept
    spec_verify_requests: int = 0  # (request, verify step) pairs: tokens emitted = accepted + this
    expert_tokens: list[int] = []  # MoE: (token, expert) pairs this engine's experts computed, by expert
    # Hierarchical cache (enable_hierarchical_cache; None without): per tier (device, host, storage)
    # the prompt tokens admitted from it, bytes moved and load time; the host tier's occupancy;
    # the storage tier's pages written, read and found corrupt. cached_tokens counts every tier.
    hicache: HiCacheStats | None = None
    # Prefill/decode disaggregation: KV transfers this engine completed (sent by a prefill engine,
    # received by a decode engine), their tokens and bytes; on a decode engine also the prompt
    # tokens its own cache held (not transferred), the seconds from fetch to arrival (the prefill
    # included), the seconds from the prefill engine handing the KV over to its arrival here (the
    # transfer alone), and the requests waiting for KV memory or for their KV (the pre-allocation queue).
    kv_transfers: int = 0
    kv_transfer_tokens: int = 0
    kv_transfer_bytes: int = 0
    kv_skipped_tokens: int = 0
    kv_transfer_seconds: float = 0.0
    kv_wire_seconds: float = 0.0
    prealloc_queue: int = 0
    # Batches run, by ForwardMode name; every mode is present (0 if none ran), so readers index it.
    batches_by_mode: dict[str, int] = msgspec.field(default_factory=lambda: dict.fromkeys(ForwardMode.__members__, 0))
    # LoRA adapters: those requests may name, and those in host memory (least recently used first).
    lora_adapters: list[str] = []
    lora_resident: list[str] = []
    lora_host_reloads: int = 0  # evicted adapters read again from their files
    lora_slot_loads: int = 0  # adapters copied into a device slot for a batch


class _Tracker:
    """Per-request output state, kept outside the scheduler."""

    __slots__ = ("req", "detok", "sent_tokens", "sink", "failed", "sent_prompt_logprobs")

    def __init__(self, req: Req, detok: IncrementalDetokenizer, sink: Callable[[StreamDelta], None]) -> None:
        self.req, self.detok, self.sent_tokens, self.sink = req, detok, 0, sink
        self.failed = False  # its output failed: its error went out, nothing more is sent
        self.sent_prompt_logprobs = False


class Engine:
    def __init__(self, config: EngineConfig | None = None, mlp_shard: tuple[int, int] = (0, 1),
                 kv_source: KVSource | None = None, tp_group: TPGroup | None = None, **kwargs: Any) -> None:
        """kv_source: where a decode engine (disaggregation_mode="decode") gets each request's KV.
        tp_group: rank 0's group of a tensor-parallel engine (tp_size > 1; engine.tp.worker builds
        it), whose other ranks run each batch this engine's ModelRunner sends them."""
        self.config = config if config is not None else EngineConfig.from_kwargs(**kwargs)
        if config is not None and kwargs:
            self.config = config.replace(**kwargs)
        if self.config.torch_threads:
            torch.set_num_threads(self.config.torch_threads)
        self.model_path = self.config.model_path or builtin_model_path()
        self.tokenizer = Tokenizer(self.model_path)
        self.model_runner = ModelRunner(self.config, self.model_path, mlp_shard, tp_group=tp_group)
        self.model_config = self.model_runner.model_config
        # The adapters (before the scheduler, which admits requests by them); None: LoRA off.
        self.lora: LoRAManager | None = None
        if self.config.lora_enabled:
            self.lora = self.model_runner.init_lora(LoRAConfig.from_engine_config(self.config))
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        if (self.config.disaggregation_mode == "decode") != (kv_source is not None):
            raise ConfigError("a decode engine (disaggregation_mode='decode') needs a kv_source, and only it takes one")
        model_id = ""
        if self.config.hicache_storage_backend is not None:  # what storage pages are keyed by
            model_id = model_identity(resolve_model_path(self.model_path), self.config.quantization)
        self.scheduler = Scheduler(self.config, self.model_runner, self.eos_ids, self.tokenizer.decode,
                                   kv_source=kv_source, wake=self._notify, model_id=model_id)
        mr = self.model_runner
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, mr.max_context_len,
                                     mr.max_total_tokens, eos_token_ids=self.eos_ids,
                                     grammar_backend=self.config.grammar_backend,
                                     json_whitespace_pattern=self.config.constrained_json_whitespace_pattern,
                                     limits=self.config.limits,
                                     dllm_block_size=self.model_config.dllm_block_size)
        self.tokenize = self.inputs.tokenize
        self._rng = random.Random(self.config.random_seed)
        self._rid_counter = itertools.count()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._trackers: dict[str, _Tracker] = {}
        self._early_aborts: dict[str, None] = {}  # insertion-ordered, bounded
        self.on_work: Callable[[], None] | None = None  # extra wake-up hook (attention-DP loop)
        # Called (on the loop thread) when the loop dies; the Ray actor exits so Ray restarts it.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self._step_lock = threading.Lock()
        self._emit_lock = threading.Lock()
        # How a step runs its batch (attention-DP installs its lock-step strategy instead).
        self.strategy: StepStrategy = StepStrategy()
        if self.config.enable_overlap_schedule:  # one forward thread (on CUDA it would own the forward stream)
            self.strategy = OverlapStep(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixray-forward"))
        self.num_received = 0  # requests that reached the loop (aborted early or not)
        self._loop_thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self.dead: BaseException | None = None
        # Wall time of whole steps (scheduling, forward, sampling, output) by forward mode.
        self.step_seconds: Counter[str] = Counter()
        self.step_count: Counter[str] = Counter()

    @property
    def stopping(self) -> bool:
        """shutdown() was called: loops driving this engine from outside (attention-DP) end."""
        return self._stopping

    # ---- submission ------------------------------------------------------------------------
    def submit(self, input_ids: list[int], sampling_params: SamplingParams | dict | None,
               sink: Callable[[StreamDelta], None], rid: str | None = None,
               kv_sender: KVSender | None = None, priority: int = 0, lora_name: str | None = None) -> str:
        """Validate and queue one request; its deltas go to `sink` (called on the step thread).
        A prefill engine's requests come from decode engines, each with the `kv_sender` its KV
        goes through; such a request ends with finish_reason "transferred" once it is sent.
        `priority`: vLLM's request priority (lower = more important), read by the `priority`
        eviction policy. `lora_name`: the LoRA adapter to run under (None: the base model;
        UnknownLoRAError if it is not loaded)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine is dead: {self.dead}")
        if (self.config.disaggregation_mode == "prefill") != (kv_sender is not None):
            raise InvalidRequestError("a prefill engine takes requests from decode engines (with a kv_sender), "
                                      "and only it does")
        params = self.inputs.as_params(sampling_params)
        self.inputs.validate_priority(priority)
        self.inputs.validate_input_ids(input_ids)
        self.inputs.validate_request(len(input_ids), params)
        lora_id = self._lora_id(lora_name)
        rid = rid or uuid.uuid4().hex
        gen = None
        if not params.is_greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            gen = torch.Generator(device=self.model_runner.device).manual_seed(seed)
        req = Req(rid, list(input_ids), params, gen, priority)
        req.lora_name, req.lora_id = lora_name, lora_id
        req.grammar = self.inputs.grammar_matcher(params)  # (compiled by the validation above: cached)
        req.kv_sender = kv_sender
        if params.min_tokens:
            req.banned_early = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop)
        self._inbox.put(("add", _Tracker(req, detok, sink)))
        if self.dead is not None:  # the loop died while we queued: nobody else will answer
            self._fail_pending()
        self._wake.set()
        if self.on_work is not None:
            self.on_work()
        return rid

    def _lora_id(self, name: str | None) -> int:
        """The id of adapter `name`'s current load (0: the base model); UnknownLoRAError."""
        if name is None:
            return 0
        if not isinstance(name, str):
            raise InvalidRequestError(f"lora_name must be a string, got {name!r}", "model")
        if self.lora is None:
            raise UnknownLoRAError(name)
        return self.lora.adapter_id(name)

    # ---- LoRA adapters at run time --------------------------------------------------------------
    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> None:
        """Read, validate and serve the PEFT adapter in folder `path` as `name` (LoRAAdapterError:
        a bad adapter, a name in use, no host room; the engine is unchanged then). `pinned`: never
        evicted. Needs enable_lora (or lora_paths)."""
        if self.lora is None:
            raise LoRAAdapterError(name, "this engine serves no LoRA adapters (start it with enable_lora)")
        if not name or not isinstance(name, str) or "=" in name:
            raise LoRAAdapterError(str(name), "bad adapter name")
        adapter = self.lora.read(name, path)  # the files are read while steps go on
        with self._step_lock:  # the manager belongs to the step thread
            self.lora.load_adapter(name, path, pinned=pinned, adapter=adapter)

    def unload_lora_adapter(self, name: str) -> bool:
        """Stop serving adapter `name`: new requests naming it fail (UnknownLoRAError); its running
        requests finish with it. True if it is gone now, False if it goes when they end."""
        if self.lora is None:
            raise UnknownLoRAError(name)
        with self._step_lock:
            return self.lora.unload_adapter(name)

    def lora_adapters(self) -> list[str]:
        """The adapters requests may name."""
        return self.lora.names() if self.lora is not None else []

    def _notify(self) -> None:
        """Wake the loop (any thread): a KV transfer changed state."""
        self._wake.set()
        if self.on_work is not None:
            self.on_work()

    def abort(self, rid: str, message: str = "aborted by client", kind: ErrorKind = "aborted") -> None:
        self._inbox.put(("abort", (rid, message, kind)))
        self._wake.set()
        if self.on_work is not None:
            self.on_work()

    # ---- the loop ---------------------------------------------------------------------------
    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.num_received += 1
                rid = item.req.rid
                if rid in self._trackers:
                    item.sink(self._error_delta(item.req, f"duplicate request id {rid!r}", "invalid_request"))
                    continue
                if rid in self._early_aborts:  # its abort overtook it
                    del self._early_aborts[rid]
                    self.scheduler.num_aborted += 1
                    item.sink(self._error_delta(item.req, "aborted before it started", "aborted"))
                    continue
                self._trackers[rid] = item
                self.scheduler.cache.publish("queued", item.req.origin_input_ids, lora_name=item.req.lora_name)
                self.scheduler.add_request(item.req)
            elif item[0] in self.scheduler.reqs:
                self.scheduler.abort_request(*item)
            else:
                # An abort can overtake its request across actor calls: remember it a while.
                self._early_aborts[item[0]] = None
                while len(self._early_aborts) > 1024:
                    self._early_aborts.pop(next(iter(self._early_aborts)))

    def has_pending(self) -> bool:
        """Work queued or in flight (the inbox counts: a request may not be drained yet)."""
        return self.scheduler.has_work() or not self._inbox.empty() or self.scheduler.inflight is not None

    def step(self) -> bool:
        """One step of the loop: drain the inbox, let the scheduler run one step with this
        engine's strategy, then detokenize and deliver outputs. Returns whether to step again
        at once. Outputs are delivered off the step lock, but the emit lock is taken before the
        step lock is released, so deliveries keep step order."""
        t0 = time.perf_counter()
        self._step_lock.acquire()
        try:
            self._drain_inbox()
            touched, more = self.scheduler.step(self.strategy)
            outputs = self._take_outputs(touched)
            self._emit_lock.acquire()
        finally:
            self._step_lock.release()
        try:
            self._send_outputs(outputs)
        finally:
            self._emit_lock.release()
        if self.scheduler.last_mode is not None:
            self.step_seconds[self.scheduler.last_mode] += time.perf_counter() - t0
            self.step_count[self.scheduler.last_mode] += 1
        return more

    # ---- output ---------------------------------------------------------------------------
    def _take_outputs(self, touched: list[Req]) -> list[tuple[_Tracker, StreamDelta | Exception]]:
        """Under the step lock: what each touched request got this step (text still to add), or
        the error that building it raised. Trackers change only here and in the inbox drain,
        both under the step lock. A sink must not call step(): deliveries hold the emit lock."""
        out: list[tuple[_Tracker, StreamDelta | Exception]] = []
        for req in touched:
            tr = self._trackers.get(req.rid)
            if tr is None:
                continue
            try:
                delta = self._new_delta(req, tr)
            except Exception as e:  # this request's output is broken: it alone ends
                delta = e
            if delta is None:
                if tr.failed and req.finished():  # its end went out when its output failed
                    self._untrack(req)
                continue
            if isinstance(delta, Exception) or delta.finish_reason is not None:
                self._untrack(req)
            out.append((tr, delta))
        return out

    def _untrack(self, req: Req) -> None:
        """The request ended here (under the step lock): its tracker goes, its "queued" is done."""
        self._trackers.pop(req.rid, None)
        self.scheduler.cache.publish("done", req.origin_input_ids, lora_name=req.lora_name)

    def _new_delta(self, req: Req, tr: _Tracker) -> StreamDelta | None:
        new = req.output_ids[tr.sent_tokens:]
        finished = req.finished()
        if not (new or finished) or tr.failed:
            return None
        logprobs = None
        if req.sampling_params.logprobs:
            logprobs = [TokenLogprob(t, lp[0], lp[1]) for t, lp in zip(new, req.output_logprobs[tr.sent_tokens:])]
        tr.sent_tokens = len(req.output_ids)
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not tr.sent_prompt_logprobs and not req.needs_prompt_logits:
            tr.sent_prompt_logprobs = True
            prompt_logprobs = [None, *req.prompt_logprobs]
        reason = req.finished_reason
        return StreamDelta(
            rid=req.rid, text="", token_ids=new, finish_reason=reason.kind if finished else None,
            prompt_tokens=len(req.origin_input_ids), completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens, logprobs=logprobs,
            error=reason.message if finished and reason.kind == "abort" else None,
            error_kind=reason.error_kind if finished else None, prompt_logprobs=prompt_logprobs)

    def _send_outputs(self, outputs: list[tuple[_Tracker, StreamDelta | Exception]]) -> None:
        """Detokenize and deliver what _take_outputs took (the caller holds the emit lock)."""
        for tr, delta in outputs:
            if tr.failed:
                continue
            if isinstance(delta, Exception):
                self._fail_output(tr, delta)
                continue
            try:
                delta.text = tr.detok.step(delta.token_ids, delta.finish_reason is not None)
                tr.sink(delta)
            except Exception as e:  # this request's output failed (detokenizer, sink): end it alone
                self._fail_output(tr, e)

    def _fail_output(self, tr: _Tracker, error: Exception) -> None:
        rid = tr.req.rid
        log.error("output of request %s failed", rid, exc_info=error)
        tr.failed = True
        if not tr.req.finished():  # still generating: stop it (through the inbox, as any abort)
            self.abort(rid, "output failed", "engine_error")
        try:
            tr.sink(self._error_delta(tr.req, f"engine error: {type(error).__name__}: {error}", "engine_error"))
        except Exception:
            log.exception("could not report the failure of request %s", rid)

    def _error_delta(self, req: Req, message: str, kind: ErrorKind) -> StreamDelta:
        return StreamDelta.aborted(req.rid, error=message, kind=kind, prompt_tokens=len(req.origin_input_ids))

    def start_loop(self) -> None:
        """Run steps on a background thread; it sleeps (no spinning) when there is no work."""
        if self._loop_thread is not None:
            return
        self._loop_thread = threading.Thread(target=self._loop, name="radixray-engine", daemon=True)
        self._loop_thread.start()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.step():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except BaseException as e:  # a bug: fail every pending request loudly, never hang them
            self.die(e)

    def die(self, error: BaseException) -> None:
        """The loop cannot go on: fail every request it holds or has queued, then call on_fatal
        (the actor exits, so Ray restarts it). Later submits raise EngineDeadError."""
        self.dead = error
        log.error("engine loop died; failing every pending request", exc_info=error)
        self._fail_pending()
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _fail_pending(self) -> None:
        message = f"engine failed: {type(self.dead).__name__}: {self.dead}"
        while True:  # requests still in the inbox were accepted too
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._trackers.setdefault(item.req.rid, item)
        for tr in list(self._trackers.values()):
            try:
                tr.sink(self._error_delta(tr.req, message, "engine_error"))
            except Exception:
                log.exception("could not report the failure of request %s", tr.req.rid)
        self._trackers.clear()

    # ---- convenience API ----------------------------------------------------------------------
    def generate(self, prompt: str | list[str] | None = None, sampling_params: Any = None,
                 input_ids: list[int] | list[list[int]] | None = None,
                 messages: list[dict] | None = None,
                 priority: int | list[int] = 0,
                 lora_name: str | None | list[str | None] = None) -> GenerateOutput | list[GenerateOutput]:
        """priority: vLLM's request priority (lower = more important), one for every prompt or
        one per prompt. lora_name: the LoRA adapter (None: the base model), one for every prompt or
        one per prompt; an unknown one raises UnknownLoRAError before any request starts."""
        prompts, params, single = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        priorities = priority if isinstance(priority, list) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise InvalidRequestError("priority list must match the number of prompts", "priority")
        names = lora_name if isinstance(lora_name, list) else [lora_name] * len(prompts)
        if len(names) != len(prompts):
            raise InvalidRequestError("lora_name list must match the number of prompts", "model")
        for name in dict.fromkeys(names):
            self._lora_id(name)  # every name checked before any request is queued
        results: dict[str, list[StreamDelta]] = {}
        done = queue.SimpleQueue()

        def sink(delta: StreamDelta) -> None:
            results[delta.rid].append(delta)
            if delta.finish_reason is not None:
                done.put(delta.rid)

        rids = []
        for ids, p, prio, name in zip(prompts, params, priorities, names):
            rid = f"{next(self._rid_counter)}-{uuid.uuid4().hex[:8]}"
            results[rid] = []
            rids.append(self.submit(ids, p, sink, rid=rid, priority=prio, lora_name=name))
        self._wait(done, len(rids))
        outs = [collect_output(rid, results[rid]) for rid in rids]
        return outs[0] if single else outs

    def stream(self, prompt: str | None = None, sampling_params: Any = None,
               input_ids: list[int] | None = None, messages: list[dict] | None = None,
               priority: int = 0, lora_name: str | None = None) -> Iterator[StreamDelta]:
        prompts, params, _ = self.inputs.prepare(prompt, input_ids, messages, sampling_params)
        q: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.submit(prompts[0], params[0], q.put, priority=priority, lora_name=lora_name)
        finished = False
        try:
            while True:
                if self._loop_thread is None:
                    while q.empty():
                        self.step()
                delta = q.get()
                yield delta
                if delta.finish_reason is not None:
                    finished = True
                    return
        finally:
            if not finished:  # the consumer went away: free its KV
                self.abort(rid)
                if self._loop_thread is None:
                    self.step()

    def _wait(self, done: queue.SimpleQueue, n: int) -> None:
        finished = 0
        while finished < n:
            if self._loop_thread is None:
                if not self.step() and done.empty():  # only KV transfers pending: wait for one
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
            else:
                done.get()
                finished += 1
                continue
            while not done.empty():
                done.get()
                finished += 1

    @contextlib.contextmanager
    def between_steps(self) -> Iterator[None]:
        """Hold the step lock: no step runs (nor mutates the scheduler or the cache) inside."""
        with self._step_lock:
            yield

    def queued_prompts(self) -> list[list[int]]:
        """The prompts of the requests queued or running here (call between steps): what a KV
        snapshot adds to the cache's paths, as the "queued" events not yet "done"."""
        return [tr.req.origin_input_ids for tr in self._trackers.values()]

    def check_memory(self) -> None:
        """Raise MemoryInvariantError unless the idle invariant holds (call when no work is left)."""
        with self._step_lock:
            self.scheduler.check_memory()

    def stats(self) -> EngineStats:
        s = self.scheduler
        split = s.split_prefill  # (read once: stats may be read between steps on another thread)
        return EngineStats(
            waiting=len(s.waiting_queue) + (1 if s.chunked_req else 0)
            + sum(r is not s.chunked_req for r in (split.batch.reqs if split else ())),
            waiting_prompt_tokens=sum(len(r.origin_input_ids) for r in s.waiting_queue)
            + (len(s.chunked_req.fill_ids) - s.chunked_req.kv_len if s.chunked_req else 0),
            running=len(s.running_batch.reqs),
            kv_used=s.cache.used_size(),
            kv_total=s.cache.total_size,
            kv_cached=s.cache.cached_size(),
            cached_tokens=s.cached_tokens,
            prompt_tokens=s.prompt_tokens,
            generated_tokens=s.generated_tokens,
            num_retracted=s.num_retracted,
            num_aborted=s.num_aborted,
            num_failed=s.num_failed,
            num_received=self.num_received,
            overlapped_steps=s.overlapped_steps,
            split_prefill_hidden_bytes=split.hidden_bytes if split else 0,
            split_prefill_layers=s.split_prefill_layers,
            spec_draft_tokens=s.spec_draft_tokens,
            spec_accepted_tokens=s.spec_accepted_tokens,
            spec_verify_requests=s.spec_verify_requests,
            expert_tokens=self.model_runner.expert_token_counts(),
            hicache=s.cache.hicache_stats(),
            batches_by_mode={mode: s.batches_by_mode[mode] for mode in ForwardMode.__members__},
            lora_adapters=self.lora_adapters(),
            lora_resident=self.lora.resident() if self.lora is not None else [],
            lora_host_reloads=self.lora.host_reloads if self.lora is not None else 0,
            lora_slot_loads=self.lora.slot_loads if self.lora is not None else 0,
            **self._kv_transfer_stats(),
        )

    def _kv_transfer_stats(self) -> dict[str, Any]:
        s = self.scheduler
        if s.transfers is not None:
            t = s.transfers
            return dict(kv_transfers=t.sent, kv_transfer_tokens=t.sent_tokens, kv_transfer_bytes=t.sent_bytes)
        if s.prealloc is not None:
            p = s.prealloc
            return dict(kv_transfers=p.received, kv_transfer_tokens=p.received_tokens,
                        kv_transfer_bytes=p.received_bytes, kv_skipped_tokens=p.skipped_tokens,
                        kv_transfer_seconds=p.transfer_seconds, kv_wire_seconds=p.wire_seconds,
                        prealloc_queue=len(p))
        return {}

    def shutdown(self) -> None:
        """Stop the loop, flush the storage tier's pending writes (the pages other engines may
        load), then stop a tensor-parallel engine's other ranks."""
        self._stopping = True
        self._wake.set()
        if self._loop_thread is not None:
            self._loop_thread.join(timeout=5)
            self._loop_thread = None
        self.scheduler.cache.close()
        self.model_runner.close()


def collect_output(rid: str, deltas: list[StreamDelta]) -> GenerateOutput:
    last = deltas[-1]
    logprobs = None
    if any(d.logprobs is not None for d in deltas):
        logprobs = [lp for d in deltas for lp in (d.logprobs or [])]
    return GenerateOutput(
        rid=rid, text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
        finish_reason=last.finish_reason, prompt_tokens=last.prompt_tokens,
        cached_tokens=last.cached_tokens, logprobs=logprobs, error=last.error, error_kind=last.error_kind,
        prompt_logprobs=next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None))
