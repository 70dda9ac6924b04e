"""msgspec schemas of everything that crosses an actor boundary (msgpack on the wire)."""

from __future__ import annotations

import zlib

import msgspec

from engine import PromptLogprob, SamplingParams, StreamDelta
from engine.cache_manager import KVEvent


class GenerateRequest(msgspec.Struct, frozen=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    prefill_engine: str = ""  # to a decode engine: the prefill engine actor (its name) the front end chose
    priority: int = 0  # vLLM's request priority (lower = more important): the `priority` eviction policy reads it
    lora_name: str | None = None  # the LoRA adapter it runs under (None: the base model)


class EngineInfo(msgspec.Struct, frozen=True):
    engine_id: int
    vocab_size: int
    max_context_len: int
    max_total_tokens: int
    device: str
    node_id: str
    pid: int
    num_parameters: int = 0  # the weights this engine holds (an attention-DP member: its share)
    weight_bytes: int = 0
    actor_name: str = ""  # the engine actor's Ray name (namespace "radixray"), if it has one
    disaggregation_mode: str = "null"  # its role: "prefill", "decode" or "null" (both)


class LoRAAdapters(msgspec.Struct, frozen=True, array_like=True):
    """An engine's LoRA adapters: those requests may name, those in host memory (least recently
    used first; the others are read from their folder when a request needs them), and how many
    host memory holds (max_loaded_loras; 0: LoRA is off there). `runtime`: those of them loaded
    at run time, as (name, folder, pinned, load id): what an engine that joins the fleet loads
    too, from whichever front end sees it join (the engines, not a front end, hold the fleet's
    list). `unloaded`: the load ids unloaded here, which no engine may keep or load again (an
    unload that missed an engine still joining, or a report read before the unload)."""

    names: list[str] = []
    resident: list[str] = []
    max_loaded: int = 0
    runtime: list[tuple[str, str, bool, str]] = []
    unloaded: list[str] = []


class LoRAUpdate(msgspec.Struct, frozen=True, array_like=True):
    """An engine's answer to loading or unloading a LoRA adapter: its adapters after it, or why
    nothing changed (`error`, with `unknown` when the adapter is not loaded there). `draining`:
    unloaded, but requests still running under it finish with it."""

    adapters: LoRAAdapters
    error: str | None = None
    unknown: bool = False
    draining: bool = False


def adapter_root(lora_name: str) -> int:
    """The token standing for LoRA adapter `lora_name` at the root of the routers' paths (negative:
    token ids never are)."""
    return -1 - zlib.crc32(lora_name.encode())


def adapter_path(tokens: list[int], lora_name: str | None) -> list[int]:
    """The routers' path of `tokens` under LoRA adapter `lora_name` (KV is shared only under one
    adapter): the tokens themselves for the base model, else behind the adapter's root token."""
    if lora_name is None:
        return tokens
    return [adapter_root(lora_name), *tokens]


class KVEventBatch(msgspec.Struct, frozen=True, array_like=True):
    """Events `first_seq`, `first_seq + 1`, ... of one engine actor instance (`incarnation`)."""

    incarnation: str
    first_seq: int
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, frozen=True, array_like=True):
    """Everything an engine's cache held after its event `seq`: its leaves' token paths, and
    the prompts of its requests then (queued and not done)."""

    incarnation: str
    seq: int
    paths: list[list[int]]
    queued: list[list[int]] = []
    host_paths: list[list[int]] = []  # the host tier's paths (engine/hicache), for the router's tier-weighted scores


class Evictions(msgspec.Struct, frozen=True, array_like=True):
    """A heartbeat's answer: the radix nodes one engine actor instance evicted after the
    caller's cursor, up to eviction `seq` (the caller's next cursor), each as its token path
    from the root to the node's first token (the engine holds nothing starting with it, and
    keeps the path before it). `lost`: some were dropped before the caller asked (it fell
    behind), so its view of the engine is wrong."""

    incarnation: str
    seq: int
    paths: list[list[int]]
    lost: bool = False


class KVPayloadMeta(msgspec.Struct, frozen=True, array_like=True):
    """A KV transfer's payload (engine.disaggregation.KVPayload) without its KV buffer, which
    travels beside it as raw bytes (actors/kv_transfer.py)."""

    start: int
    kv_shape: list[int]
    kv_dtype: str
    first_token: int | None
    first_logprob: tuple | None  # the sampler's logprob row of the first token
    generator_state: bytes | None
    prompt_logprobs: list[PromptLogprob | None] | None
    cached_tokens: int
    sent_at: float


_request_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(GenerateRequest)
_delta_decoder = msgspec.msgpack.Decoder(StreamDelta)
_batch_decoder = msgspec.msgpack.Decoder(list[StreamDelta])


def encode(obj: msgspec.Struct) -> bytes:
    return _request_encoder.encode(obj)


def decode_request(data: bytes) -> GenerateRequest:
    return _request_decoder.decode(data)


def decode_delta(data: bytes) -> StreamDelta:
    return _delta_decoder.decode(data)


_kv_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_kv_snapshot_decoder = msgspec.msgpack.Decoder(KVSnapshot)


def decode_kv_batch(data: bytes) -> KVEventBatch:
    return _kv_batch_decoder.decode(data)


def decode_kv_snapshot(data: bytes) -> KVSnapshot:
    return _kv_snapshot_decoder.decode(data)


_evictions_decoder = msgspec.msgpack.Decoder(Evictions)
_lora_adapters_decoder = msgspec.msgpack.Decoder(LoRAAdapters)
_lora_update_decoder = msgspec.msgpack.Decoder(LoRAUpdate)


def decode_lora_adapters(data: bytes) -> LoRAAdapters:
    return _lora_adapters_decoder.decode(data)


def decode_lora_update(data: bytes) -> LoRAUpdate:
    return _lora_update_decoder.decode(data)


def decode_evictions(data: bytes) -> Evictions:
    return _evictions_decoder.decode(data)


def decode_delta_batch(data: bytes) -> list[StreamDelta]:
    return _batch_decoder.decode(data)


def encode_batch(deltas: list[StreamDelta]) -> bytes:
    return _request_encoder.encode(deltas)
