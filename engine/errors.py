"""Typed errors. Each input error is a ValueError, so callers that only know Python still catch it."""


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
