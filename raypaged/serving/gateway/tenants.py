"""API keys and per-tenant admission: concurrency limits, bounded queues, priorities.

A tenants file (``--tenants tenants.yaml``)::

    tenants:
      - name: team-a
        api_keys: [sk-team-a]
        max_concurrent_requests: 8    # prompts in the engine at once; omitted = no limit
        max_queued_requests: 32       # requests waiting beyond that; more are refused with 429
        priority: 0                   # added to each request's priority; lower runs first
        min_request_priority: 0       # the range a request's own priority must lie in
        max_request_priority: 1000000

A tenant over its concurrency limit waits in its own queue, so it cannot fill the
engine's batch and starve the others. The gateway and the gRPC engine server each
hold their own gates: a direct gRPC client is held to the same limits.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import yaml

from raypaged.inputs.limits import InputError
from raypaged.serving.gateway.errors import APIError

_KEYS = {
    "name",
    "api_keys",
    "max_concurrent_requests",
    "max_queued_requests",
    "priority",
    "min_request_priority",
    "max_request_priority",
}
DEFAULT_MAX_REQUEST_PRIORITY = 1_000_000
ANY_PRIORITY = (-(2**31), 2**31 - 1)  # vLLM's: any priority the int32 field holds (an open server, --api-key)


class AuthError(Exception):
    """No valid API key where keys are required; the message says what to send."""


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant. A request's ``priority`` must lie in ``[min_request_priority, max_request_priority]``;
    the engine gets ``priority + request priority`` (by default a request may only lower its own)."""

    name: str
    api_keys: tuple[str, ...] = ()
    max_concurrent_requests: int | None = None
    max_queued_requests: int = 0
    priority: int = 0
    min_request_priority: int = 0
    max_request_priority: int = DEFAULT_MAX_REQUEST_PRIORITY

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"tenant name {self.name!r} must be non-empty and without '/'")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"tenant {self.name}: max_concurrent_requests must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError(f"tenant {self.name}: max_queued_requests must be at least 0")
        if self.min_request_priority > self.max_request_priority:
            raise ValueError(f"tenant {self.name}: min_request_priority must not exceed max_request_priority")

    def engine_priority(self, priority: int) -> int:
        """The engine's priority of a request asking for ``priority``; outside the tenant's range is refused."""
        if not self.min_request_priority <= priority <= self.max_request_priority:
            raise InputError(
                "priority",
                f"priority {priority} is outside [{self.min_request_priority}, {self.max_request_priority}], the "
                f"range of tenant {self.name}: a request may only lower its priority (min_request_priority and "
                f"max_request_priority of a tenant in --tenants set the range)",
            )
        return self.priority + priority


def vllm_tenant(api_key: str | None = None) -> Tenant:
    """The one tenant of a server without a tenants file (open, or behind ``--api-key``), as vLLM serves: no
    limits, and a request may ask for any priority (lower runs first)."""
    low, high = ANY_PRIORITY
    return Tenant(
        "default", api_keys=(api_key,) if api_key else (), min_request_priority=low, max_request_priority=high
    )


class TenantGate:
    """Admission for one tenant: ``admit(k)`` waits for k slots (one per prompt) or raises 429;
    ``release(k)`` frees them. Waiters are served in arrival order."""

    def __init__(self, tenant: Tenant) -> None:
        self.tenant = tenant
        self._num_free = tenant.max_concurrent_requests  # None: no limit
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def num_queued(self) -> int:
        return len(self._waiters)

    async def admit(self, num_slots: int = 1) -> None:
        limit = self.tenant.max_concurrent_requests
        if self._num_free is None or limit is None:  # no limit (both None together)
            return
        if num_slots > limit:
            raise APIError(
                429,
                f"the request has {num_slots} prompts, more than tenant {self.tenant.name}'s "
                f"max_concurrent_requests {limit}; send at most {limit} at once",
            )
        if not self._waiters and self._num_free >= num_slots:
            self._num_free -= num_slots
            return
        if self.num_queued >= self.tenant.max_queued_requests:
            raise APIError(
                429,
                f"tenant {self.tenant.name} has {limit} requests running and "
                f"{self.num_queued} queued, its limits; retry later",
            )
        waiter = (num_slots, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        try:
            await waiter[1]
        except BaseException:
            if waiter[1].done() and not waiter[1].cancelled():
                self.release(num_slots)  # granted just as the caller was cancelled
            else:
                self._waiters.remove(waiter)
                self._wake()
            raise

    def release(self, num_slots: int = 1) -> None:
        if self._num_free is not None:
            self._num_free += num_slots
            self._wake()

    def _wake(self) -> None:
        assert self._num_free is not None
        while self._waiters and (self._waiters[0][1].done() or self._waiters[0][0] <= self._num_free):
            num_slots, future = self._waiters.popleft()
            if not future.done():
                self._num_free -= num_slots
                future.set_result(None)


class Tenants:
    """Who may call, and each caller's gate. Without keys anyone may call, as tenant ``default``."""

    def __init__(self, tenants: list[Tenant]) -> None:
        self._by_key: dict[str, TenantGate] = {}
        for tenant in tenants:
            gate = TenantGate(tenant)
            for key in tenant.api_keys:
                if key in self._by_key:
                    raise ValueError(
                        f"api key of tenant {tenant.name} is also given to {self._by_key[key].tenant.name}"
                    )
                self._by_key[key] = gate
        self._open = None if self._by_key else TenantGate(vllm_tenant())

    @classmethod
    def from_args(cls, api_key: str | None, tenants_file: str | None) -> Tenants:
        tenants = load_tenants(Path(tenants_file)) if tenants_file else []
        if api_key:
            tenants.append(vllm_tenant(api_key))
        return cls(tenants)

    @property
    def is_open(self) -> bool:
        """No keys: every caller is the one tenant ``default``."""
        return self._open is not None

    def tenant_for(self, authorization: str | None) -> TenantGate:
        """The caller's gate for an ``Authorization: Bearer KEY`` value; ``AuthError`` when keys are required."""
        if self._open is not None:
            return self._open
        scheme, _, key = (authorization or "").partition(" ")
        gate = self._by_key.get(key.strip()) if scheme.lower() == "bearer" else None
        if gate is None:
            message = "Missing API key" if not authorization else "Incorrect API key provided"
            raise AuthError(f"{message}; send it as 'Authorization: Bearer KEY'")
        return gate

    def authenticate(self, authorization: str | None) -> TenantGate:
        """``tenant_for`` for HTTP: a refused key is a 401."""
        try:
            return self.tenant_for(authorization)
        except AuthError as exc:
            raise APIError(401, str(exc)) from None


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
        tenants.append(
            Tenant(
                name=str(entry["name"]),
                api_keys=tuple(keys),
                max_concurrent_requests=entry.get("max_concurrent_requests"),
                max_queued_requests=int(entry.get("max_queued_requests", 0)),
                priority=int(entry.get("priority", 0)),
                min_request_priority=int(entry.get("min_request_priority", 0)),
                max_request_priority=int(entry.get("max_request_priority", DEFAULT_MAX_REQUEST_PRIORITY)),
            )
        )
    return tenants
