"""What every HTTP request passes before a route: its Host, the API key, the drain, a JSON body.

``HostCheck`` (outermost, every path) refuses a ``Host`` header that is not
allowed, which stops DNS rebinding: on a loopback bind only loopback names
(``localhost``, ``127.x.y.z``, ``::1``) and ``--allowed-hosts`` pass; elsewhere
the check runs only when ``--allowed-hosts`` is given.

``Guard``: with keys configured (``--api-key`` takes several: any one is accepted,
all as tenant ``default``), every path needs one except ``exempt_paths``
(by default ``/health`` and ``/metrics``; an empty set protects those too). A key
comes as ``Authorization: Bearer KEY`` or, from Anthropic's clients, as
``x-api-key: KEY`` (read as that ``Authorization`` when none is sent). The
caller's tenant gate is left in ``request.state.tenant_gate`` and its
``Authorization`` (``None`` when neither header is sent) in ``request.state.authorization``.
While the gateway drains, everything but ``/health`` and ``/metrics`` is
refused with 503. A POST whose ``Content-Type`` is not JSON is refused with 415,
so no HTML form or other cross-site "simple" request can reach a route; a POST
without a ``Content-Type`` is read as JSON. A POST that a browser marks as
cross-site (``Sec-Fetch-Site: cross-site``, or an ``Origin`` that is neither the
server's own nor one of ``--allowed-origins``) is refused with 403, which also
stops the no-preflight requests a page can send without a ``Content-Type``.
Paths are read as the routes match them: without the ``--root-path`` prefix.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.errors import MESSAGES_PATH, APIError, route_path
from raypaged.serving.gateway.scoring import RERANK_PATHS, SCORE_PATHS
from raypaged.serving.gateway.tenants import Tenant, Tenants, load_tenants

DEFAULT_AUTH_EXEMPT_PATHS = ("/health", "/metrics")
GENERATION_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/invocations",
    MESSAGES_PATH,
    "/inference/v1/generate",  # vLLM's scale-out endpoints (--enable-scale-out)
    "/inference/v1/abort_requests",  # a tenant's requests are found by its key
    "/v1/embeddings",  # a pooling model's requests hold tenant slots too
    "/pooling",
    "/classify",
    *SCORE_PATHS,
    *RERANK_PATHS,
)
_OPEN_WHILE_DRAINING = ("/health", "/metrics")
ANY_HOST = "*"


def tenants_for(api_keys: tuple[str, ...], tenants_file: str | None) -> Tenants:
    """The tenants of a ``--tenants`` file, and the ``--api-key`` keys as one more tenant, ``default``."""
    tenants = load_tenants(Path(tenants_file)) if tenants_file else []
    if api_keys:
        tenants.append(Tenant("default", api_keys=api_keys))
    return Tenants(tenants)


def check_exempt_paths(paths: tuple[str, ...]) -> None:
    """Exempt paths are absolute, and never the generation routes (their tenant limits need a key)."""
    for path in paths:
        if not path.startswith("/"):
            raise ValueError(f"--auth-exempt-paths takes paths starting with '/', got {path!r}")
        if path in GENERATION_PATHS:
            raise ValueError(
                f"--auth-exempt-paths cannot include {path}: generation always needs a key when keys are set"
            )


def host_name(host: str) -> str:
    """The name part of a ``Host`` header or address: no port, no IPv6 brackets, lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    return host.removesuffix(".")


def is_loopback(host: str) -> bool:
    """``localhost``, an address in 127.0.0.0/8, or ``::1`` (``host`` as :func:`host_name` gives it)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_check_needed(bind_host: str, allowed_hosts: tuple[str, ...] | None) -> bool:
    """Loopback binds always check the ``Host`` header; others only when ``--allowed-hosts`` is given."""
    if allowed_hosts is not None and ANY_HOST in allowed_hosts:
        return False
    return allowed_hosts is not None or is_loopback(host_name(bind_host))


class HostCheck:
    """ASGI middleware: a request's ``Host`` must be a loopback name or one of ``allowed_hosts``."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...]) -> None:
        self.app = app
        self.allowed_hosts = frozenset(host_name(h) for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            problem = self.refusal(_header(scope, b"host"))
            if problem is not None:
                await problem.response(route_path(scope))(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, host: str | None) -> APIError | None:
        if host is None:
            return APIError(
                400, "the request has no Host header; send the host it was addressed to", code="host_not_allowed"
            )
        name = host_name(host)
        if is_loopback(name) or name in self.allowed_hosts:
            return None
        return APIError(
            400,
            f"Host {host!r} is not allowed: only loopback names (localhost, 127.0.0.1, [::1]) and the hosts "
            f"given to --allowed-hosts may address this server (it guards against DNS rebinding)",
            code="host_not_allowed",
        )


def is_json(content_type: str) -> bool:
    """``application/json`` or any ``*/*+json``, parameters such as ``charset`` ignored."""
    media_type = content_type.partition(";")[0].strip().lower()
    kind, slash, subtype = media_type.partition("/")
    return bool(kind and slash) and (media_type == "application/json" or subtype.endswith("+json"))


class Guard:
    """ASGI middleware: authentication, then refusal while draining, then a POST body must be JSON."""

    def __init__(
        self,
        app: ASGIApp,
        tenants: Tenants,
        drain: Drain,
        exempt_paths: tuple[str, ...],
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        check_exempt_paths(exempt_paths)
        self.app = app
        self.tenants = tenants
        self.drain = drain
        self.exempt_paths = frozenset(exempt_paths)
        self.allowed_origins = frozenset(o.rstrip("/") for o in allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        authorization = _header(scope, b"authorization")
        if authorization is None and (api_key := _header(scope, b"x-api-key")) is not None:
            authorization = f"Bearer {api_key}"
        state = scope.setdefault("state", {})
        state["authorization"] = authorization
        try:
            if path not in self.exempt_paths:
                state["tenant_gate"] = self.tenants.authenticate(authorization)
            if self.drain.draining and path not in _OPEN_WHILE_DRAINING:
                raise self.drain.refusal()
            if scope["method"] == "POST":
                self._check_post(scope)
        except APIError as exc:
            await exc.response(path)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check_post(self, scope: Scope) -> None:
        origin = _header(scope, b"origin")
        allowed = "*" in self.allowed_origins or (origin is not None and origin.rstrip("/") in self.allowed_origins)
        if not allowed and _cross_site(origin, _header(scope, b"host"), _header(scope, b"sec-fetch-site")):
            raise APIError(
                403,
                f"cross-site request refused (Origin {origin!r}): list the origin in --allowed-origins "
                f"to serve browser pages from it",
                code="cross_site_request",
            )
        content_type = _header(scope, b"content-type")
        if content_type is not None and not is_json(content_type):
            raise APIError(
                415,
                f"Content-Type {content_type!r} is not supported: send the body as JSON with "
                f"'Content-Type: application/json'",
            )


def _cross_site(origin: str | None, host: str | None, fetch_site: str | None) -> bool:
    """A browser says the request comes from another site: by ``Sec-Fetch-Site``, or an ``Origin`` whose
    host is not the one the request was addressed to (``Origin: null`` included)."""
    if fetch_site is not None and fetch_site.strip().lower() == "cross-site":
        return True
    if origin is None:
        return False
    _, sep, rest = origin.partition("://")
    return not sep or host is None or rest.rstrip("/").lower() != host.strip().lower()


def _header(scope: Scope, name: bytes) -> str | None:
    """The first ``name`` header of the request (lower-case ``name``), ``None`` when absent."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None
