"""Prefill/decode disaggregation: a prefill engine computes a prompt and sends its KV; a decode
engine receives it into slots it pre-allocated and decodes from a PREBUILT batch."""

from engine.disaggregation.prefill import submit_prefill
from engine.disaggregation.transfer import (
    KVFetch,
    KVPayload,
    KVPoll,
    KVReceiver,
    KVSender,
    KVSource,
    LocalKVChannel,
)

__all__ = ["KVFetch", "KVPayload", "KVPoll", "KVReceiver", "KVSender", "KVSource", "LocalKVChannel", "submit_prefill"]
