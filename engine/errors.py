"""Typed errors. Each input error is a ValueError, so callers that only know Python still catch it."""

from typing import Literal

import msgspec

# Why a request ended without finishing normally (StreamDelta.error_kind); the HTTP layer maps
# each to a status (deploy/app.py ERROR_STATUS).
ErrorKind = Literal["invalid_request", "aborted", "timeout", "overloaded", "engine_error", "draining",
                    "kv_transfer_failed"]


class RadixRayError(Exception):
    """Base of every error radixray raises on purpose."""


class ConfigError(RadixRayError, ValueError):
    """An engine or cluster configuration value is invalid or unknown."""


class InvalidRequestError(RadixRayError, ValueError):
    """A request is malformed; it was rejected before anything was queued.

    `param` names the offending field where one is to blame (OpenAI's error body has it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class MemoryInvariantError(RadixRayError, AssertionError):
    """The KV pool's accounting is broken: a bug, never a user error."""


class EngineDeadError(RadixRayError, RuntimeError):
    """The engine stopped; pending requests end with this error."""


def invalid_request_from(err: msgspec.ValidationError, prefix: str = "") -> InvalidRequestError:
    """The InvalidRequestError behind a msgspec ValidationError: the one a struct's
    __post_init__ raised, or one naming the top-level field of msgspec's `$.field` path."""
    if isinstance(err.__cause__, InvalidRequestError):
        return err.__cause__
    text = str(err)  # e.g. "Expected `float`, got `str` - at `$.temperature`"
    param = None
    if "at `$." in text:
        param = text.split("at `$.", 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]
    return InvalidRequestError(f"{prefix}{text}", param)
