"""ModelRunner: owns the weights, the KV memory and the attention backend; runs ForwardBatches."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from typing import TYPE_CHECKING

import torch

from engine.attention import create_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.memory import KVCache, ReqToTokenPool, TokenToKVPoolAllocator
from engine.model_path import resolve_model_path
from engine.models import build_model
from engine.models.layers import GatedMLP, shard_range
from engine.sampling import SampleResult, grammar_bitmask, sample_on_device
from engine.speculative import VerifyResult, verify
from engine.tp.batch import (
    FORWARD,
    SPLIT,
    STOP,
    LoRASetup,
    ReqToTokenMirror,
    TPStep,
    encode_batch,
)
from engine.tp.comm import TPGroup
from engine.tp.layout import TPLayout
from kernels import cpu_kernels
from kernels.cpu_linear import LinearKind, native_linear_works, onednn_linear_works

if TYPE_CHECKING:
    from collections.abc import Callable

    from engine.lora import LoRAConfig, LoRAManager, LoRAReplica, LoRAShards, PoolEvent
    from engine.tp.graph_ops import GraphCollectives
    from kernels.lora import LoRAWeights

log = logging.getLogger("radixray.engine")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BUDGET_BYTES = 256 << 20  # default KV pool on CPU when max_total_tokens is not set


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but CUDA is not available")
    return dev


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU bf16 matmuls are slow and lose parity
    return _DTYPES.get(model_cfg.torch_dtype.replace("torch.", ""), torch.bfloat16)


def resolve_linear(backend: str, device: torch.device, dtype: torch.dtype) -> LinearKind:
    """Resolve EngineConfig.linear_backend to a kernels.cpu_linear kind: 'auto' is the project's
    GEMM on the CPU where it works (float32 with AVX-512; bfloat16 with AVX512-BF16, beside
    oneDNN), else oneDNN where it works, else torch."""
    if backend == "torch":
        return "torch"
    if device.type != "cpu":
        if backend != "auto":
            raise ConfigError(f"linear_backend={backend!r} is for device='cpu'")
        return "torch"
    works = {"native": native_linear_works, "onednn": onednn_linear_works}
    if backend != "auto":
        if not works[backend](dtype):
            what = ("needs float32 and AVX-512, or bfloat16 and AVX512-BF16" if backend == "native"
                    else "is unavailable")
            raise ConfigError(f"linear_backend={backend!r} {what} for {dtype} in this build (use 'torch' or 'auto')")
        return backend
    return next((kind for kind in ("native", "onednn") if works[kind](dtype)), "torch")


def use_onednn(backend: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether EngineConfig.linear_backend resolves to oneDNN (`resolve_linear`)."""
    return resolve_linear(backend, device, dtype) == "onednn"


def cpu_graphs_enabled(config: EngineConfig, dtype: torch.dtype) -> bool:
    """EngineConfig.cpu_graph; "auto" is RADIXRAY_CPU_GRAPHS=0 or 1 where that is set (process-wide),
    else on for bfloat16 weights."""
    mode = config.cpu_graph
    if mode == "auto":
        mode = {"0": "off", "1": "on"}.get(os.environ.get("RADIXRAY_CPU_GRAPHS", ""), "auto")
    return mode == "on" or (mode == "auto" and dtype == torch.bfloat16)


def plain_greedy(req) -> bool:
    """Its next token is the argmax of the raw logits over what its grammar (if any) allows:
    nothing else is asked of the sampler."""
    p = req.sampling_params
    return p.is_greedy and not p.logprobs and p.prompt_logprobs is None and not p.has_penalties


class ModelRunner:
    """One rank's model, KV pool and backends. Under tensor parallelism (config.tp_size > 1) each
    rank of the engine has one, built with its `tp_rank` and the engine's `tp_group` (rank 0's
    through `Engine(tp_group=...)`): rank 0's `forward` sends
    each batch to the other ranks before running it (`engine.tp.worker.TPWorker` runs it there)."""

    def __init__(self, config: EngineConfig, model_dir: str, mlp_shard: tuple[int, int] = (0, 1),
                 tp_rank: int = 0, tp_group: TPGroup | None = None) -> None:
        self.config = config
        model_dir = resolve_model_path(model_dir)  # a folder, or a built-in model's name
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, cfg, self.device)
        self.max_context_len = min(config.max_context_len or cfg.max_position_embeddings,
                                   cfg.max_position_embeddings)
        self.tp_size, self.tp_rank = config.tp_size, tp_rank
        self.tp_group = self._tp_group(tp_group, mlp_shard)
        self.layout = TPLayout.from_config(cfg, tp_rank, self.tp_size)  # ConfigError before any weight is read
        # mlp_shard (rank, world): attention-DP splits every MLP over the group (an MoE model's
        # experts or intermediate dims, as config.moe_split says).
        self.linear_kind = resolve_linear(config.linear_backend, self.device, self.dtype)
        self.model = build_model(cfg, model_dir, self.dtype, self.device, self.max_context_len, mlp_shard,
                                 linear=self.linear_kind, moe_split=config.moe_split,
                                 quantization=config.quantization, tp=self.tp_group)
        # This rank's KV heads (replicated ones included): the pool is sized per rank.
        per_token = self.layout.kv_bytes_per_token(cfg.num_hidden_layers, self.dtype)
        self.max_total_tokens = config.max_total_tokens or self._default_pool_size(per_token)
        cpu_graphs = self.device.type == "cpu" and cpu_graphs_enabled(config, self.dtype)
        # Under TP only when asked for: every rank compiles every size at start, and the gloo
        # collectives, not the Python around the kernels, bound a step there.
        cpu_graphs = cpu_graphs and (self.tp_size == 1 or config.cpu_graph == "on")
        if self.tp_size > 1:  # every rank must have every slot rank 0 hands out
            # (and CPU graphs on every rank or on none: "auto" may read each process's environment)
            agreed = self.tp_group.all_gather(
                torch.tensor([self.max_total_tokens, int(cpu_graphs)], device=self.device), dim=0)
            self.max_total_tokens = int(agreed[0::2].min())
            cpu_graphs = bool(agreed[1::2].min())
        max_running = config.max_running_requests or min(256, max(8, self.max_total_tokens // 32))
        self.req_to_token_pool = ReqToTokenPool(max_running, self.max_context_len, self.device)
        self.future_token_ids = torch.zeros(max_running + 1, dtype=torch.int64, device=self.device)
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        self.kv_cache = KVCache(self.max_total_tokens, cfg.num_hidden_layers, self.layout.num_kv_heads,
                                cfg.head_dim, self.dtype, self.device)
        self.attn_backend = create_attention_backend(config.attention_backend, self.req_to_token_pool,
                                                     self.kv_cache, self.model.scale, self.device)
        cuda = self.device.type == "cuda"
        self.forward_stream = torch.cuda.Stream(self.device) if cuda else None
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None  # sampled ids -> host
        # Split prefills run on their own stream, so a split's layers and the decode batch of the
        # same step can share the device (SGLang's PD multiplexing gives each its own SMs too).
        self.split_stream = torch.cuda.Stream(self.device) if cuda and config.enable_split_prefill else None
        self.graph_runner = None
        self.cpu_graphs = False  # graph_runner is a CpuGraphRunner
        # Under TP the CPU graphs hold the collectives as operators bound to this runner's group
        # (engine/tp/graph_ops.py; unbound on close); the CUDA graphs capture NCCL's collectives
        # as they are: every rank captures the same ladder in the same order at start (the
        # capture's collectives meet), and rank 0's choice of graph goes with each step.
        self.graph_collectives: GraphCollectives | None = None
        # (Not with split prefill under TP: a split's eager collectives on its own stream could
        # then reach the device before or after a replayed decode graph's, unlike on the others.)
        tp_graphs = self.tp_group.cuda_graph_capturable and not (self.tp_size > 1 and config.enable_split_prefill)
        if (cuda and not config.disable_cuda_graph and mlp_shard[1] == 1 and tp_graphs
                and self.attn_backend.graph_safe and self.model.cuda_graph_safe):  # else eagerly
            from engine.cuda_graph import CudaGraphRunner

            verify_width = 1 + config.speculative_num_draft_tokens if config.speculative_algorithm else 0
            # A block-diffusion model runs DLLM_EXTEND batches only: graphs of one block per request.
            dllm_width = cfg.dllm_block_size if cfg.is_dllm else 0
            self.graph_runner = CudaGraphRunner(self, min(config.cuda_graph_max_bs, max_running), verify_width,
                                                dllm_width)
            if self.model.expert_tokens is not None:  # capture's warm-up forwards are no traffic
                self.model.expert_tokens.zero_()
        elif (cpu_graphs and mlp_shard[1] == 1
              and self.attn_backend.cpu_graph_safe
              and self.model.cpu_graph_safe):  # (attention-DP's MLP collectives stay eager, as on CUDA)
            from engine.cpu_graph import CpuGraphRunner

            max_bs = config.cpu_graph_max_bs or config.cuda_graph_max_bs
            # Rows, not requests: a DLLM_EXTEND batch is a row per token, a block or more per request.
            rows = max_running * (cfg.dllm_block_size if cfg.is_dllm else 1)
            if self.tp_size > 1:
                from engine.tp.graph_ops import GraphCollectives

                self.graph_collectives = GraphCollectives(self.tp_group)
            self.graph_runner = CpuGraphRunner(self, min(max_bs, rows), self.graph_collectives)
            self.cpu_graphs = True
            if not config.enable_lazy_cpu_graph:
                seconds = self.graph_runner.compile_all()
                if self.model.expert_tokens is not None:  # warm-up forwards are no traffic
                    self.model.expert_tokens.zero_()
                log.info("CPU decode graphs for batch sizes %s compiled in %.1f s", self.graph_runner.ladder, seconds)
        # On the CPU a verify batch runs as decode rows: the fused C++ decode kernel (and the CPU
        # decode graphs) instead of the extend attention.
        self.verify_as_decode = not cuda and self.attn_backend.cpu_graph_safe
        # Likewise a DLLM_EXTEND batch (block-causal attention as decode rows, each up to its
        # block's end), graphs or not, so that graphed and eager forwards run the same kernels.
        self.dllm_as_decode = self.verify_as_decode and cfg.is_dllm
        # Greedy ids of a plain greedy batch land here (the kernel's argmax), and go to the host
        # as a list at once, so the buffers are free for the next batch.
        self.greedy_ids = self.greedy_void = None
        if not cuda and self.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.load() is not None:
            self.greedy_ids = torch.zeros(max_running + 1, dtype=torch.int64)
            self.greedy_void = torch.zeros(max_running + 1, dtype=torch.int64)
        # Rank 0 of several: what the other ranks' request -> token tables hold (TPStep's diff).
        self._tp_lock = threading.Lock()
        self.tp_mirror = (ReqToTokenMirror(self.req_to_token_pool.req_to_token)
                          if self.tp_size > 1 and tp_rank == 0 else None)
        self.mlp_shard = mlp_shard
        # Rank 0 of several with a host KV tier: its copies since the last TPStep (the scheduler
        # sets it: HostKVPool.take_copies).
        self.tp_host_copies: Callable[[], list] | None = None
        self.lora_manager: LoRAManager | None = None  # init_lora (rank 0)
        self.lora_replica: LoRAReplica | None = None  # init_lora_replica (the other ranks)

    def init_lora(self, lora_config: LoRAConfig) -> LoRAManager:
        """The serving model's adapters: a LoRAManager (adapters in lora_config.lora_paths read and
        validated now) whose slots the model's projections read. The Engine calls this for its own
        runner only (a draft model runs without adapters). ConfigError for what does not compose
        with LoRA yet. Under tensor parallelism this is rank 0's: it holds its shards, decides
        every rank's slots and tells the other ranks how to build theirs (`init_lora_replica`)."""
        from engine.lora import LoRAManager

        if self.tp_rank != 0:
            raise ValueError("a tensor-parallel rank other than 0 follows rank 0's adapters (init_lora_replica)")
        try:
            attach = self._lora_attach()
            manager = LoRAManager(lora_config, self.model_config, self.dtype, self.device,
                                  shards=self._lora_shards(), record_events=self.tp_size > 1,
                                  fixed_slots=self.mlp_shard[1] > 1)
        except BaseException as e:  # the other ranks wait for the setup: they fail too
            with contextlib.suppress(Exception):  # (a broken group: they are gone already)
                self._send_lora_setup(LoRASetup(error=str(e) or type(e).__name__))
            raise
        self._send_lora_setup(LoRASetup(max_lora_rank=manager.max_lora_rank,
                                        target_modules=sorted(manager.target_modules),
                                        num_slots=manager.pool.num_slots))
        attach(manager.weights)
        self.lora_manager = manager
        return manager

    def init_lora_replica(self) -> LoRAReplica:
        """A tensor-parallel rank other than 0: adapter slots of its own shards, as rank 0's
        `init_lora` sizes them, changed only by rank 0's pool events (engine.tp.worker applies
        them with each step). ConfigError when rank 0 could not start its adapters."""
        from engine.lora import LoRAReplica

        if self.tp_rank == 0:
            raise ValueError("rank 0 decides the adapter slots (init_lora)")
        setup = self.tp_group.broadcast_object(None, as_type=LoRASetup)
        if setup.error is not None:
            raise ConfigError(f"rank 0 could not start its LoRA adapters: {setup.error}")
        attach = self._lora_attach()
        replica = LoRAReplica(self.model_config, frozenset(setup.target_modules), setup.num_slots,
                              setup.max_lora_rank, self.dtype, self.device, self._lora_shards())
        attach(replica.weights)
        self.lora_replica = replica
        return replica

    def _lora_attach(self) -> Callable[[Callable[[int, str], LoRAWeights | None]], None]:
        """The model's `attach_lora`; ConfigError for what does not compose with LoRA yet."""
        if self.model_config.is_dllm:
            raise ConfigError("LoRA adapters on a block-diffusion model are not supported yet")
        attach = getattr(self.model, "attach_lora", None)
        if attach is None:
            raise ConfigError(f"{type(self.model).__name__} cannot take LoRA adapters yet")
        return attach

    def _lora_shards(self) -> LoRAShards | None:
        """This rank's part of each adapter (None: it holds them whole): under attention-DP the
        slice of the dense MLPs' intermediate dim this member computes."""
        if self.mlp_shard[1] > 1:
            from engine.lora.mlp_shards import MLPSliceShards

            split = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, GatedMLP) and layer.mlp.sharded]
            if not split:  # (expert parallelism holds the dense MLPs whole)
                return None
            lo, hi = shard_range(self.model_config.intermediate_size, self.mlp_shard)
            return MLPSliceShards(self.model_config, lo, hi)
        if self.tp_size == 1:
            return None
        from engine.tp.sharding import TPLoRAShards

        return TPLoRAShards(self.model_config, self.layout)

    def _send_lora_setup(self, setup: LoRASetup) -> None:
        if self.tp_size > 1 and self.tp_group is not None:
            self.tp_group.broadcast_object(setup)

    def _tp_group(self, group: TPGroup | None, mlp_shard: tuple[int, int]) -> TPGroup:
        """The engine's TPGroup (a single-rank one when tp_size is 1); ConfigErrors for what does
        not compose with tensor parallelism yet."""
        config = self.config
        if config.tp_size == 1:
            if group is not None and group.tp_size != 1:
                raise ConfigError(f"a TPGroup of {group.tp_size} ranks was given for tp_size 1")
            return TPGroup(0, 1)
        if mlp_shard[1] > 1:
            # Attention-DP already splits each MLP over its group's engines (SGLang's layout);
            # TP inside each member would need a second group nested in that one.
            raise ConfigError("tp_size > 1 with attention-DP (enable_dp_attention) is not supported yet: "
                              "attention-DP splits every MLP over the DP group's engines, and tensor "
                              "parallelism inside each member would need a group nested in that one")
        if group is None:
            raise ConfigError("tp_size > 1 needs the engine's TPGroup (engine.tp.worker: rank0_engine "
                              "builds rank 0's Engine with it, TPWorker the other ranks)")
        if (group.tp_rank, group.tp_size) != (self.tp_rank, config.tp_size):
            raise ConfigError(f"TPGroup rank {group.tp_rank} of {group.tp_size} given for tp_rank "
                              f"{self.tp_rank} of tp_size {config.tp_size}")
        return group

    def send_tp(self, fb: ForwardBatch, kind: int = FORWARD, split_end: int = 0, graph_size: int = 0) -> None:
        """Rank 0: the batch (with the table entries the other ranks lack, and the graph that
        runs it: a CPU graph's padded size, 1 for a CUDA graph, 0 for none) to every other rank, which run it too
        (engine/tp/worker.py). No-op on one rank."""
        if self.tp_mirror is None:
            return
        if self.tp_group is None:
            raise RuntimeError("the tensor-parallel group was closed")
        table = self.tp_mirror.diff(fb) if kind == FORWARD or fb.split_index == 0 else None
        msg = encode_batch(fb, kind, split_end, table) if table is not None else TPStep(kind=kind, split_end=split_end)
        msg.lora_events = self._lora_events()
        msg.host_copies = (self.tp_host_copies() or None) if self.tp_host_copies is not None else None
        msg.graph_size = graph_size
        self.tp_group.broadcast_object(msg)

    def _lora_events(self) -> list[PoolEvent] | None:
        """The adapter slot changes the other ranks have not been sent (None: none)."""
        if self.lora_manager is None:
            return None
        return self.lora_manager.take_events() or None

    def close(self) -> None:
        """Rank 0 of several: tell the other ranks to leave their loops, then shut the group down
        (another rank: just shut it down); its CPU graphs' binding to the group goes first.
        Idempotent; a group already broken is just dropped."""
        if self.tp_size == 1 or self.tp_group is None:
            return
        with self._tp_lock:  # after a forward in flight (overlap) has run on every rank
            group, self.tp_group = self.tp_group, None
            if self.graph_collectives is not None:  # (its graphs cannot run any more either way)
                self.graph_collectives.close()
        try:
            if self.tp_rank == 0:  # (the last slot changes too: every rank's slots end alike)
                group.broadcast_object(TPStep(kind=STOP, lora_events=self._lora_events()))
        except Exception:  # the other ranks are gone already
            log.debug("TP stop message not delivered", exc_info=True)
        group.destroy()

    def expert_token_counts(self) -> list[int]:
        """(token, expert) pairs this engine's experts computed, by expert; [] for a dense model.
        A host copy (a device sync on CUDA): for stats, off the hot path."""
        counts = self.model.expert_tokens
        return [] if counts is None else counts.tolist()

    def _default_pool_size(self, per_token: int) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.mem_fraction_static)
            if self.config.speculative_algorithm == "draft_model":  # leave room for the draft model
                draft_weights, draft_per_token = self._draft_footprint()
                rows = self.config.max_running_requests or 256
                budget -= draft_weights + rows * self.config.speculative_num_draft_tokens * draft_per_token
                per_token += draft_per_token  # its pool has as many tokens as this one, and the drafts
                if budget <= 0:
                    raise ConfigError("the GPU has no memory left for the draft model's weights and KV "
                                      "(a smaller draft, or a lower mem_fraction_static)")
        else:
            budget = CPU_KV_BUDGET_BYTES
        cap = 1 << 20 if self.device.type == "cuda" else 1 << 16
        return max(self.max_context_len, min(budget // per_token, cap))

    def _draft_footprint(self) -> tuple[int, int]:
        """The draft model's weight bytes in this runner's dtype (from its safetensors headers: no
        tensor is read) and its KV bytes per token."""
        from safetensors import safe_open

        path = resolve_model_path(self.config.speculative_draft_model_path)
        cfg = ModelConfig.from_dir(path)
        numel = 0
        for name in os.listdir(path):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    for key in f.keys():
                        shape = f.get_slice(key).get_shape()
                        numel += int(torch.tensor(shape).prod()) if shape else 1
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return numel * itemsize, KVCache.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                         cfg.head_dim, self.dtype)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Logits [bs, vocab] at each request's last token; None for an IDLE batch."""
        fb.resolve_forward_inputs(self.device)
        if self.tp_mirror is None:
            return self.run_forward(fb)
        with self._tp_lock:  # (close() may run on another thread)
            size = self.graph_size(fb)  # every rank runs the same shapes: rank 0's choice
            self.send_tp(fb, graph_size=size)
            return self.run_forward(fb, size)

    def graph_size(self, fb: ForwardBatch) -> int:
        """The padded batch size of the CPU graph that runs `fb`, 0 when it runs eagerly; a CUDA
        graph pads by its own ladder (any nonzero size: it runs)."""
        runner = self.graph_runner
        # Graphs are captured without adapters: a batch with adapter rows runs eagerly.
        if runner is None or fb.lora_info is not None:
            return 0
        if not self.cpu_graphs:
            return 1 if runner.can_run(fb) else 0
        if self.dllm_as_decode and fb.forward_mode.is_dllm_extend():  # run as decode rows
            return runner.size_for(ForwardMode.DECODE, fb.num_tokens)
        return runner.size_for(fb.forward_mode, fb.batch_size)

    def run_forward(self, fb: ForwardBatch, graph_size: int | None = None) -> torch.Tensor | None:
        """`forward` without sending the batch to the other ranks (what they run it with);
        `graph_size`: the graph to run it with (a CPU graph's padded size, nonzero for a CUDA
        graph, which pads by its own ladder; 0: eagerly), as rank 0 chose under tensor
        parallelism; None: this runner's choice (`graph_size`)."""
        if self.dllm_as_decode and fb.forward_mode.is_dllm_extend():
            logits = self.run_forward(fb.as_decode_rows(self.model_config.dllm_block_size), graph_size)
            return logits[fb.last_token_indices]  # the masked positions' rows
        size = self.graph_size(fb) if graph_size is None else graph_size
        if size:
            if self.graph_runner is None:
                raise RuntimeError("rank 0 runs this batch as a graph and this rank has no graphs "
                                   "(graphs resolved differently on the ranks: RADIXRAY_CPU_GRAPHS?)")
            # (a CUDA graph runner pads by its own ladder)
            logits = self.graph_runner.replay(fb, size) if self.cpu_graphs else self.graph_runner.replay(fb)
            if logits is not None:  # None: a CPU graph that failed to compile; eager below
                return None if fb.forward_mode.is_idle() else logits
        fb.attn_metadata = self.attn_backend.init_forward_metadata(fb)
        logits = self.model.forward(fb, self.attn_backend)
        return None if fb.forward_mode.is_idle() else logits

    @torch.inference_mode()
    def forward_and_sample(self, fb: ForwardBatch, reqs: list, from_future: bool,
                           partial: frozenset[int] = frozenset()) -> PendingSample:
        """The forward side of overlap scheduling. Decode inputs not sampled yet when the batch
        was built are read here from the future-token buffer (indexed by request row), which
        the previous forward has written by now: forwards run one after another. `partial`:
        rows whose token is discarded (a prompt chunk short of the prompt's end): not sampled."""
        if self.forward_stream is None:
            return self._forward_and_sample(fb, reqs, from_future, partial)
        # CUDA: the forward stream waits for work queued before it (KV writes of the previous
        # batch, the scheduler's index writes), then runs without blocking the scheduler.
        self.forward_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.forward_stream):
            return self._forward_and_sample(fb, reqs, from_future, partial)

    @torch.inference_mode()
    def forward_split_prefill(self, fb: ForwardBatch, forward_count: int) -> torch.Tensor | None:
        """SPLIT_PREFILL: the next `forward_count` layers of `fb` (from fb.split_index); the
        inputs and the attention metadata are set up at the first split and kept for the rest.
        Logits after the last layer, else None."""
        if fb.split_index == 0:
            fb.resolve_forward_inputs(self.device)
        end = min(fb.split_index + forward_count, self.model_config.num_hidden_layers)
        if self.tp_mirror is None:
            return self.run_split_prefill(fb, end)
        with self._tp_lock:
            self.send_tp(fb, SPLIT, end)
            return self.run_split_prefill(fb, end)

    def run_split_prefill(self, fb: ForwardBatch, end: int) -> torch.Tensor | None:
        """Layers [fb.split_index, end) of a SPLIT_PREFILL batch, without sending it."""
        if fb.split_index == 0:
            fb.attn_metadata = self.attn_backend.init_forward_metadata(fb)
        return self.model.forward_split_prefill(fb, self.attn_backend, end)

    @torch.inference_mode()
    def split_prefill_and_sample(self, fb: ForwardBatch, reqs: list, forward_count: int,
                                 partial: frozenset[int] = frozenset()) -> PendingSample | None:
        """One split of a SPLIT_PREFILL batch (see forward_split_prefill); after its last layer,
        its sampled tokens (as forward_and_sample), else None. On CUDA on the split stream, which
        waits for the scheduler's writes (default stream) and, at the first split only, for the
        decode forwards queued before it."""
        if self.split_stream is None:
            logits = self.forward_split_prefill(fb, forward_count)
            return None if logits is None else self._sample(fb, logits, reqs, partial, None)
        self.split_stream.wait_stream(torch.cuda.current_stream(self.device))
        if fb.split_index == 0:  # its slots may have been a finished request's, still written by a decode in flight
            self.split_stream.wait_stream(self.forward_stream)
        with torch.cuda.stream(self.split_stream):
            logits = self.forward_split_prefill(fb, forward_count)
            return None if logits is None else self._sample(fb, logits, reqs, partial, self.split_stream)

    def sync_split_prefill(self) -> None:
        """Wait until the split stream's queued work is done (before a dropped split prefill's KV
        slots go back to the pool, where the next batch may take them)."""
        if self.split_stream is not None:
            self.split_stream.synchronize()

    def verify_graph_width(self, bs: int) -> int | None:
        """Positions per request (1 + k) that a verify batch of bs requests is padded to, so that
        it replays a CUDA graph; None: it runs eagerly, each request at 1 + its own drafts."""
        return self.graph_runner.verify_graph_width(bs) if self.graph_runner is not None else None

    @torch.inference_mode()
    def forward_and_verify(self, fb: ForwardBatch, reqs: list, drafts: list[list[int]]) -> Verified:
        """TARGET_VERIFY: logits at every draft position, then what each request keeps
        (engine/speculative.py), on the host: the next step drafts from the tokens kept."""
        widths = fb.extend_seq_lens_cpu
        logits = self.forward(fb.as_decode_rows() if self.verify_as_decode else fb)
        if any(n != 1 + len(d) for n, d in zip(widths, drafts)):  # padded: keep the drafts' rows
            starts = itertools.accumulate(widths, initial=0)
            keep = [j for s, d in zip(starts, drafts) for j in range(s, s + 1 + len(d))]
            logits = logits[torch.tensor(keep, device=logits.device)]
        return Verified(verify(logits, reqs, drafts))

    def _forward_and_sample(self, fb: ForwardBatch, reqs: list, from_future: bool,
                            partial: frozenset[int]) -> PendingSample:
        if from_future:  # (forward() copies the other host-staged inputs)
            fb.input_ids = self.future_token_ids[fb.req_pool_indices]
        logits = self.forward(fb)
        if logits is None:
            return PendingSample(torch.empty(0, dtype=torch.int64), [])
        return self._sample(fb, logits, reqs, partial, self.forward_stream)

    def _sample(self, fb: ForwardBatch, logits: torch.Tensor, reqs: list, partial: frozenset[int],
                stream: torch.cuda.Stream | None) -> PendingSample:
        """Sample from `logits` (computed on `stream`); the ids also go to the future-token buffer."""
        # One logits row per request (prompt logprobs keep a row per prompt position).
        if self.greedy_ids is not None and logits.shape[0] == len(reqs) and all(map(plain_greedy, reqs)):
            n = logits.shape[0]
            ids, void = self.greedy_ids[:n], self.greedy_void[:n]
            grammar = grammar_bitmask([getattr(r, "grammar", None) for r in reqs], logits.device)
            if grammar is None:
                cpu_kernels.argmax_rows(logits, ids, void)
            else:
                cpu_kernels.masked_argmax_rows(logits, grammar[1], ids, void)
            self.future_token_ids[fb.req_pool_indices] = ids
            return PendingSample(void.tolist(), [None] * n)
        next_ids, bad, logprobs = sample_on_device(logits, reqs, partial)
        # Device to device: the next decode batch reads its inputs here, not from the host.
        self.future_token_ids[fb.req_pool_indices] = next_ids
        # A void row travels to the host as id -1 (SampleResult's convention): no second copy.
        next_ids = next_ids.masked_fill(bad, -1)
        if self.copy_stream is None:
            return PendingSample(next_ids, logprobs)
        # The ids go to pinned host memory on the copy stream; the scheduler waits on the event
        # only when it processes this batch. Until then the batch's tensors stay referenced, so
        # the caching allocator cannot hand their memory to a later batch while streams read it.
        self.copy_stream.wait_stream(stream)
        with torch.cuda.stream(self.copy_stream):
            host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
            host.copy_(next_ids, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return PendingSample(host, logprobs, event, keepalive=(fb, logits, next_ids))


class Verified:
    """A verify batch's result, already on the host (same `resolve()` as PendingSample)."""

    __slots__ = ("result",)

    def __init__(self, result: VerifyResult) -> None:
        self.result = result

    def resolve(self) -> VerifyResult:
        return self.result


class PendingSample:
    """Sampled ids on their way to the host (an event marks the end of the copy on CUDA)."""

    __slots__ = ("host_ids", "logprobs", "event", "keepalive")

    def __init__(self, host_ids: torch.Tensor | list[int], logprobs: list, event: torch.cuda.Event | None = None,
                 keepalive: tuple | None = None) -> None:
        self.host_ids, self.logprobs, self.event, self.keepalive = host_ids, logprobs, event, keepalive

    def resolve(self) -> SampleResult:
        if self.event is not None:
            self.event.synchronize()
        self.keepalive = None
        ids = self.host_ids if isinstance(self.host_ids, list) else self.host_ids.tolist()
        return SampleResult(next_token_ids=ids, logprobs=self.logprobs)
