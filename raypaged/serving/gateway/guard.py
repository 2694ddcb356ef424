"""What every HTTP request passes before a route: the API key, then the drain.

With keys configured, every path needs one except ``exempt_paths`` (by default
``/health`` and ``/metrics``; an empty set protects those too). The caller's
tenant gate is left in ``request.state.tenant_gate``. While the gateway drains,
everything but ``/health`` and ``/metrics`` is refused with 503.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.tenants import Tenants

DEFAULT_AUTH_EXEMPT_PATHS = ("/health", "/metrics")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_OPEN_WHILE_DRAINING = ("/health", "/metrics")


def check_exempt_paths(paths: tuple[str, ...]) -> None:
    """Exempt paths are absolute, and never the generation routes (their tenant limits need a key)."""
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"--auth-exempt-paths takes paths starting with '/', got {path!r}")
        if path in GENERATION_PATHS:
            raise ValueError(f"--auth-exempt-paths cannot include {path}: generation always needs a key when keys are set")


class Guard:
    """ASGI middleware: authentication, then refusal while draining."""

    def __init__(self, app: ASGIApp, tenants: Tenants, drain: Drain, exempt_paths: tuple[str, ...]) -> None:
        check_exempt_paths(exempt_paths)
        self.app = app
        self.tenants = tenants
        self.drain = drain
        self.exempt_paths = frozenset(exempt_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        try:
            if path not in self.exempt_paths:
                headers = dict(scope["headers"])
                authorization = headers.get(b"authorization")
                gate = self.tenants.authenticate(authorization.decode("latin-1") if authorization is not None else None)
                scope.setdefault("state", {})["tenant_gate"] = gate
            if self.drain.draining and path not in _OPEN_WHILE_DRAINING:
                raise self.drain.refusal()
        except APIError as exc:
            await exc.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
