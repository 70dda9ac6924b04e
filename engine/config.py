"""Frozen configuration structs of the engine: what the user sets and what the checkpoint says."""

from __future__ import annotations

import json
import os
import sys
import warnings
from types import MappingProxyType
from typing import Any, ClassVar, Literal, get_args

import msgspec

from engine.errors import ConfigError
from engine.grammar import grammar_backend_class
from engine.hicache.config import DEFAULTS as HICACHE
from engine.hicache.config import HiCacheConfig, PrefetchPolicy, WritePolicy
from engine.limits import RequestLimits
from engine.lora.config import LoRAConfig, LoRAPath
from engine.model_path import resolve_model_path

LORA = LoRAConfig()  # the LoRA fields' defaults

SchedulePolicy = Literal["fcfs", "lpm"]
SpeculativeAlgorithm = Literal["ngram", "draft_model"]
AttentionBackendName = Literal["torch", "triton", "flash_attn"]
LinearBackend = Literal["auto", "native", "onednn", "torch"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Quantization = Literal["auto", "none", "int8", "int4"]
MoeSplit = Literal["experts", "intermediate"]
MoeDispatch = Literal["gather", "all_to_all"]
CpuGraphMode = Literal["auto", "on", "off"]
DisaggregationMode = Literal["null", "prefill", "decode"]
# How KV moves between engine actors (actors/kv_transfer.py implements them; an in-process pair
# passes it by reference whatever this says).
DisaggregationTransferBackend = Literal["object_store", "p2p"]
# Denoising algorithms of block-diffusion models (engine/dllm/algorithm.py registers them).
DllmAlgorithmName = Literal["low_confidence"]
SCHEDULE_POLICIES = get_args(SchedulePolicy)
ATTENTION_BACKENDS = get_args(AttentionBackendName)
LINEAR_BACKENDS = get_args(LinearBackend)
DTYPES = get_args(DType)
QUANTIZATIONS = get_args(Quantization)
SPECULATIVE_ALGORITHMS = get_args(SpeculativeAlgorithm)
DEFAULT_MAX_PREFILL_TOKENS = 16384
MOE_SPLITS = get_args(MoeSplit)
MOE_DISPATCHES = get_args(MoeDispatch)
CPU_GRAPH_MODES = get_args(CpuGraphMode)
DISAGGREGATION_MODES = get_args(DisaggregationMode)
DISAGGREGATION_TRANSFER_BACKENDS = get_args(DisaggregationTransferBackend)
DLLM_ALGORITHM_NAMES = get_args(DllmAlgorithmName)


# Callers inside these packages (and argparse, for a flag) are skipped when a deprecation warning
# names its line: the line to change is the user's.
_OWN_MODULES = ("engine", "cluster", "actors", "deploy", "openai_api", "argparse")


def warn_renamed(old: str, new: str) -> None:
    """The one deprecation warning of a renamed config field, YAML key or CLI flag."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in _OWN_MODULES:
        level, frame = level + 1, frame.f_back
    warnings.warn(f"{old} is deprecated: use {new}", DeprecationWarning, stacklevel=level)


def rename_fields(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with each old field name of `cls` (its `renamed_fields`: old -> new) replaced by the
    new one, warning once per old name given."""
    renamed = getattr(cls, "renamed_fields", {})
    old = [k for k in kwargs if k in renamed]
    if not old:
        return kwargs
    kwargs = dict(kwargs)
    for name in old:
        new = renamed[name]
        if new in kwargs:
            raise ConfigError(f"{name} and {new} are the same {cls.__name__} field: give only {new}")
        warn_renamed(name, new)
        kwargs[new] = kwargs.pop(name)
    return kwargs


class RenamingMeta(msgspec.StructMeta):
    """A config struct whose old field names (`renamed_fields`) still work as keywords and as
    read-only attributes, each with a DeprecationWarning."""

    def __new__(mcls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> RenamingMeta:
        cls = super().__new__(mcls, name, bases, namespace, **kwargs)
        for old, new in namespace.get("renamed_fields", {}).items():
            setattr(cls, old, _old_name(old, new))
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **cls.rename_kwargs(kwargs))

    def rename_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        return rename_fields(cls, kwargs)


def _old_name(old: str, new: str) -> property:
    def get(self: Any) -> Any:
        warn_renamed(old, new)
        return getattr(self, new)

    return property(get, doc=f"deprecated: {new}")


def build_config(cls: type, what: str, kwargs: dict[str, Any], strict: bool = True) -> Any:
    """A frozen config struct from keyword arguments; unknown or ill-typed fields raise a
    ConfigError that names them (and, for a choice, its choices). strict=False also takes
    strings for numbers and booleans ("2", "true"), as `serve run ... key=value` passes them.
    A renamed field's old name is taken, with a DeprecationWarning."""
    if isinstance(cls, RenamingMeta):
        kwargs = cls.rename_kwargs(kwargs)
    unknown = sorted(set(kwargs) - set(cls.__struct_fields__))
    if unknown:
        raise ConfigError(f"unknown {what} config field(s): {', '.join(unknown)}")
    try:
        return msgspec.convert(kwargs, cls, strict=strict)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid {what} config: {e}{_choices_hint(cls, str(e))}") from None


def _choices_hint(cls: type, error: str) -> str:
    if "at `$." not in error:
        return ""
    name = error.split("at `$.", 1)[1].split("`", 1)[0]
    for f in msgspec.inspect.type_info(cls).fields:
        t = f.type
        if isinstance(t, msgspec.inspect.UnionType):
            t = next((m for m in t.types if isinstance(m, msgspec.inspect.LiteralType)), t)
        if f.name == name and isinstance(t, msgspec.inspect.LiteralType):
            return f" (one of {', '.join(map(str, t.values))})"
    return ""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, metaclass=RenamingMeta):
    """Everything one engine is built from. Field names double as CLI flags and YAML keys.

    Naming rule: a setting SGLang has takes SGLang's flag name; any other on/off switch is
    `enable_X` when it is off by default and `disable_X` when it is on by default, and a field
    that sizes something is named for the thing it sizes (`cpu_graph_max_bs`, not a second use of
    `cuda_graph_max_bs`). Names users rely on stay (`max_context_len`, SGLang's `context_length`);
    the old names in `renamed_fields` still work (keyword, YAML key, CLI flag, attribute) with a
    DeprecationWarning (docs/architecture.md, Configuration)."""

    # Old name -> new name (the naming rule above).
    renamed_fields: ClassVar[MappingProxyType] = MappingProxyType({
        "enable_overlap": "enable_overlap_schedule",  # SGLang's name (before overlap was its default)
        "cpu_graph_lazy": "enable_lazy_cpu_graph",  # an off-by-default switch
        "seed": "random_seed",  # SGLang's name; `seed` is also each request's own
        "speculative_ngram_min": "speculative_ngram_min_match_window_size",  # SGLang's names
        "speculative_ngram_max": "speculative_ngram_max_match_window_size",
    })

    model_path: str | None = None  # HF checkpoint folder, a GGUF file (or a folder holding one), or a model name (builtin, builtin-moe, smollm2-135m-instruct); None: builtin
    device: str = "auto"  # torch device: "cpu", "cuda", "cuda:N", or "auto" (CUDA when available)
    dtype: DType = "auto"  # weights, activations and KV pool; auto: the checkpoint's dtype on CUDA, float32 on the CPU
    # Weights: auto (the checkpoint's format: GGUF block types computed as quantized), none
    # (dequantized into dtype at load), int8 (Q8_0's scheme) or int4 (Q4_1's): the linear
    # projections of a float checkpoint quantized at load.
    quantization: Quantization = "auto"
    max_total_tokens: int | None = None  # KV slots; None: from mem_fraction_static on CUDA, 65536 on CPU
    mem_fraction_static: float = 0.8  # CUDA: the fraction of device memory for weights plus the KV pool
    max_running_requests: int | None = None  # the most requests in the running batch; None: bounded by the KV pool only
    max_context_len: int | None = None  # defaults to the model's max_position_embeddings
    chunked_prefill_size: int | None = None  # None: no chunking beyond max_prefill_tokens
    max_prefill_tokens: int | None = None  # None: DEFAULT_MAX_PREFILL_TOKENS
    schedule_policy: SchedulePolicy = "fcfs"  # waiting-queue order: fcfs, or lpm (longest cached prefix first)
    disable_radix_cache: bool = False  # no prefix cache: every request computes its whole prompt
    enable_mixed_chunk: bool = False  # run prefill chunks and the running decodes in one MIXED batch
    enable_overlap_schedule: bool = False  # schedule the next decode batch while the current one runs (a forward thread)
    # Split prefill (ForwardMode.SPLIT_PREFILL, the prefill half of SGLang's PD multiplexing): a
    # prefill batch admitted while requests decode runs a range of layers per step, beside every
    # decode step, so a long prompt no longer stalls the running streams for its whole prefill.
    enable_split_prefill: bool = False
    # Prompt tokens x layers a split prefill runs per step (SGLang's name): layers per step =
    # max(1, this // the batch's prompt tokens). About one 512-token chunk of an 8-layer model;
    # SGLang's 65536 suits a GPU, whose step computes far more per second.
    split_forward_token_budget: int = 4096
    # Tensor parallelism (SGLang's name): the engine's model split over this many ranks (column- and
    # row-parallel projections, a vocabulary-parallel embedding and LM head), rank 0 scheduling.
    tp_size: int = 1
    attention_backend: AttentionBackendName = "torch"  # attention kernels: torch (SDPA, C++ decode on the CPU), triton, flash_attn
    # CPU linears: "native" (the project's GEMM: float32 on AVX-512; bfloat16 on AVX512-BF16 for
    # 1-3 rows, beside oneDNN's weight for more), "onednn" (prepacked oneDNN), "torch" (F.linear);
    # auto: native where it works, else oneDNN, else torch.
    linear_backend: LinearBackend = "auto"
    disable_cuda_graph: bool = False  # decode/IDLE graphs on CUDA (with a graph-safe backend)
    # Decode graphs on the CPU: the decode forward compiled with torch.compile once per batch-size
    # bucket (the graph ladder up to cpu_graph_max_bs), at start-up (engine/cpu_graph.py). auto:
    # on for bfloat16 weights only, where the bench measured them faster; float32 decodes as fast
    # eagerly and would pay the compiles at every engine start. Under "auto", RADIXRAY_CPU_GRAPHS=0 or 1 in the
    # environment decides for the whole process.
    cpu_graph: CpuGraphMode = "auto"
    enable_lazy_cpu_graph: bool = False  # compile a CPU-graph bucket the first time it runs instead (faster start)
    cuda_graph_max_bs: int = 64  # the largest batch of the CUDA-graph ladder
    cpu_graph_max_bs: int | None = None  # the largest batch of the CPU-graph ladder; None: cuda_graph_max_bs
    init_new_token_ratio: float = 0.7  # admission reserve: the share of running requests' remaining output kept free, at start
    min_new_token_ratio: float = 0.1  # the floor the reserve ratio decays to
    new_token_ratio_decay: float = 0.001  # how much the reserve ratio decays per decode step (it jumps to 1 on retraction)
    random_seed: int = 0  # seed of the engine's random state (each sampling request also has its own seed)
    torch_threads: int | None = None  # torch intra-op threads; None: torch's default (the cores Ray gives the actor)
    # The request limits this engine checks (stop lists, prompt characters): engine/limits.py.
    # The cluster sets it (ClusterConfig.limits).
    limits: RequestLimits = RequestLimits()
    # Attention-DP with an MoE model: each member holds E/G whole experts (expert parallelism) or
    # a 1/G slice of every expert's intermediate dim. The cluster sets it (ClusterConfig.moe_split).
    moe_split: MoeSplit = "experts"
    # How expert parallelism moves tokens: "gather" every member's rows to every member and
    # reduce the partial outputs back, or "all_to_all": each (token, expert) row to the member
    # holding the expert and its output back (fewer bytes as the group grows; one more collective).
    moe_dispatch: MoeDispatch = "gather"
    # Speculative decoding: "ngram" drafts from the request's own tokens (prompt lookup),
    # "draft_model" from a small model with the same tokenizer (speculative_draft_model_path).
    speculative_algorithm: SpeculativeAlgorithm | None = None
    speculative_draft_model_path: str | None = None  # the draft model's checkpoint folder (speculative_algorithm=draft_model)
    speculative_num_draft_tokens: int = 4  # k: drafts verified per request per step
    speculative_ngram_min_match_window_size: int = 2  # the shortest suffix n-gram looked up
    speculative_ngram_max_match_window_size: int = 4  # the longest (tried first)
    # Structured outputs (engine/grammar): the backend that compiles JSON schemas, regexes and
    # EBNF grammars: "llguidance", or "xgrammar" when that package is installed.
    grammar_backend: str = "llguidance"
    # Whitespace that JSON constraints (response_format, tool calls) allow between tokens, as a
    # regex (e.g. "[ \t\n]{0,8}"); None: compact JSON, one space after each ',' and ':' and none
    # elsewhere, so a model that favours whitespace cannot spend max_tokens on it. llguidance only.
    constrained_json_whitespace_pattern: str | None = None
    # Prefill/decode disaggregation (SGLang's flag): "prefill" computes prompts and sends their KV to a
    # decode engine; "decode" gets each request's KV from a prefill engine and decodes; "null" does both.
    disaggregation_mode: DisaggregationMode = "null"
    disaggregation_transfer_timeout_s: float = 60.0  # a KV transfer not done by then fails (and is retried elsewhere)
    # How KV moves between engine actors (SGLang's flag; its values are this project's): "object_store",
    # the prefill call's result through Ray's object store (one contiguous buffer per transfer); "p2p",
    # a point-to-point gloo link between the two engines (host-staged on CUDA).
    disaggregation_transfer_backend: DisaggregationTransferBackend = "object_store"
    # Block-diffusion models (SGLang's names; engine/dllm): how each DLLM_EXTEND forward unmasks a
    # block. "low_confidence": every masked position whose top probability exceeds dllm_threshold,
    # or else the single most confident one.
    dllm_algorithm: DllmAlgorithmName = "low_confidence"
    dllm_threshold: float = 0.95  # low_confidence's threshold in [0, 1]: 0 unmasks a whole block per forward, 1 one position
    # Hierarchical KV cache (SGLang's HiCache, engine/hicache): keep KV evicted from the device pool
    # in a host-memory tier (and, with a storage backend, below it) instead of dropping it; a match
    # ending there is loaded back before the prefill. (Defaults and checks: HiCacheConfig.)
    enable_hierarchical_cache: bool = HICACHE.enable_hierarchical_cache
    hicache_ratio: float = HICACHE.hicache_ratio  # host tier capacity as a multiple of the device KV pool's tokens, > 1 (unless hicache_size is set)
    hicache_size: float = HICACHE.hicache_size  # host tier capacity in GB (1e9 bytes) of KV; 0: use hicache_ratio
    # When device KV is copied to the host tier: write_through (when cached), write_back (when
    # evicted from the device), write_through_selective (once two admissions used it).
    hicache_write_policy: WritePolicy = HICACHE.hicache_write_policy
    # Storage tier below the host tier, shared by every engine that reaches it: "file" (a directory,
    # hicache_storage_path) or "ray" (a named store actor); None: no storage tier.
    hicache_storage_backend: str | None = HICACHE.hicache_storage_backend
    # The file backend's directory (a shared file system for a fleet); the ray backend's store name.
    hicache_storage_path: str | None = HICACHE.hicache_storage_path
    hicache_storage_page_size: int = HICACHE.hicache_storage_page_size  # tokens per storage page; a prefix's last partial page is not stored
    # How a match waits for storage pages: wait_complete (load them first), timeout (wait up to
    # hicache_storage_prefetch_timeout_s, use what arrived), best_effort (use what is prefetched).
    hicache_storage_prefetch_policy: PrefetchPolicy = HICACHE.hicache_storage_prefetch_policy
    hicache_storage_prefetch_timeout_s: float = HICACHE.hicache_storage_prefetch_timeout_s  # the timeout policy's wait per match, in seconds
    # Which unlocked radix nodes are evicted first, in every tier: cost_aware (the default: recompute
    # cost per slot x reuse / idle time), lru, lfu, slru, priority (the requests' priority: a higher
    # value goes first).
    radix_eviction_policy: str = HICACHE.radix_eviction_policy
    # LoRA adapters (engine/lora; checks: LoRAConfig). Adapters loaded at start: name -> PEFT folder,
    # or {"lora_path": folder, "pinned": true} (never evicted); on the command line name=folder pairs
    # (separated by spaces or commas) or a JSON object.
    lora_paths: dict[str, str | LoRAPath] = {}
    enable_lora: bool = False  # serve LoRA adapters, loaded at run time too (on whenever lora_paths is given)
    max_loras_per_batch: int = LORA.max_loras_per_batch  # the most distinct adapters in one batch (device slots; base-model requests take none)
    # adapters held in host memory (past it the least recently used idle unpinned one is dropped,
    # read again when needed); None: max(len(lora_paths), max_loras_per_batch)
    max_loaded_loras: int | None = None
    max_lora_rank: int | None = None  # the largest adapter rank the slots hold; None: the largest in lora_paths (16 without any)
    # projections given adapter slots, separated by commas or spaces (q_proj k_proj v_proj o_proj
    # gate_proj up_proj down_proj, or all); None: the union of lora_paths' targets (all without any)
    lora_target_modules: str | None = None

    @property
    def lora_enabled(self) -> bool:
        """Whether the engine serves LoRA adapters (enable_lora or any lora_paths)."""
        return self.enable_lora or bool(self.lora_paths)

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(self.schedule_policy in SCHEDULE_POLICIES,
             f"schedule_policy must be one of {SCHEDULE_POLICIES}, got {self.schedule_policy!r}")
        need(self.attention_backend in ATTENTION_BACKENDS,
             f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        need(self.linear_backend in LINEAR_BACKENDS,
             f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        need(self.moe_split in MOE_SPLITS, f"moe_split must be one of {MOE_SPLITS}, got {self.moe_split!r}")
        need(self.moe_dispatch in MOE_DISPATCHES,
             f"moe_dispatch must be one of {MOE_DISPATCHES}, got {self.moe_dispatch!r}")
        need(self.disaggregation_mode in DISAGGREGATION_MODES,
             f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}")
        need(self.tp_size == 1 or self.disaggregation_mode == "null",
             "disaggregation_mode is not supported with tp_size > 1 (the KV transfer moves rank 0's heads only)")
        need(self.disaggregation_transfer_timeout_s > 0, "disaggregation_transfer_timeout_s must be > 0")
        need(self.disaggregation_transfer_backend in DISAGGREGATION_TRANSFER_BACKENDS,
             f"disaggregation_transfer_backend must be one of {DISAGGREGATION_TRANSFER_BACKENDS}, "
             f"got {self.disaggregation_transfer_backend!r}")
        need(self.cpu_graph in CPU_GRAPH_MODES, f"cpu_graph must be one of {CPU_GRAPH_MODES}, got {self.cpu_graph!r}")
        need(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"),
             f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("max_total_tokens", "max_running_requests", "chunked_prefill_size",
                     "max_prefill_tokens", "max_context_len", "torch_threads", "cpu_graph_max_bs",
                     "split_forward_token_budget", "tp_size"):
            v = getattr(self, name)
            need(v is None or v >= 1, f"{name} must be >= 1, got {v}")
        need(0.0 < self.mem_fraction_static < 1.0, "mem_fraction_static must be in (0, 1)")
        need(0.0 < self.min_new_token_ratio <= self.init_new_token_ratio <= 1.0,
             "need 0 < min_new_token_ratio <= init_new_token_ratio <= 1")
        need(self.speculative_algorithm in (None, *SPECULATIVE_ALGORITHMS),
             f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS} or None")
        need((self.speculative_algorithm == "draft_model") == bool(self.speculative_draft_model_path),
             "speculative_draft_model_path goes with speculative_algorithm='draft_model' (and it needs one)")
        need(1 <= self.speculative_num_draft_tokens <= 64, "speculative_num_draft_tokens must be in [1, 64]")
        need(1 <= self.speculative_ngram_min_match_window_size <= self.speculative_ngram_max_match_window_size,
             "need 1 <= speculative_ngram_min_match_window_size <= speculative_ngram_max_match_window_size")
        need(self.dllm_algorithm in DLLM_ALGORITHM_NAMES,
             f"dllm_algorithm must be one of {DLLM_ALGORITHM_NAMES}, got {self.dllm_algorithm!r}")
        need(0.0 <= self.dllm_threshold <= 1.0, f"dllm_threshold must be in [0, 1], got {self.dllm_threshold}")
        hicache = HiCacheConfig.from_engine_config(self)  # ConfigError
        if hicache.enable_hierarchical_cache:
            need(not self.disable_radix_cache, "enable_hierarchical_cache needs the radix cache (disable_radix_cache)")
            # Under TP every rank's host tier mirrors rank 0's copies; storage pages would hold
            # rank 0's share of the KV heads only.
            need(self.tp_size == 1 or hicache.hicache_storage_backend is None,
                 "hicache_storage_backend is not supported with tp_size > 1 (the host tier is)")
        grammar_backend_class(self.grammar_backend, self.constrained_json_whitespace_pattern)  # ConfigError
        LoRAConfig.from_engine_config(self)  # ConfigError
        if self.lora_enabled:
            need(self.disaggregation_mode == "null",
                 "LoRA adapters (lora_paths, enable_lora) are not supported with disaggregation_mode yet")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        return build_config(cls, "engine", kwargs)

    def replace(self, **changes: Any) -> EngineConfig:
        return EngineConfig.from_kwargs(**{**msgspec.structs.asdict(self), **EngineConfig.rename_kwargs(changes)})


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The parts of an HF `config.json` the registered models (engine/models) need."""

    architecture: str  # architectures[0]: the engine.models registry key
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections carry a bias
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k
    hidden_act: str
    torch_dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Mixture of experts (0 experts: a dense model). A layer i is sparse unless i is in
    # mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step (`is_sparse_layer`).
    num_experts: int = 0  # HF num_experts (Qwen-MoE, OLMoE) or num_local_experts (Mixtral)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's; Mixtral's is intermediate_size
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert; 0: none
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip, clip]
    # Block diffusion (SDAR): positions per block (0: an autoregressive model) and the id of a
    # position still to be denoised, config.json's `block_size` and `mask_token_id`.
    dllm_block_size: int = 0
    dllm_mask_token_id: int | None = None

    @property
    def is_dllm(self) -> bool:
        """A block-diffusion model: its output is denoised block by block (DLLM_EXTEND)."""
        return self.dllm_block_size > 0

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` has an MoE MLP (transformers' rule; all layers of Mixtral, OLMoE)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_dir(cls, model_dir: str) -> ModelConfig:
        """From an HF folder, or a built-in model's name (`engine.model_path.resolve_model_path`)."""
        model_dir = resolve_model_path(model_dir)
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"no config.json in model folder {model_dir!r}")
        with open(path) as f:
            hf = json.load(f)
        return cls.from_hf(hf, _read_generation_eos(model_dir))

    @classmethod
    def from_hf(cls, hf: dict, generation_eos: tuple[int, ...] = ()) -> ModelConfig:
        # The architecture is checked against the model registry where a model is built
        # (`engine.models.model_class`): the models import this module, not the other way round.
        arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
        model_type = hf.get("model_type", "llama")
        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) not in ("default", "linear", "llama3"):
            raise ConfigError(f"rope scaling {rope_scaling!r} is not supported")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=bool(hf.get("attention_bias",
                                       hf.get("qkv_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            hidden_act=act,
            torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(dict.fromkeys(eos_ids + generation_eos)),
            num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            moe_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
            norm_topk_prob=model_type == "mixtral" or bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
            clip_qkv=hf.get("clip_qkv"),
            **_dllm_fields(hf),
        )


def _dllm_fields(hf: dict) -> dict[str, Any]:
    """A block-diffusion model's block size and mask token, when config.json gives both as
    integers (a model that needs them and lacks one is refused where it is built: engine/models/sdar.py)."""
    block, mask = hf.get("block_size"), hf.get("mask_token_id")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (block, mask)):
        return {}
    if block < 1 or mask < 0:
        raise ConfigError(f"block_size must be >= 1 and mask_token_id >= 0, got {block} and {mask}")
    return {"dllm_block_size": block, "dllm_mask_token_id": mask}


def _read_generation_eos(model_dir: str) -> tuple[int, ...]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return ()
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
