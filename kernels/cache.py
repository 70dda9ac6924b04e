"""Where radixray keeps what it builds once per machine (compiled kernels, the built-in models)."""

from __future__ import annotations

import os


def cache_dir() -> str:
    """$RADIXRAY_CACHE_DIR, else $XDG_CACHE_HOME/radixray, else ~/.cache/radixray."""
    return os.environ.get("RADIXRAY_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "radixray")
