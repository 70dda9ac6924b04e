"""Where radixray's log lines go in a process that Ray starts (an engine actor, a Serve replica)."""

from __future__ import annotations

import logging
import sys


def log_to_stderr(level: int = logging.INFO) -> None:
    """Send the "radixray" loggers to stderr, which Ray forwards to the driver's console
    (`python -m cluster serve` runs with log_to_driver). Idempotent."""
    logger = logging.getLogger("radixray")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)
        logger.propagate = False
