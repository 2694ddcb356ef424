"""``system_fingerprint`` (vLLM's ``--fingerprint-mode`` and ``--fingerprint-value``): what answers carry to
name the serving setup, so a client can tell when it changed.

- ``full`` (the default): ``raypaged-<version>[-tp<N>]-<hash8>``, the hash of the answering engine's settings
  (``EngineConfig.config_hash``, from its ``Info``);
- ``hash``: ``raypaged-<version>-<hash8>``;
- ``custom``: ``--fingerprint-value`` as it is;
- ``none``: ``null``.

Each model's is computed once and kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from raypaged import __version__

if TYPE_CHECKING:
    from raypaged.serving.gateway.engines import EngineRoutes

FINGERPRINT_MODES = ("full", "hash", "custom", "none")


def check_fingerprint(mode: str, value: str | None) -> None:
    """The flags' combination, or a ``ValueError`` naming them."""
    if mode not in FINGERPRINT_MODES:
        raise ValueError(f"--fingerprint-mode must be one of {', '.join(FINGERPRINT_MODES)}, got {mode!r}")
    if mode == "custom" and not value:
        raise ValueError("--fingerprint-mode custom needs --fingerprint-value")
    if mode != "custom" and value is not None:
        raise ValueError(f"--fingerprint-value is the fingerprint of --fingerprint-mode custom, not of {mode!r}")


class Fingerprints:
    """The ``system_fingerprint`` of each model's answers."""

    def __init__(self, routes: EngineRoutes, mode: str = "full", value: str | None = None) -> None:
        check_fingerprint(mode, value)
        self._routes = routes
        self._mode = mode
        self._value = value
        self._known: dict[str, str] = {}

    async def of(self, model: str) -> str | None:
        if self._mode == "none":
            return None
        if self._mode == "custom":
            return self._value
        if (known := self._known.get(model)) is not None:
            return known
        info = await self._routes.model_info(model)
        if info is None:  # unreachable now: not kept, asked again next time
            return f"raypaged-{__version__}-nohash"
        parts = [f"raypaged-{__version__}"]
        if self._mode == "full" and info.tensor_parallel_size > 1:
            parts.append(f"tp{info.tensor_parallel_size}")
        parts.append(info.config_hash or "nohash")
        self._known[model] = fingerprint = "-".join(parts)
        return fingerprint
