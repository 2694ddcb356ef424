"""Running the servers: the engine server, the gateway, or both in one process (``raypaged serve``).

SIGTERM or SIGINT starts a graceful shutdown: the gateway drains (see
``gateway/drain.py``) and then stops; an engine server stops taking new calls
and gives running ones the drain timeout before cancelling them. A second
signal during a gateway's drain ends its in-flight requests at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI

from raypaged import envs
from raypaged.config import EngineConfig
from raypaged.serving.client import EngineClient
from raypaged.serving.engine_process import EngineProcess, EngineProcessLost, ProcessStub
from raypaged.serving.gateway.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_PROMPTS_PER_REQUEST, build_app
from raypaged.serving.gateway.drain import Drain
from raypaged.serving.gateway.efforts import AUTO, DisabledThinking, check_effort_map
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.fingerprint import check_fingerprint
from raypaged.serving.gateway.guard import DEFAULT_AUTH_EXEMPT_PATHS, tenants_for
from raypaged.serving.gateway.http_protocol import DEFAULT_MAX_HEADER_COUNT, BoundedHttpToolsProtocol
from raypaged.serving.gateway.output_log import OutputLogging
from raypaged.serving.gateway.reasoning import get_reasoning_parser
from raypaged.serving.gateway.tenants import Tenants
from raypaged.serving.gateway.tool_parsers import get_parser
from raypaged.serving.inprocess import InProcessStub
from raypaged.serving.listener import GuardedListener
from raypaged.serving.metrics import PREFIX as METRICS_PREFIX

if TYPE_CHECKING:
    from raypaged.serving.engine_server import EngineServer

logger = logging.getLogger("raypaged")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
_CLOSE_CONNECTIONS_S = 5.0  # after a drain: for responses still being written
_MAX_RESTARTS = 2  # a data-parallel rank's process started again at most this often within the window
_RESTART_WINDOW_S = 60.0


@dataclass
class GatewayOptions:
    """The gateway's flags. ``api_key``: one key, or several of which any one is accepted;
    ``allowed_hosts``: ``Host`` names served besides loopback ones (``None``: the flag is not
    given; ``("*",)``: any); ``allowed_origins`` empty: no CORS at all; ``ssl_certfile``: HTTPS."""

    host: str = "127.0.0.1"
    port: int = 8000
    uds: str | None = None  # a Unix socket's path: serve on it instead of host:port
    api_key: str | tuple[str, ...] | None = field(default=None, repr=False)
    tenants_file: str | None = None
    log_requests: bool = False  # a log line per request (--enable-log-requests)
    output_logging: OutputLogging | None = None  # with log_requests: what each request generated is logged too
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # None: log_level
    access_log: bool = True  # uvicorn's line per HTTP request
    access_log_skip_paths: tuple[str, ...] = ()  # requests of these paths get no access-log line
    log_config: dict[str, Any] | None = None  # logging.config.dictConfig's dict, for ours and uvicorn's loggers
    log_error_stack: bool = False  # log error responses with their exception's stack
    h11_max_incomplete_event_size: int | None = None  # bytes of a request head (None: 16 KiB, h11's default)
    h11_max_header_count: int = DEFAULT_MAX_HEADER_COUNT  # headers of a request
    openapi_docs: bool = True  # /openapi.json (--disable-fastapi-docs: none)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # CA bundle that client certificates are checked against
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2): client certificates
    ssl_ciphers: str | None = None  # OpenSSL cipher list (None: uvicorn's, TLSv1)
    root_path: str = ""  # a path-routing proxy's prefix (FastAPI's root_path)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    auth_exempt_paths: tuple[str, ...] = DEFAULT_AUTH_EXEMPT_PATHS
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    allowed_hosts: tuple[str, ...] | None = None
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    enable_auto_tool_choice: bool = False  # tool_choice "auto", parsed by tool_call_parser
    tool_call_parser: str | None = None
    response_role: str = "assistant"
    return_tokens_as_token_ids: bool = False  # every request's logprobs name tokens "token_id:{id}"
    tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (--enable-tokenizer-info-endpoint)
    enable_scale_out: bool = False  # the render endpoints and /inference/v1/generate (--enable-scale-out)
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice none: the template sees no tools
    fingerprint_mode: str = "full"  # system_fingerprint: full, hash, custom (fingerprint_value) or none
    fingerprint_value: str | None = None
    sse_keep_alive_s: float = 0.0  # an idle stream sends a keep-alive comment this often (0: never)
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    data_parallel_routing: str = "least_loaded"  # a data-parallel group's choice of replica (replicas.ROUTING)
    enable_force_include_usage: bool = False  # every stream ends with a usage chunk
    enable_request_id_headers: bool = False  # answers carry X-Request-Id
    reasoning_parser: str | None = None  # deepseek_r1, qwen3, openai_gptoss: the reasoning becomes reasoning_content
    reasoning_effort_map: dict[str, str] | None = None  # a request's effort -> the chat template's name for it
    # the engines' --default-chat-template-kwargs (serve's): under each request's, they say whether deepseek_v3 thinks
    default_chat_template_kwargs: dict[str, Any] | None = None
    anthropic_disabled_thinking_effort: str = AUTO  # the effort of a Messages request's disabled thinking

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
        if self.tool_call_parser is not None:
            needed = get_parser(self.tool_call_parser).reasoning_parser  # an unknown name fails now
            if needed is not None and self.reasoning_parser not in (None, needed):
                raise ValueError(
                    f"--tool-call-parser {self.tool_call_parser} reads the messages of --reasoning-parser {needed}, "
                    f"not {self.reasoning_parser}"
                )
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        check_fingerprint(self.fingerprint_mode, self.fingerprint_value)
        check_effort_map(self.reasoning_effort_map)
        DisabledThinking(self.anthropic_disabled_thinking_effort)  # an unknown effort fails now
        if self.output_logging is not None and not self.log_requests:
            raise ValueError("--enable-log-outputs needs --enable-log-requests (the request log it adds to)")
        if not self.sse_keep_alive_s >= 0:
            raise ValueError(f"--sse-keep-alive-interval must be at least 0 seconds, got {self.sse_keep_alive_s:g}")
        if self.h11_max_incomplete_event_size is not None and self.h11_max_incomplete_event_size < 1:
            raise ValueError(
                f"--h11-max-incomplete-event-size must be at least 1 byte, got {self.h11_max_incomplete_event_size}"
            )
        if self.h11_max_header_count < 1:
            raise ValueError(f"--h11-max-header-count must be at least 1, got {self.h11_max_header_count}")
        if self.ssl_ciphers is not None:
            if self.ssl_certfile is None:
                raise ValueError("--ssl-ciphers needs --ssl-certfile (cipher suites are HTTPS's)")
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).set_ciphers(self.ssl_ciphers)
            except ssl.SSLError:
                raise ValueError(f"--ssl-ciphers {self.ssl_ciphers!r}: no cipher suite matches") from None
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path must start with '/', got {self.root_path!r}")
        self.root_path = self.root_path.rstrip("/")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(
                f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {self.ssl_cert_reqs}"
            )
        if (self.ssl_ca_certs is not None or self.ssl_cert_reqs) and self.ssl_certfile is None:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile (client certificates are HTTPS's)")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate to serve HTTPS with)")
        if self.ssl_certfile is not None:
            try:  # now, not when uvicorn starts after the models have loaded
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.ssl_certfile, self.ssl_keyfile)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(
                    f"--ssl-certfile {self.ssl_certfile} with --ssl-keyfile {self.ssl_keyfile}: "
                    f"not a usable certificate and key ({exc})"
                ) from None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted key (none: no key is needed)."""
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else self.api_key


def listen_unix(path: str) -> GuardedListener:
    """A bound Unix stream socket at ``path`` (a stale socket file there is replaced), for uvicorn to serve on."""
    target = Path(path)
    if target.is_socket():
        target.unlink()
    sock = GuardedListener(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen for HTTP on the Unix socket {path}: {exc.strerror}") from None
    target.chmod(0o666)  # as uvicorn's --uds: who may connect is the folder's permissions' business
    return sock


class _SkipPaths(logging.Filter):
    """Drops uvicorn access-log records of requests to ``paths`` (their query strings aside)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def listen(host: str, port: int) -> GuardedListener:
    """A bound TCP socket (port 0 = a free one), for uvicorn to serve on; connections that would leave the
    process too few descriptors wait until others close (``GuardedListener``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and without it
    # every response after the first on a kept-alive connection waits ~40 ms for a delayed ACK
    sock = GuardedListener(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
    return sock


def parse_engine_targets(specs: list[str]) -> dict[str, tuple[str, ...]]:
    """``NAME=host:port`` flags as a name → addresses map: a name given more than once is served by data-parallel
    replicas, one per address."""
    targets: dict[str, tuple[str, ...]] = {}
    for spec in specs:
        name, sep, address = spec.partition("=")
        if not sep or not name or ":" not in address:
            raise ValueError(f"--engine takes NAME=host:port, got {spec!r}")
        if address in targets.get(name, ()):
            raise ValueError(f"--engine {name}={address} is given twice")
        targets[name] = (*targets.get(name, ()), address)
    return targets


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway drains before it stops."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def on_shutdown_signals(callback: Callable[[], object]) -> None:
    """Call ``callback`` on the running loop at each SIGTERM or SIGINT (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, callback)


def gateway_app(routes: EngineRoutes, tenants: Tenants, drain: Drain, options: GatewayOptions) -> FastAPI:
    """The gateway's app as ``options`` shape it: ``Gateway`` serves it, ``raypaged run-batch`` calls it in process."""
    tool_parser = None
    if options.enable_auto_tool_choice:
        assert options.tool_call_parser is not None  # GatewayOptions refuses the one without the other
        tool_parser = get_parser(options.tool_call_parser)
    # a tool-call format inside a reasoning format's messages (harmony's) implies that reasoning parser, as vLLM
    reasoning = options.reasoning_parser or (tool_parser.reasoning_parser if tool_parser is not None else None)
    app = build_app(
        routes,
        tenants,
        options.max_body_bytes,
        options.log_requests,
        drain,
        options.auth_exempt_paths,
        options.max_prompts_per_request,
        bind_host=options.host,
        allowed_hosts=options.allowed_hosts,
        allowed_origins=options.allowed_origins,
        allowed_methods=options.allowed_methods,
        allowed_headers=options.allowed_headers,
        allow_credentials=options.allow_credentials,
        tool_parser=tool_parser,
        response_role=options.response_role,
        prompt_tokens_details=options.enable_prompt_tokens_details,
        force_include_usage=options.enable_force_include_usage,
        request_id_headers=options.enable_request_id_headers,
        reasoning_parser=get_reasoning_parser(reasoning) if reasoning else None,
        openapi_docs=options.openapi_docs,
        return_tokens_as_token_ids=options.return_tokens_as_token_ids,
        tokenizer_info_endpoint=options.tokenizer_info_endpoint,
        exclude_tools_when_tool_choice_none=options.exclude_tools_when_tool_choice_none,
        fingerprint_mode=options.fingerprint_mode,
        fingerprint_value=options.fingerprint_value,
        log_error_stack=options.log_error_stack,
        sse_keep_alive_s=options.sse_keep_alive_s,
        output_logging=options.output_logging,
        scale_out=options.enable_scale_out,
        reasoning_effort_map=options.reasoning_effort_map,
        default_chat_template_kwargs=options.default_chat_template_kwargs,
        disabled_thinking_effort=options.anthropic_disabled_thinking_effort,
    )
    app.root_path = options.root_path  # as vLLM: the prefixed paths route, and so do the bare ones
    return app


class Gateway:
    """The HTTP gateway on a bound socket; ``serve()`` runs until ``shutdown()``, ``stop()`` or a signal."""

    def __init__(
        self,
        targets: Mapping[str, str | tuple[str, ...]],
        options: GatewayOptions,
        local: dict[str, EngineClient] | None = None,
    ) -> None:
        """``local``: in-process stubs of engine servers in this process, by their address in ``targets``."""
        self.tenants = tenants_for(options.api_keys, options.tenants_file)
        self.drain = Drain(options.drain_timeout_s)
        routes = EngineRoutes(targets, local, options.data_parallel_routing)
        app = gateway_app(routes, self.tenants, self.drain, options)
        self.uds = options.uds
        if options.uds is not None:
            self.socket = listen_unix(options.uds)
            self.port = 0
        else:
            self.socket = listen(options.host, options.port)
            self.port = self.socket.getsockname()[1]
        ciphers = {"ssl_ciphers": options.ssl_ciphers} if options.ssl_ciphers is not None else {}
        self.server = _Server(
            uvicorn.Config(
                app,
                # httptools, heads bounded by --h11-max-incomplete-event-size and --h11-max-header-count
                http=BoundedHttpToolsProtocol.with_header_count(options.h11_max_header_count),
                h11_max_incomplete_event_size=options.h11_max_incomplete_event_size,
                log_config=options.log_config if options.log_config is not None else uvicorn.config.LOGGING_CONFIG,
                log_level=options.uvicorn_log_level or options.log_level,
                access_log=options.access_log,
                lifespan="off",
                timeout_graceful_shutdown=_CLOSE_CONNECTIONS_S,
                ssl_keyfile=options.ssl_keyfile,
                ssl_certfile=options.ssl_certfile,
                ssl_ca_certs=options.ssl_ca_certs,
                ssl_cert_reqs=options.ssl_cert_reqs,
                **ciphers,
            )
        )
        self._access_filter = _SkipPaths(options.access_log_skip_paths) if options.access_log_skip_paths else None
        self._shutdown: asyncio.Task | None = None

    async def serve(self, handle_signals: bool = False) -> None:
        """Serve until stopped; with ``handle_signals``, SIGTERM/SIGINT drain and stop it."""
        if handle_signals:
            on_shutdown_signals(self.begin_shutdown)
        logger.info("HTTP gateway on %s", self.socket.getsockname())
        access = logging.getLogger("uvicorn.access")
        if self._access_filter is not None:
            access.addFilter(self._access_filter)
        try:
            await self.server.serve(sockets=[self.socket])
        finally:
            if self._access_filter is not None:
                access.removeFilter(self._access_filter)
            if self.uds is not None:
                Path(self.uds).unlink(missing_ok=True)

    def begin_shutdown(self) -> None:
        """Drain then stop (on the serving loop); called again during the drain, end in-flight requests now."""
        if self._shutdown is None:
            logger.info("shutdown requested")
            self._shutdown = asyncio.ensure_future(self.shutdown())
        else:
            logger.info("shutdown requested again: ending in-flight requests now")
            self.drain.expire()

    async def shutdown(self) -> None:
        """Drain (``/health`` and new requests 503; in-flight ones finish or are ended), then stop serving."""
        await self.drain.run()
        self.stop()

    def stop(self) -> None:
        """Stop at once, without draining."""
        self.server.should_exit = True


async def run_engine(
    configs: list[EngineConfig],
    host: str,
    grpc_port: int,
    drain_timeout_s: float,
    tenants: Tenants,
    share_prefix_cache: bool = False,
    metrics_prefix: str = METRICS_PREFIX,
    lora_modules: dict[str, tuple[str, str]] | None = None,
) -> None:
    """The engine server until SIGTERM/SIGINT; then running calls get ``drain_timeout_s`` before they are cancelled."""
    from raypaged.serving.engine_server import EngineServer

    server = EngineServer(configs, tenants, share_prefix_cache, metrics_prefix, lora_modules)
    await server.start(host, grpc_port)
    stopping = asyncio.Event()
    on_shutdown_signals(stopping.set)
    try:
        await stopping.wait()
        logger.info("shutdown requested: finishing running calls within %g s", drain_timeout_s)
    finally:
        await server.stop(grace=drain_timeout_s)


async def run_gateway(
    targets: Mapping[str, str | tuple[str, ...]], options: GatewayOptions, local: dict[str, EngineClient] | None = None
) -> None:
    await Gateway(targets, options, local).serve(handle_signals=True)


async def run_serve(
    configs: list[EngineConfig] | Callable[[], list[EngineConfig]],
    grpc_host: str,
    grpc_port: int,
    options: GatewayOptions,
    share_prefix_cache: bool = False,
    metrics_prefix: str = METRICS_PREFIX,
    lora_modules: dict[str, tuple[str, str]] | None = None,
    engines: list[EngineProcess] | None = None,
    data_parallel_size: int = 1,
    tensor_parallel_size: int = 1,
) -> None:
    """Engines, their gRPC server and a gateway in front of them; the gateway drains first.

    By default (``$RAYPAGED_ENGINE_PROCESS``) the engines and their gRPC server run in a child process
    (``serving/engine_process.py``) and the gateway reaches them over a socket pair; with it ``0``, in
    this process (``serving/inprocess.py``: the gRPC server's own handlers, no socket). Either way the
    gRPC server serves external clients and takes the gateway's keys and tenants, with gates of its
    own (the gateway's calls carry their client's key, so each request holds one slot at each of the
    two). If the engine process dies, the gateway stops and ``EngineProcessLost`` is raised (with data
    parallelism, a rank's process is started again first: ``_Ranks``). ``engines``:
    engine processes launched already, one per data-parallel rank (``raypaged serve`` launches them first, to
    import in parallel). ``configs``: the engines' configs, or a picklable function that makes them, called
    where the engines run (building a config reads the model's with transformers, which imports torch:
    ``raypaged serve`` leaves both out of the gateway's process).

    ``data_parallel_size`` (vLLM's ``-dp``): that many copies of the engine server, each its own process (with
    its own environment, ``engine_process.data_parallel_env``: ``tensor_parallel_size`` devices a rank), its
    gRPC server on ``grpc_port`` + its rank (0: free ports) and its metrics labelled ``engine="RANK"``; the
    gateway balances each request to one of them (``gateway/replicas.py``).
    """
    tenants = tenants_for(options.api_keys, options.tenants_file)
    ranks = range(data_parallel_size)
    if engines is None and envs.engine_process():
        engines = EngineProcess.for_ranks(data_parallel_size, tensor_parallel_size)
    servers: list[EngineServer] = []
    local: dict[str, EngineClient] = {}
    served_names: dict[str, str] = {}

    def rank_args(rank: int) -> tuple[Any, ...]:
        return (configs, tenants, share_prefix_cache, metrics_prefix, lora_modules, rank)

    def port_of(rank: int) -> int:
        return grpc_port + rank if grpc_port else 0

    def address(port: int) -> str:
        return f"{'127.0.0.1' if grpc_host in ('0.0.0.0', '') else grpc_host}:{port}"

    ranks_alive: _Ranks | None = None

    async def start_rank(rank: int, engine: EngineProcess) -> None:
        await engine.start(rank_args(rank), grpc_host, port_of(rank), options.log_config)

    try:
        if engines is not None:
            started = await asyncio.gather(
                *(start_rank(r, e) for r, e in zip(ranks, engines)),
                return_exceptions=True,  # every rank loads or fails before the others are stopped
            )
            for failure in started:
                if isinstance(failure, BaseException):
                    raise failure
            ranks_alive = _Ranks(engines, start_rank)
            for engine, stub in zip(engines, ranks_alive.stubs):
                local[address(engine.grpc_port)] = stub
                served_names = engine.served_names
        else:
            from raypaged.serving.engine_server import EngineServer

            for rank in ranks:
                made = configs if isinstance(configs, list) else configs()
                server = EngineServer(made, *rank_args(rank)[1:])
                servers.append(server)
                local[address(await server.start(grpc_host, port_of(rank)))] = InProcessStub(server.servicer)
                served_names = server.served_names
        gateway = Gateway({name: tuple(local) for name in served_names}, options, local)
        if ranks_alive is not None:
            ranks_alive.watch(gateway.stop)
        await gateway.serve(handle_signals=True)
    finally:
        stopping = [ranks_alive.stop()] if ranks_alive is not None else [e.stop() for e in engines or ()]
        await asyncio.gather(*stopping, *(server.stop() for server in servers))
    if ranks_alive is not None and ranks_alive.lost is not None:
        raise EngineProcessLost(ranks_alive.lost)


class _Ranks:
    """The engine processes of ``raypaged serve``, one per data-parallel rank. With one, its death stops the server
    (for its supervisor to start it again, as vLLM's API server exits with its engine core). With several, a rank
    whose process dies is started again (its environment, its gRPC port) while the others serve: its open calls
    fail ``UNAVAILABLE`` and ``Replicas`` sends new ones elsewhere until it is back. A rank lost more than
    ``_MAX_RESTARTS`` times within ``_RESTART_WINDOW_S``, or that cannot start again, stops the server."""

    def __init__(self, engines: list[EngineProcess], start: Callable[[int, EngineProcess], Awaitable[None]]) -> None:
        self.engines = list(engines)
        self.stubs = [ProcessStub(engine) for engine in engines]
        self.lost: str | None = None  # why the server stopped
        self._start = start
        self._stop_server: Callable[[], None] = lambda: None
        self._deaths: list[list[float]] = [[] for _ in engines]
        self._restarts: set[asyncio.Task[None]] = set()

    def watch(self, stop_server: Callable[[], None]) -> None:
        self._stop_server = stop_server
        for rank, engine in enumerate(self.engines):
            engine.on_lost = functools.partial(self._on_lost, rank)

    def _on_lost(self, rank: int, why: str) -> None:
        if len(self.engines) == 1:
            self._give_up(why)
            return
        now = time.monotonic()
        deaths = self._deaths[rank] = [t for t in self._deaths[rank] if now - t < _RESTART_WINDOW_S] + [now]
        if len(deaths) > _MAX_RESTARTS:
            self._give_up(f"data-parallel rank {rank}: {why}, {len(deaths)} times within {_RESTART_WINDOW_S:.0f} s")
            return
        logger.error("data-parallel rank %d: %s; starting it again while the other ranks serve", rank, why)
        self.stubs[rank].available = False
        task = asyncio.ensure_future(self._restart(rank))
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    async def _restart(self, rank: int) -> None:
        engine = self.engines[rank] = EngineProcess(self.engines[rank].env)
        try:
            await self._start(rank, engine)
        except Exception as exc:
            self._give_up(f"data-parallel rank {rank} could not start again: {type(exc).__name__}: {exc}")
            return
        engine.on_lost = functools.partial(self._on_lost, rank)
        self.stubs[rank].replace(engine)
        logger.info("data-parallel rank %d serves again (gRPC port %d)", rank, engine.grpc_port)

    def _give_up(self, why: str) -> None:
        if self.lost is None:
            self.lost = why
        self._stop_server()

    async def stop(self) -> None:
        for task in list(self._restarts):
            task.cancel()
        await asyncio.gather(*(engine.stop() for engine in self.engines))
