"""Every environment variable raypaged reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models are cached: ``$RAYPAGED_CACHE_DIR`` or ``~/.cache/raypaged``."""
    return Path(os.environ.get("RAYPAGED_CACHE_DIR") or Path.home() / ".cache" / "raypaged")


def log_level() -> str:
    """Default log level of the ``raypaged`` logger: ``$RAYPAGED_LOG_LEVEL`` or ``info``."""
    return os.environ.get("RAYPAGED_LOG_LEVEL", "info")
