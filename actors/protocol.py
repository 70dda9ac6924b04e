"""msgspec schemas of everything that crosses an actor boundary (msgpack on the wire)."""

from __future__ import annotations

import msgspec

from engine import SamplingParams, StreamDelta


class GenerateRequest(msgspec.Struct, frozen=True):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams


class EngineInfo(msgspec.Struct, frozen=True):
    engine_id: int
    vocab_size: int
    max_context_len: int
    max_total_tokens: int
    device: str
    node_id: str
    pid: int


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


def decode_delta_batch(data: bytes) -> list[StreamDelta]:
    return _batch_decoder.decode(data)


def encode_batch(deltas: list[StreamDelta]) -> bytes:
    return _request_encoder.encode(deltas)
