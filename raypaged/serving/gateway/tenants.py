"""API keys and per-tenant admission: concurrency limits, bounded queues, priorities.

A tenants file (``--tenants tenants.yaml``)::

    tenants:
      - name: team-a
        api_keys: [sk-team-a]
        max_concurrent_requests: 8    # in the engine at once; omitted = no limit
        max_queued_requests: 32       # waiting at the gateway beyond that; more are refused with 429
        priority: 0                   # added to each request's priority; lower runs first

A tenant over its concurrency limit waits in its own queue at the gateway, so it
cannot fill the engine's batch and starve the others.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import yaml

from raypaged.serving.gateway.errors import APIError

_KEYS = {"name", "api_keys", "max_concurrent_requests", "max_queued_requests", "priority"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    api_keys: tuple[str, ...] = ()
    max_concurrent_requests: int | None = None
    max_queued_requests: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"tenant {self.name}: max_concurrent_requests must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError(f"tenant {self.name}: max_queued_requests must be at least 0")


class TenantGate:
    """Admission for one tenant: ``admit()`` waits for a slot or raises 429; ``release()`` frees it."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        limit = tenant.max_concurrent_requests
        self._slots = None if limit is None else asyncio.Semaphore(limit)
        self.num_queued = 0

    async def admit(self) -> None:
        if self._slots is None:
            return
        if self._slots.locked():
            if self.num_queued >= self.tenant.max_queued_requests:
                raise APIError(
                    429,
                    f"tenant {self.tenant.name} has {self.tenant.max_concurrent_requests} requests running and "
                    f"{self.num_queued} queued, its limits; retry later",
                )
            self.num_queued += 1
            try:
                await self._slots.acquire()
            finally:
                self.num_queued -= 1
        else:
            await self._slots.acquire()

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()


class Tenants:
    """Who may call, and each caller's gate. Without keys anyone may call, as tenant ``default``."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self._by_key: dict[str, TenantGate] = {}
        for tenant in tenants:
            gate = TenantGate(tenant)
            for key in tenant.api_keys:
                if key in self._by_key:
                    raise ValueError(f"api key of tenant {tenant.name} is also given to {self._by_key[key].tenant.name}")
                self._by_key[key] = gate
        self._open = None if self._by_key else TenantGate(Tenant("default"))

    @classmethod
    def from_args(cls, api_key: str | None, tenants_file: str | None) -> Tenants:
        tenants = load_tenants(Path(tenants_file)) if tenants_file else []
        if api_key:
            tenants.append(Tenant("default", api_keys=(api_key,)))
        return cls(tenants)

    def authenticate(self, authorization: str | None) -> TenantGate:
        """The caller's gate for an ``Authorization: Bearer KEY`` header; 401 when keys are required."""
        if self._open is not None:
            return self._open
        scheme, _, key = (authorization or "").partition(" ")
        gate = self._by_key.get(key.strip()) if scheme.lower() == "bearer" else None
        if gate is None:
            message = "Missing API key" if not authorization else "Incorrect API key provided"
            raise APIError(401, f"{message}; send it as 'Authorization: Bearer KEY'")
        return gate


def load_tenants(path: Path) -> list[Tenant]:
    """Tenants from a YAML file; a malformed file raises ``ValueError`` saying what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"cannot read tenants file {path}: {exc}") from None
    entries = data.get("tenants") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"tenants file {path} needs a non-empty 'tenants' list")
    tenants = []
    for entry in entries:
        if not isinstance(entry, dict) or "name" not in entry:
            raise ValueError(f"tenants file {path}: every tenant needs a name, got {entry!r}")
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"tenant {entry['name']}: unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
        keys = entry.get("api_keys") or []
        if isinstance(keys, str) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"tenant {entry['name']}: api_keys must be a list of non-empty strings")
        tenants.append(Tenant(
            name=str(entry["name"]),
            api_keys=tuple(keys),
            max_concurrent_requests=entry.get("max_concurrent_requests"),
            max_queued_requests=int(entry.get("max_queued_requests", 0)),
            priority=int(entry.get("priority", 0)),
        ))
    return tenants
