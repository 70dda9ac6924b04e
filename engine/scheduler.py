"""The scheduler and its one step loop: schedule -> (strategy sync) -> forward -> process results.

Strategies decide how a step runs its batch: `StepStrategy` runs it to its result within the
step; `OverlapStep` leaves a decode batch in flight on a forward thread and schedules the next
one meanwhile (the scheduler owns that future-input state); attention-DP's lock-step
(engine/dp.py) agrees on token counts with its group in `sync` and runs IDLE batches. A
speculative verify batch is left in flight like a decode batch, but the next step waits for it
before drafting (drafts extend the tokens it keeps): what overlaps is the delivery of the
previous step's tokens (detokenization, streaming) with the verify forward."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.cache_manager import CacheManager
from engine.config import DEFAULT_MAX_PREFILL_TOKENS, EngineConfig
from engine.disaggregation.decode import DecodePrealloc
from engine.disaggregation.prefill import PrefillTransfers
from engine.disaggregation.transfer import KVSource
from engine.dllm.algorithm import create_dllm_algorithm
from engine.dllm.config import DllmConfig
from engine.dllm.runner import DllmLogits, DllmRunner
from engine.draft_model import DraftModelDrafter
from engine.errors import ConfigError, EngineDeadError, ErrorKind
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.grammar import GrammarError
from engine.hicache.config import HiCacheConfig
from engine.lora import LoRAAdapterError, UnknownLoRAError
from engine.model_runner import ModelRunner, PendingSample
from engine.prefill_adder import AddResult, PrefillAdder
from engine.req import FinishReason, Req
from engine.sampling import SampleResult
from engine.schedule_batch import ScheduleBatch
from engine.speculative import Drafter, NgramDrafter, VerifyResult

IN_BATCH_PREFIX_LEN = 32  # shared head length that defers a request to the next prefill round
# Batches that fail in a row before the engine gives up (a broken device, not a bad request).
MAX_CONSECUTIVE_BATCH_FAILURES = 3
# Prefill rounds a LoRA adapter's requests may wait for a free adapter slot; after that no new
# request of another adapter is admitted until it has one (the active adapters drain).
LORA_MAX_WAIT_ROUNDS = 16

log = logging.getLogger("radixray.engine")


def _raiser(error: Exception) -> Callable[[], SampleResult]:
    def wait() -> SampleResult:
        raise error
    return wait


def _no_result() -> None:
    return None


@dataclass
class SplitPrefill:
    """A prefill batch in flight by layers (ForwardMode.SPLIT_PREFILL): its ForwardBatch (built at
    admission, kept to its last layer: inputs, attention metadata, the carried hidden state and
    `split_index`), the layers it runs per step, the rows whose token is thrown away (a chunk
    short of its prompt's end), and its requests aborted meanwhile (their KV slots are still
    written by the later layers: they go back once the split ends)."""

    batch: ScheduleBatch
    fb: ForwardBatch
    forward_count: int
    partial: frozenset[int]
    aborted: list[Req] = field(default_factory=list)

    @property
    def hidden_bytes(self) -> int:
        """Bytes of the hidden state carried between its steps (0 before the first)."""
        h = self.fb.hidden_states
        return 0 if h is None else h.numel() * h.element_size()


def make_drafter(config: EngineConfig, model_runner: ModelRunner, batches_by_mode: Counter) -> Drafter | None:
    """The drafter config.speculative_algorithm names (None: no speculation); a draft model counts
    its DRAFT_EXTEND_V2 batches in `batches_by_mode`."""
    k = config.speculative_num_draft_tokens
    if config.speculative_algorithm == "ngram":
        return NgramDrafter(k, config.speculative_ngram_min_match_window_size,
                             config.speculative_ngram_max_match_window_size)
    if config.speculative_algorithm == "draft_model":
        # Its KV holds running requests only (no cache): as many tokens as the target's pool (which
        # left room for it: ModelRunner._default_pool_size), and the drafts.
        rows = model_runner.req_to_token_pool.size
        return DraftModelDrafter(config, model_runner.model_config, model_runner.max_context_len, rows,
                                 model_runner.max_total_tokens + rows * k, batches_by_mode)
    return None


def make_dllm_runner(config: EngineConfig, model_runner: ModelRunner, cache: CacheManager,
                     eos_token_ids: frozenset[int], decode_tail: Callable[[list[int]], str] | None
                     ) -> DllmRunner | None:
    """The block-diffusion runner for a block-diffusion model (None for an autoregressive one).
    Refuses what does not apply to block diffusion: an attention backend without block-causal
    attention, speculation, disaggregation, chunked prefill (a prompt's first forward is one
    extend, like its blocks'), MIXED batches and split prefill (a DLLM_EXTEND batch is no
    decode batch to mix or interleave with)."""
    cfg = model_runner.model_config
    if not cfg.is_dllm:
        return None
    if not model_runner.attn_backend.block_causal:
        raise ConfigError(f"attention backend {config.attention_backend!r} has no block-causal attention, "
                          f"which the block-diffusion model {cfg.architecture} needs")
    for name, off in (("speculative_algorithm", None), ("disaggregation_mode", "null"),
                      ("chunked_prefill_size", None), ("enable_mixed_chunk", False),
                      ("enable_split_prefill", False)):
        if getattr(config, name) != off:
            raise ConfigError(f"{name} does not apply to the block-diffusion model {cfg.architecture}: leave it unset")
    return DllmRunner(cache, DllmConfig.from_model_config(cfg),
                      create_dllm_algorithm(config.dllm_algorithm, config.dllm_threshold),
                      eos_token_ids, model_runner.max_context_len, decode_tail)


class StepStrategy:
    """Runs each batch to its result within the step."""

    executor: concurrent.futures.Executor | None = None  # where forwards run (None: inline)
    overlap = False  # a decode (or verify) batch's results may wait until the next step

    def sync(self, sched: Scheduler, batch: ScheduleBatch | None,
             touched: list[Req]) -> ScheduleBatch | None:
        """Between scheduling and the forward: the batch to run (None: no forward)."""
        return batch

    def again(self, sched: Scheduler) -> bool:
        """After the step: whether to step again at once (else the loop sleeps until work, or
        until a KV transfer changes state)."""
        return sched.has_runnable() or sched.inflight is not None


class OverlapStep(StepStrategy):
    """Overlap scheduling: decode batch N+1 is scheduled (inputs read from the future-token
    buffer) while batch N runs on the forward thread; its results are processed after. A verify
    batch stays in flight too, but the next step waits for it before drafting."""

    overlap = True

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self.executor = executor


class Scheduler:
    def __init__(self, config: EngineConfig, model_runner, eos_token_ids: frozenset[int],
                 decode_tail: Callable[[list[int]], str] | None = None, kv_source: KVSource | None = None,
                 wake: Callable[[], None] = lambda: None, model_id: str = "") -> None:
        """model_id: the weights' identity (storage pages are shared only under the same one)."""
        self.config = config
        self.model_runner = model_runner
        self.device = model_runner.device
        hicache = HiCacheConfig.from_engine_config(config)
        self.cache = CacheManager(model_runner.req_to_token_pool, model_runner.allocator,
                                  share_prefixes=not config.disable_radix_cache,
                                  hicache=None if hicache.is_default else hicache,
                                  kv_cache=model_runner.kv_cache, model_id=model_id,
                                  hidden_size=model_runner.model_config.hidden_size)
        if getattr(model_runner, "tp_size", 1) > 1 and self.cache.hicache is not None:
            # The other ranks make the host tier's copies on their own KV heads (engine/tp/worker.py).
            host = self.cache.hicache.host
            host.log_copies()
            model_runner.tp_host_copies = host.take_copies
            self.cache.host_mirrored = True
        # LoRA adapters (None: off): requests hold a reference on theirs from admission to their end;
        # at most max_loras_per_batch adapters have running requests (`_lora_admissible`).
        self.lora = getattr(model_runner, "lora_manager", None)
        if self.lora is not None:
            self.cache.lora_name_of = self.lora.name_of
        self._lora_round = 0
        self._lora_waiting: dict[str, int] = {}  # adapter -> the prefill round it began to wait for a slot
        self.eos_token_ids = eos_token_ids
        self.decode_tail = decode_tail
        self.max_context_len = model_runner.max_context_len
        self.max_running = model_runner.req_to_token_pool.size
        self.max_prefill_tokens = config.max_prefill_tokens or DEFAULT_MAX_PREFILL_TOKENS
        self.chunk_size = config.chunked_prefill_size or self.max_prefill_tokens
        self.waiting_queue: list[Req] = []
        self.running_batch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.reqs: dict[str, Req] = {}  # request table: every live request by rid
        self.new_token_ratio = config.init_new_token_ratio
        self.batches_by_mode: Counter[str] = Counter()
        self.num_retracted = 0
        self.num_aborted = 0
        self.num_failed = 0  # requests ended by an engine-side error (the rest kept serving)
        self.consecutive_batch_failures = 0
        # Attention-DP turns this off: a member whose forward failed may have left its peers in
        # a collective, so the group restarts instead.
        self.isolate_batch_failures = True
        self.failed: list[Req] = []  # failed while scheduling; reported by the next execute()
        self.pending_aborts: list[Req] = []  # marked by abort_request, applied at the next step
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self._idle_checked = True
        # Seconds spent inside ModelRunner.forward, by mode (benchmarks read it).
        self.forward_seconds: Counter[str] = Counter()
        self.last_mode: str | None = None
        # Overlap scheduling: the decode batch in flight and how to wait for its result. While
        # it is set, the next decode batch takes its input ids from the future-token buffer.
        self.inflight: tuple[ScheduleBatch, Callable[[], SampleResult]] | None = None
        self.overlapped_steps = 0  # decode batches launched while the previous one still ran
        # Speculative decoding: decode batches become TARGET_VERIFY batches of drafts.
        self.drafter = make_drafter(config, model_runner, self.batches_by_mode)
        self.spec_draft_tokens = 0  # drafts scored by verify forwards
        self.spec_accepted_tokens = 0  # drafts kept
        self.spec_verify_requests = 0  # (request, verify step) pairs
        # Prefill/decode disaggregation: a prefill engine's requests end by sending their KV
        # (transfers); a decode engine's wait for theirs (prealloc), then run a PREBUILT batch.
        mode, timeout = config.disaggregation_mode, config.disaggregation_transfer_timeout_s
        self.transfers = (PrefillTransfers(self.cache, model_runner.kv_cache, timeout, wake)
                          if mode == "prefill" else None)
        self.prealloc = (DecodePrealloc(self.cache, model_runner.kv_cache, kv_source, timeout, wake)
                         if mode == "decode" else None)
        self.prebuilt_ready: list[Req] = []
        # Split prefill: at most one prefill batch advanced a range of layers per step, beside
        # the decode batch; its requests join the running batch after its last layer.
        self.split_prefill: SplitPrefill | None = None
        self.split_prefill_layers = 0  # layers run by split prefills (each step's slice counted)
        # Block diffusion: every step is one DLLM_EXTEND batch of every admitted request.
        self.dllm = make_dllm_runner(config, model_runner, self.cache, eos_token_ids, decode_tail)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(reqs, self.cache, self.device, self.lora)

    # ---- request table ---------------------------------------------------------------------
    def add_request(self, req: Req) -> None:
        self.reqs[req.rid] = req
        if self.prealloc is not None:  # a decode engine computes no prompt: it waits for the KV
            self.prealloc.add(req)
        else:
            self.waiting_queue.append(req)
        self._idle_checked = False

    def abort_request(self, rid: str, message: str = "aborted", kind: ErrorKind = "aborted") -> None:
        """Mark for abort; handled at the start of the next step, when no forward reads its KV."""
        req = self.reqs.get(rid)
        if req is not None and not req.finished() and req.to_abort is None:
            req.to_abort = (message, kind)
            self.pending_aborts.append(req)

    def has_work(self) -> bool:
        """Any request here (waiting, running, or on either side of a KV transfer)."""
        return bool(self.has_runnable() or (self.transfers is not None and self.transfers.queue)
                    or (self.prealloc is not None and len(self.prealloc)))

    def has_runnable(self) -> bool:
        """Work a step can do now (a KV transfer in progress wakes the loop when it changes)."""
        return bool(self.waiting_queue or self.running_batch.reqs or self.chunked_req or self.prebuilt_ready
                    or self.split_prefill)

    def _handle_aborts(self) -> list[Req]:
        ended, pending, self.pending_aborts = [], self.pending_aborts, []
        admitted = False
        for req in pending:  # only the marked requests: no scan of the request table each step
            if req.finished():
                continue
            req.finished_reason = FinishReason("abort", message=req.to_abort[0], error_kind=req.to_abort[1])
            self.num_aborted += 1
            if req in self.waiting_queue:
                self.waiting_queue.remove(req)
            elif self.transfers is not None and self.transfers.remove(req):
                req.kv_sender.fail(f"aborted: {req.to_abort[0]}")
                self.cache.cache_finished_req(req)  # its prompt's KV is good: it stays cached
            elif self.prealloc is not None and self.prealloc.remove(req, f"aborted: {req.to_abort[0]}"):
                pass
            elif req in self.prebuilt_ready:
                self.prebuilt_ready.remove(req)
                self.cache.release_req(req)
            else:
                admitted = True
                if req is self.chunked_req:
                    self.chunked_req = None
                if self.split_prefill is not None and req in self.split_prefill.batch.reqs:
                    self.split_prefill.aborted.append(req)  # its KV goes when the split ends
                elif self.dllm is not None:  # its KV past its final blocks saw masks: not cached
                    self.dllm.finish(req)
                elif req.req_pool_idx is not None:
                    self.cache.cache_finished_req(req)
            ended.append(req)
        if admitted:
            self._drop_finished_from_running()
        sp = self.split_prefill
        if sp is not None and all(r.finished() for r in sp.batch.reqs):  # nothing left to compute it for
            self.model_runner.sync_split_prefill()
            self._end_split_prefill(completed=False)
        return ended

    # ---- one step ----------------------------------------------------------------------------
    def step(self, strategy: StepStrategy | None = None) -> tuple[list[Req], bool]:
        """Run at most one batch. Returns the requests that got tokens or finished, and
        whether to step again at once."""
        strategy = strategy or StepStrategy()
        self.last_mode = None
        touched: list[Req] = []
        if self.inflight is not None and not self._can_schedule_ahead():
            touched += self._finish_inflight()
        touched += self._poll_transfers()
        touched += self._handle_aborts()
        if self.prebuilt_ready:
            touched += self._run_prebuilt()
        batch = self.get_next_batch_to_run()
        touched, self.failed = touched + self.failed, []  # (those its building failed)
        batch = strategy.sync(self, batch, touched)
        if batch is not None:
            overlapped = strategy.overlap and (batch.forward_mode.is_decode()
                                               or batch.forward_mode.is_target_verify())
            self.overlapped_steps += overlapped and self.inflight is not None
            wait = self.launch_batch(batch, strategy.executor)
            split_wait = self.launch_split_prefill(strategy.executor)  # (after the decode, same thread)
            touched += self._finish_inflight()  # (under overlap: while this batch runs)
            if overlapped:
                self.inflight = (batch, wait)
            else:
                touched += self.complete(batch, wait)
        else:
            split_wait = self.launch_split_prefill(strategy.executor)
            touched += self._finish_inflight()
        touched += self.complete_split_prefill(split_wait)
        for req in touched:
            if req.finished():
                self.reqs.pop(req.rid, None)
                if req.lora_held:  # (under overlap a batch still in flight may hold it: its row is dropped)
                    req.lora_held = False
                    self.lora.release(req.lora_name)
        if not self.has_work() and self.inflight is None and not self._idle_checked:
            self.check_memory()
            self._idle_checked = True
        return touched, strategy.again(self)

    def _can_schedule_ahead(self) -> bool:
        """Whether the next batch can be scheduled before the in-flight one's results: only a
        plain decode continuation can (prefill, aborts, retraction and penalties need them; so
        does a grammar: its next mask depends on the token still in flight)."""
        running = self.running_batch.reqs
        return not (self.waiting_queue or self.chunked_req or self.pending_aborts or self.drafter is not None
                    or (self.prealloc is not None and self.prealloc.needs_step())
                    or any(r.sampling_params.has_penalties or r.grammar is not None for r in running)
                    or self.cache.available_size() < 2 * len(running) + 2)

    def _finish_inflight(self) -> list[Req]:
        if self.inflight is None:
            return []
        batch, wait = self.inflight
        self.inflight = None
        return self.complete(batch, wait)

    # ---- prefill/decode disaggregation ----------------------------------------------------------
    def _poll_transfers(self) -> list[Req]:
        """Prefill: send KV, end the requests whose transfer ended. Decode: take in received KV
        (its requests become ready for PREBUILT), pre-allocate for waiting requests."""
        if self.transfers is not None:
            return self.transfers.poll()
        # A decode engine allocates, evicts and writes KV slots here: never beside a batch in
        # flight, which may still write slots the cache has just let go of.
        if self.prealloc is None or self.inflight is not None:
            return []
        running = self.running_batch.reqs + self.prealloc.transferring + self.prebuilt_ready
        reserved = int(self.new_token_ratio * sum(r.sampling_params.max_new_tokens - len(r.output_ids)
                                                  for r in running))
        free_rows = self.max_running - len(running)
        ready, failed = self.prealloc.step(reserved, free_rows)
        self.prebuilt_ready += ready
        ended = []
        for req, message, kind in failed:
            req.finished_reason = FinishReason("abort", message=message, error_kind=kind)
            self.num_failed += 1
            ended.append(req)
        return ended

    def _run_prebuilt(self) -> list[Req]:
        """PREBUILT: requests whose KV arrived join the decode batch without a forward. Their
        rows already point at the received slots; the prompt goes into this engine's cache; a new
        request takes its first token (and RNG state, prompt logprobs) from the prefill."""
        batch, self.prebuilt_ready = self._new_batch(self.prebuilt_ready), []
        batch.prepare_for_prebuilt()
        self.batches_by_mode[ForwardMode.PREBUILT.name] += 1
        self.last_mode = ForwardMode.PREBUILT.name
        touched, joined = [], []
        for req in batch.reqs:
            payload, req.kv_payload = req.kv_payload, None
            self.cache.cache_unfinished_req(req)
            if not req.output_ids:  # (a retracted request resumes from its own tokens)
                if payload.generator_state is not None and req.generator is not None:
                    req.generator.set_state(payload.generator_state)
                if payload.prompt_logprobs is not None and req.prompt_logprobs is not None:
                    req.prompt_logprobs = list(payload.prompt_logprobs)
                req.cached_tokens = payload.cached_tokens
                self.cached_tokens += payload.cached_tokens
                self.prompt_tokens += len(req.origin_input_ids)
                try:
                    self._append_token(req, payload.first_token, payload.first_logprob)
                except Exception as e:
                    touched += self.fail_reqs([req], e)
                    continue
                touched.append(req)
            if req.finished():
                self.cache.cache_finished_req(req)
            else:
                joined.append(req)
        if joined:  # each running row's last token is in the future-token buffer (overlap reads it)
            rows = torch.tensor([r.req_pool_idx for r in joined], device=self.device)
            self.model_runner.future_token_ids[rows] = torch.tensor([r.output_ids[-1] for r in joined],
                                                                    device=self.device)
        self.running_batch = self._new_batch(self.running_batch.reqs + joined)
        return touched

    def idle_batch(self) -> ScheduleBatch:
        batch = self._new_batch([])
        batch.prepare_for_idle()
        return batch

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        if self.dllm is not None:
            return self.get_dllm_batch()
        batch = self.get_new_batch_prefill()
        if batch is None:
            return self.update_running_batch()
        if not batch.forward_mode.is_split_prefill():
            return batch
        self.start_split_prefill(batch)
        return self.update_running_batch()  # the split's first layers run beside this decode

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if self.split_prefill is not None:  # one split prefill at a time (its requests admitted last)
            return None
        running = self.running_batch.reqs
        if len(running) >= self.max_running and self.chunked_req is None:
            return None
        if self.config.schedule_policy == "lpm":
            for req in self.waiting_queue:
                self.cache.match_prefix(req)
            self.waiting_queue.sort(key=lambda r: -len(r.prefix_indices))
        adder = PrefillAdder(self.cache, running, self.new_token_ratio, self.max_prefill_tokens, self.chunk_size,
                             mixed_with_decode=self.config.enable_mixed_chunk)
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        admitted_heads: set[tuple[int, ...]] = set()
        lora_round: set[str] = set()  # adapters of the requests admitted in this round
        starved = self._lora_starved() if self.lora is not None else None
        stale: list[tuple[Req, str]] = []
        for req in self.waiting_queue:
            if adder.new_chunked_req is not None:
                break
            if len(running) + len(adder.can_run) >= self.max_running:
                break
            if self.config.schedule_policy != "lpm":
                self.cache.match_prefix(req)
            if self._defer_shared_prefix(req, admitted_heads):
                continue
            acquired = False  # a reference taken now (given back unless the request is admitted)
            if self.lora is not None and req.lora_name is not None and not req.lora_held:
                if not self._lora_admissible(req, lora_round, starved, stale):
                    continue
                acquired = req.lora_held = True
            result = adder.add_one_req(req)
            if req.lora_name is not None and adder.can_run and adder.can_run[-1] is req:
                lora_round.add(req.lora_name)
                self._lora_waiting.pop(req.lora_name, None)
            elif acquired:
                req.lora_held = False
                self.lora.release(req.lora_name)
            if result != AddResult.CONTINUE:
                if adder.can_run and adder.can_run[-1] is req:
                    continue  # admitted as a chunk; the loop ends at the check above
                break
        if stale:
            self._fail_stale_lora(stale)
        if not adder.can_run:
            return None
        admitted = {id(r) for r in adder.can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for req in adder.can_run:
            if req is not self.chunked_req and req.req_pool_idx is None and req.num_retractions == 0:
                req.cached_tokens = len(req.prefix_indices)
                self.cached_tokens += req.cached_tokens
                self.prompt_tokens += len(req.origin_input_ids)
        self.chunked_req = adder.new_chunked_req
        batch = self._new_batch(adder.can_run)
        split = bool(running) and self.split_forward_count(sum(r.extend_input_len for r in batch.reqs)) is not None
        mixed = bool(self.config.enable_mixed_chunk and running and not split and self.running_batch.check_decode_mem())
        try:
            if mixed:
                self.running_batch = self._new_batch([])
                batch.mix_with_running(self._new_batch(running))
            else:
                batch.prepare_for_extend(ForwardMode.SPLIT_PREFILL if split else ForwardMode.EXTEND)
        except Exception as e:  # the requests of this batch fail; the engine goes on
            self.failed += self.fail_reqs(batch.reqs + (running if mixed else []), e)
            return None
        return batch

    # ---- block diffusion ------------------------------------------------------------------------
    def get_dllm_batch(self) -> ScheduleBatch | None:
        """One DLLM_EXTEND batch of every admitted request, waiting requests joining whenever the
        budgets allow (there is no prefill step: a new request's first forward is its prompt and
        first block). Running requests whose block just began take their slots first, retracting
        the least advanced when the pool cannot give them."""
        running = self.running_batch.reqs
        if self.dllm.slots_needed(running) > self.cache.available_size():
            running = self._retract_dllm(running)
        admitted = self._admit_dllm(running, self.dllm.slots_needed(running))
        reqs = running + admitted
        self.running_batch = self._new_batch(reqs)
        if not reqs:
            return None
        batch = self._new_batch(reqs)
        try:
            batch.prepare_for_dllm_extend()
        except Exception as e:  # the requests of this batch fail; the engine goes on
            self.failed += self.fail_reqs(reqs, e)
            return None
        self.new_token_ratio = max(self.new_token_ratio - self.config.new_token_ratio_decay,
                                   self.config.min_new_token_ratio)
        return batch

    def _retract_dllm(self, running: list[Req]) -> list[Req]:
        """Retract running requests, least output first, until the rest's new blocks fit; each
        keeps its block and is admitted again later (its KV recomputed from the cache's whole
        blocks). Returns the requests kept."""
        order = sorted(running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        kept, retracted = list(running), []
        while len(kept) > 1 and self.dllm.slots_needed(kept) > self.cache.available_size():
            victim = order[len(retracted)]
            kept.remove(victim)
            self.dllm.retract(victim)
            victim.num_retractions += 1
            retracted.append(victim)
        self.num_retracted += len(retracted)
        self.waiting_queue = retracted + self.waiting_queue
        self.new_token_ratio = 1.0  # reserve every running request's full remaining output a while
        return kept

    def _admit_dllm(self, running: list[Req], reserve: int) -> list[Req]:
        """Waiting requests admitted under the PrefillAdder's budgets (KV for their first forward,
        from the cached whole blocks to their first block's end, beside `reserve` slots the
        running requests take in this batch; prefill tokens per batch), their first blocks begun."""
        if not self.waiting_queue or len(running) >= self.max_running:
            return []
        if self.config.schedule_policy == "lpm":
            for req in self.waiting_queue:
                self.dllm.match_prefix(req)
            self.waiting_queue.sort(key=lambda r: -len(r.prefix_indices))
        # (no chunk limit: a prompt's first forward is one extend)
        adder = PrefillAdder(self.cache, running, self.new_token_ratio, self.max_prefill_tokens, 1 << 62,
                             min_reserve=reserve)
        admitted_heads: set[tuple[int, ...]] = set()
        for req in self.waiting_queue:
            if len(running) + len(adder.can_run) >= self.max_running:
                break
            if self.config.schedule_policy != "lpm":
                self.dllm.match_prefix(req)
            if self._defer_shared_prefix(req, admitted_heads):
                continue
            if adder.add_one_req(req) != AddResult.CONTINUE:
                break
        admitted = {id(r) for r in adder.can_run}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        for req in adder.can_run:
            if req.num_retractions == 0:
                req.cached_tokens = len(req.prefix_indices)
                self.cached_tokens += req.cached_tokens
                self.prompt_tokens += len(req.origin_input_ids)
            self.dllm.start(req)
        return adder.can_run

    def _process_dllm(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """Unmask every block (a request whose rows are not finite fails alone), commit the blocks
        left with no mask (their tokens are the request's new output, streamed now), end the
        finished requests (their final blocks cached)."""
        touched, good, rows = [], [], []
        sizes = [len(r) for r in batch.dllm_logit_rows]
        finite = torch.isfinite(logits).all(dim=1).tolist()
        for req, start, n in zip(batch.reqs, itertools.accumulate(sizes, initial=0), sizes):
            if req.finished():
                continue
            if not all(finite[start:start + n]):
                touched += self.fail_reqs([req], "the model produced non-finite logits for this request")
                continue
            good.append(req)
            rows.extend(range(start, start + n))
        if len(good) < len(batch.reqs) and good:
            logits = logits[torch.tensor(rows, device=logits.device)]
        try:
            if good:
                self.dllm.unmask(good, logits)
        except Exception as e:
            touched += self.fail_reqs(good, e)
            good = []
        for req in good:
            try:
                appended = self.dllm.settle(req)
            except Exception as e:  # one request's bug (stop checks, say) fails that request only
                touched += self.fail_reqs([req], e)
                continue
            self.generated_tokens += len(appended)
            if appended:  # (the cache call outside that guard, as for autoregressive requests)
                self.dllm.next_block(req)
                touched.append(req)
        self._drop_finished_from_running()
        return touched

    # ---- LoRA admission ---------------------------------------------------------------------------
    def _lora_starved(self) -> str | None:
        """The adapter that has waited longest for a slot, once that is LORA_MAX_WAIT_ROUNDS prefill
        rounds (None before): new requests of the others wait until it runs."""
        self._lora_round += 1
        if not self._lora_waiting:
            return None
        present = {r.lora_name for r in self.waiting_queue}
        self._lora_waiting = {n: r for n, r in self._lora_waiting.items() if n in present}
        oldest = min(self._lora_waiting.items(), key=lambda item: item[1], default=None)
        if oldest is None or self._lora_round - oldest[1] < LORA_MAX_WAIT_ROUNDS:
            return None
        return oldest[0]

    def _lora_admissible(self, req: Req, admitting: set[str], starved: str | None,
                         stale: list[tuple[Req, str]]) -> bool:
        """Whether the request's adapter (one it does not hold yet) lets it start now; if so it
        holds a reference on it from here (in host memory: read again if it was evicted). An
        adapter unloaded, loaded again or unreadable since the request was submitted puts it in
        `stale` with the reason."""
        name = req.lora_name
        if name not in self.lora or self.lora.adapter_id(name) != req.lora_id:
            stale.append((req, str(UnknownLoRAError(name))))
            return False
        if starved is not None and name != starved:
            return False  # the active adapters drain until the starved one has a slot
        if not self.lora.can_admit(name, admitting):
            self._lora_waiting.setdefault(name, self._lora_round)
            return False
        try:
            self.lora.acquire(name)
        except LoRAAdapterError as e:  # its files changed or vanished since it was loaded
            stale.append((req, str(e)))
            return False
        return True

    def _fail_stale_lora(self, stale: list[tuple[Req, str]]) -> None:
        """End waiting requests whose adapter is gone or unreadable (each with its reason)."""
        gone = {id(r) for r, _ in stale}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in gone]
        for req, message in stale:
            req.finished_reason = FinishReason("abort", message=message, error_kind="invalid_request")
            self.failed.append(req)

    def _defer_shared_prefix(self, req: Req, admitted_heads: set[tuple[int, ...]]) -> bool:
        """In-batch prefix caching: of several uncached requests that share a head, admit one
        now; the others wait a round and then hit the tree instead of recomputing the prefix."""
        if self.config.disable_radix_cache or len(req.prefix_indices) >= IN_BATCH_PREFIX_LEN:
            return False
        fill = req.origin_input_ids
        if len(fill) < 2 or len(req.prefix_indices) >= len(fill) - 1:
            return False
        # A shorter prompt shares only with its exact copies (the n choices of one request).
        head = tuple(fill[:IN_BATCH_PREFIX_LEN]) if len(fill) > IN_BATCH_PREFIX_LEN else tuple(fill)
        head = (req.lora_id, *head)  # heads under different adapters share no KV
        # One that needs prompt logits computes its whole prompt anyway: it never waits, but the
        # others that share its head do.
        if head in admitted_heads and not req.needs_prompt_logits:
            return True
        admitted_heads.add(head)
        return False

    def update_running_batch(self) -> ScheduleBatch | None:
        batch = self.running_batch
        if batch.is_empty():
            return None
        if not batch.check_decode_mem() and self.prealloc is not None:
            self.prealloc.retract()  # transfers still on their way are the cheapest to give back
        if not batch.check_decode_mem():
            retracted = batch.retract_decode()
            self.num_retracted += len(retracted)
            if self.prealloc is not None:  # a decode engine never extends: their KV comes back through a prefill
                for req in reversed(retracted):
                    self.prealloc.add(req, first=True)
            else:
                self.waiting_queue = retracted + self.waiting_queue
            # Reserve every running request's full remaining output for a while: no thrashing.
            self.new_token_ratio = 1.0
        try:
            drafts, width = self._drafts(batch.reqs) if self.drafter is not None else (None, None)
            if drafts is not None:
                batch.prepare_for_verify(drafts, width)
            else:
                batch.prepare_for_decode(from_future=self.inflight is not None)
        except Exception as e:
            self.failed += self.fail_reqs(batch.reqs, e)
            return None
        self.new_token_ratio = max(self.new_token_ratio - self.config.new_token_ratio_decay,
                                   self.config.min_new_token_ratio)
        return batch

    def _drafts(self, reqs: list[Req]) -> tuple[list[list[int]] | None, int | None]:
        """Each running request's drafts (never past its max_new_tokens or the context), or
        None when there are none or the pool cannot hold them (a plain decode step then); and
        the width to pad them to for a CUDA graph (None: no padding)."""
        drafts = self.drafter.propose_batch(reqs, [min(r.sampling_params.max_new_tokens - len(r.output_ids) - 1,
                                                       self.max_context_len - r.seqlen) for r in reqs],
                                            room=self.cache.available_size() - len(reqs))
        need = len(reqs) + sum(map(len, drafts))
        if need == len(reqs) or need > self.cache.available_size():
            return None, None
        width = self.model_runner.verify_graph_width(len(reqs))
        # The filler is freed again at once: it may take free slots only, never evict the cache.
        if width is not None and (len(reqs) * width > self.cache.free_size()
                                  or any(r.kv_len + width > self.max_context_len for r in reqs)):
            width = None  # no room for the filler: eager, at each request's own width
        return drafts, width

    def complete(self, batch: ScheduleBatch, wait: Callable[[], SampleResult]) -> list[Req]:
        """Wait for a launched batch and process its result. A forward that raises fails
        exactly the batch's requests (their KV is released, not cached); the engine goes on,
        unless batches keep failing (a broken device), which raises EngineDeadError."""
        try:
            result = wait()
        except Exception as e:
            if not self.isolate_batch_failures:
                raise
            self.consecutive_batch_failures += 1
            failed = self.fail_reqs(batch.reqs, e)
            if self.consecutive_batch_failures >= MAX_CONSECUTIVE_BATCH_FAILURES:
                raise EngineDeadError(f"{self.consecutive_batch_failures} batches failed in a row; "
                                      f"last: {type(e).__name__}: {e}") from e
            return failed
        self.consecutive_batch_failures = 0
        if result is None:  # a split prefill's step short of its last layer: nothing to process yet
            return []
        return self.process_batch_result(batch, result)

    def fail_reqs(self, reqs: list[Req], error: BaseException | str) -> list[Req]:
        """End admitted requests (in a batch, running or chunked) with an engine error. Their KV
        is freed without caching: a failed forward may have left garbage in it."""
        if isinstance(error, BaseException):
            log.error("batch of %d request(s) failed", len(reqs), exc_info=error)
            error = f"{type(error).__name__}: {error}"
        ended = []
        for req in reqs:
            if req.finished():
                continue
            req.finished_reason = FinishReason("abort", message=f"engine error: {error}",
                                               error_kind="engine_error")
            if req is self.chunked_req:
                self.chunked_req = None
            try:
                if self.dllm is not None:
                    self.dllm.release(req)
                else:
                    self.cache.release_req(req)
            except Exception:  # keep failing the others; the idle check reports any leak
                log.exception("releasing the KV of request %s failed", req.rid)
            self.num_failed += 1
            ended.append(req)
        self._drop_finished_from_running()
        return ended

    def _drop_finished_from_running(self) -> None:
        # A new batch object, never an edit of the old one: under overlap the old one may be
        # in flight, and its rows must keep lining up with its requests.
        self.running_batch = self._new_batch([r for r in self.running_batch.reqs if not r.finished()])

    def launch_batch(self, batch: ScheduleBatch, executor=None) -> Callable[[], SampleResult]:
        """Build the ForwardBatch here; run forward + sample here or on `executor` (the overlap
        forward thread). Returns a callable that waits for the result."""
        try:
            fb = ForwardBatch.init_new(batch, self.device)
        except Exception as e:  # reported when the batch is completed, like a forward error
            return _raiser(e)
        mode = fb.forward_mode.name
        self.batches_by_mode[mode] += 1
        self.last_mode = mode
        # Read now, not on the forward thread: the next step may prepare this batch object again.
        reqs, drafts, from_future = batch.reqs, batch.drafts, batch.input_ids_from_future
        # Rows of prompt chunks that do not reach their prompt's end: their token is thrown away,
        # so it must not draw from the request's RNG (a seeded request samples the same tokens
        # however its prompt was chunked).
        partial = frozenset(i for i, r in enumerate(reqs) if r.kv_len < r.seqlen) if fb.forward_mode.is_extend() \
            else frozenset()

        def job() -> PendingSample | DllmLogits:
            t0 = time.perf_counter()
            if fb.forward_mode.is_dllm_extend():  # the unmasking runs when the batch is processed
                pending = DllmLogits(self.model_runner.forward(fb))
            elif fb.forward_mode.is_target_verify():
                pending = self.model_runner.forward_and_verify(fb, reqs, drafts)
            else:
                pending = self.model_runner.forward_and_sample(fb, reqs, from_future, partial)
            self.forward_seconds[mode] += time.perf_counter() - t0
            return pending

        return self._submit(job, executor)

    @staticmethod
    def _submit(job: Callable[[], PendingSample | None],
                executor: concurrent.futures.Executor | None) -> Callable[[], SampleResult | None]:
        """Run `job` here or on `executor`; returns a callable that waits for its result (None:
        a job that samples nothing) and raises what the job raised."""
        if executor is None:
            try:
                pending = job()
            except Exception as e:
                return _raiser(e)
            return _no_result if pending is None else pending.resolve
        future = executor.submit(job)

        def wait() -> SampleResult | None:
            pending = future.result()
            return None if pending is None else pending.resolve()
        return wait

    # ---- split prefill -----------------------------------------------------------------------
    def split_forward_count(self, extend_tokens: int) -> int | None:
        """Layers per step of a prefill batch of `extend_tokens` new tokens, when it is split:
        max(1, split_forward_token_budget // extend_tokens). None when it is not: splitting off, a
        model without forward_split_prefill, attention-DP (its MLP collectives run in lock-step
        with whole forwards), or a batch whose every layer fits in one step's budget."""
        model, layers = self.model_runner.model, self.model_runner.model_config.num_hidden_layers
        if not (self.config.enable_split_prefill and model.supports_split_prefill and model.mlp_comm is None):
            return None
        count = max(1, self.config.split_forward_token_budget // max(1, extend_tokens))
        return count if count < layers else None

    def start_split_prefill(self, batch: ScheduleBatch) -> None:
        """Hold a SPLIT_PREFILL batch in flight; its ForwardBatch is built now, once."""
        try:
            fb = ForwardBatch.init_new(batch, self.device)
        except Exception as e:  # its requests fail, as when any batch cannot be built
            self.failed += self.fail_reqs(batch.reqs, e)
            return
        partial = frozenset(i for i, r in enumerate(batch.reqs) if r.kv_len < r.seqlen)
        self.split_prefill = SplitPrefill(batch, fb, self.split_forward_count(fb.num_tokens) or 1, partial)
        self.batches_by_mode[ForwardMode.SPLIT_PREFILL.name] += 1

    def launch_split_prefill(self, executor: concurrent.futures.Executor | None = None
                             ) -> Callable[[], SampleResult | None] | None:
        """Run the split prefill's next layers here or on `executor`, after the batch launched
        before it (forwards run one at a time on the CPU; on CUDA on the split stream). With no
        request decoding, every remaining layer at once: there is nothing to interleave with.
        None: no split prefill."""
        sp = self.split_prefill
        if sp is None:
            return None
        remaining = self.model_runner.model_config.num_hidden_layers - sp.fb.split_index
        count = min(remaining, sp.forward_count) if self.running_batch.reqs else remaining
        self.split_prefill_layers += count
        self.last_mode = self.last_mode or ForwardMode.SPLIT_PREFILL.name
        fb, reqs, partial = sp.fb, sp.batch.reqs, sp.partial

        def job() -> PendingSample | None:
            t0 = time.perf_counter()
            pending = self.model_runner.split_prefill_and_sample(fb, reqs, count, partial)
            self.forward_seconds[ForwardMode.SPLIT_PREFILL.name] += time.perf_counter() - t0
            return pending

        return self._submit(job, executor)

    def complete_split_prefill(self, wait: Callable[[], SampleResult | None] | None) -> list[Req]:
        """Wait for this step's layers of the split prefill; after its last layer its results are
        processed as any prefill's (its requests join the running batch) and it ends."""
        sp = self.split_prefill
        if wait is None or sp is None:
            return []
        touched = self.complete(sp.batch, wait)
        done = sp.fb.split_index >= self.model_runner.model_config.num_hidden_layers
        if done or all(r.finished() for r in sp.batch.reqs):  # (a failed forward failed them all)
            self._end_split_prefill(completed=done)
        return touched

    def _end_split_prefill(self, completed: bool) -> None:
        """The split prefill is over (its last layer ran, or it failed, or every request left):
        the KV of its requests aborted meanwhile is cached if it was completed, else freed."""
        sp, self.split_prefill = self.split_prefill, None
        sp.fb.hidden_states = None
        for req in sp.aborted:
            if req.req_pool_idx is None:
                continue
            if completed:
                self.cache.cache_finished_req(req)
            else:
                self.cache.release_req(req)

    def process_batch_result(self, batch: ScheduleBatch, result: SampleResult | VerifyResult) -> list[Req]:
        if batch.forward_mode.is_idle():
            return []
        if batch.forward_mode.is_target_verify():
            return self._process_verify(batch, result)
        if batch.forward_mode.is_dllm_extend():
            return self._process_dllm(batch, result)
        touched, still_running = [], []
        decoding = batch.decoding_reqs
        for i, req in enumerate(batch.reqs):
            if req.finished():  # overlap: it finished one step earlier; this extra token is void
                continue
            if result.next_token_ids[i] < 0:
                touched += self.fail_reqs([req], "the model produced non-finite logits or "
                                                 "probabilities for this request")
                continue
            lp = result.logprobs[i]
            if lp is not None and lp.prompt is not None:
                try:
                    self._add_prompt_logprobs(req, lp.prompt)
                except Exception as e:
                    touched += self.fail_reqs([req], e)
                    continue
                lp = lp._replace(prompt=None)
            if req.kv_len < req.seqlen:  # a prefill chunk that did not reach the prompt's end
                self.cache.cache_unfinished_req(req)
                continue
            if self.transfers is not None:  # a prefill engine: the first token goes with the KV
                self.transfers.add(req, result.next_token_ids[i], lp)
                continue
            try:
                self._append_token(req, result.next_token_ids[i], lp)
            except Exception as e:  # one request's bug (stop checks, say) fails that request only
                touched += self.fail_reqs([req], e)
                continue
            # The cache calls stay outside that guard: one failing half-way leaves the tree in an
            # unknown state, which no single request can be blamed for (the loop dies instead).
            if req.finished():
                if req.kv_len >= req.seqlen and self.cache.hicache is not None:
                    # Overlap: the decode batch launched ahead writes this token's KV into the
                    # slot it took for it. Cached, a host-tier backup (on this thread) could copy
                    # the slot before that forward has written it: it goes back to the pool instead.
                    self.cache.truncate(req, req.seqlen - 1)
                self.cache.cache_finished_req(req)
            else:
                if batch.forward_mode.is_extend() and id(req) not in decoding:
                    # The prompt's KV joins the tree now, so requests sharing it hit at once.
                    self.cache.cache_unfinished_req(req)
                still_running.append(req)
            touched.append(req)
        if batch.forward_mode in (ForwardMode.EXTEND, ForwardMode.SPLIT_PREFILL):
            self.running_batch = self._new_batch(self.running_batch.reqs + still_running)
        else:  # DECODE, or MIXED whose batch holds the former running requests too
            self._set_running(batch, still_running)
        return touched

    def _set_running(self, batch: ScheduleBatch, still_running: list[Req]) -> None:
        """After a decode, verify or MIXED batch: its requests still running, and those that
        joined the running batch while it was in flight (a split prefill that ended meanwhile)."""
        held = {id(r) for r in batch.reqs}
        joined = [r for r in self.running_batch.reqs if id(r) not in held and not r.finished()]
        self.running_batch = self._new_batch(still_running + joined)

    def _process_verify(self, batch: ScheduleBatch, result: VerifyResult) -> list[Req]:
        """Emit each request's accepted drafts and the target's token, one at a time with the
        plain stop checks; the KV of what was not emitted goes back to the pool at once."""
        self.spec_draft_tokens += result.drafted
        self.spec_accepted_tokens += result.accepted
        self.spec_verify_requests += len(batch.reqs)
        touched, still_running = [], []
        for i, req in enumerate(batch.reqs):
            if result.bad[i]:
                touched += self.fail_reqs([req], "the model produced non-finite logits or "
                                                 "probabilities for this request")
                continue
            draft = batch.drafts[i]
            self.drafter.feedback(req, len(draft), len(result.tokens[i]) - 1)
            kept = 0
            try:
                for j, token in enumerate(result.tokens[i]):
                    self._append_token(req, token, result.logprobs[i][j] if result.logprobs[i] else None)
                    kept += 1
                    if req.finished():
                        break
            except Exception as e:
                touched += self.fail_reqs([req], e)
                continue
            self.cache.truncate(req, batch.prefix_lens[i] + kept)
            if req.finished():
                self.cache.cache_finished_req(req)
            else:
                still_running.append(req)
            touched.append(req)
        self._set_running(batch, still_running)
        return touched

    @staticmethod
    def _add_prompt_logprobs(req: Req, chunk: list) -> None:
        """Append one extend's prompt logprobs; they start where the request's last chunk ended."""
        start = req.kv_len - req.extend_input_len
        if req.prompt_logprobs is None or start != len(req.prompt_logprobs):
            raise RuntimeError(f"prompt logprobs of positions from {start} do not follow the "
                               f"{len(req.prompt_logprobs or [])} already computed")
        req.prompt_logprobs.extend(chunk)

    def _append_token(self, req: Req, token: int, logprob: tuple | None) -> None:
        if req.grammar is not None and not req.grammar.accept(token):  # the mask should make this impossible
            raise GrammarError(f"token {token} does not fit the request's grammar")
        req.output_ids.append(token)
        if req.sampling_params.logprobs:
            req.output_logprobs.append(logprob)
        self.generated_tokens += 1
        req.check_finished(self.eos_token_ids, self.max_context_len, self.decode_tail)

    # ---- integrity ---------------------------------------------------------------------------
    def check_memory(self) -> None:
        """The idle invariant (see CacheManager.check_idle), and the drafter's."""
        self.cache.check_idle()
        if self.drafter is not None:
            self.drafter.check_idle()
        if self.dllm is not None:
            self.dllm.check_idle()
