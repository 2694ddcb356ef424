"""Running the servers: the engine server, the gateway, or both in one process (``raypaged serve``)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import uvicorn

from raypaged.config import EngineConfig
from raypaged.serving.engine_server import EngineServer
from raypaged.serving.gateway.app import DEFAULT_MAX_BODY_BYTES, build_app
from raypaged.serving.gateway.engines import EngineRoutes
from raypaged.serving.gateway.tenants import Tenants

logger = logging.getLogger("raypaged")


@dataclass
class GatewayOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    tenants_file: str | None = None
    log_requests: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"


def listen(host: str, port: int) -> socket.socket:
    """A bound TCP socket (port 0 = a free one), for uvicorn to serve on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from None
    return sock


def parse_engine_targets(specs: list[str]) -> dict[str, str]:
    """``NAME=host:port`` flags as a name → address map."""
    targets: dict[str, str] = {}
    for spec in specs:
        name, sep, address = spec.partition("=")
        if not sep or not name or ":" not in address:
            raise ValueError(f"--engine takes NAME=host:port, got {spec!r}")
        if name in targets:
            raise ValueError(f"--engine {name} is given twice")
        targets[name] = address
    return targets


class Gateway:
    """The HTTP gateway on a bound socket; ``serve()`` runs until ``stop()`` or a signal."""

    def __init__(self, targets: dict[str, str], options: GatewayOptions) -> None:
        tenants = Tenants.from_args(options.api_key, options.tenants_file)
        app = build_app(EngineRoutes(targets), tenants, options.max_body_bytes, options.log_requests)
        self.socket = listen(options.host, options.port)
        self.port = self.socket.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level=options.log_level, access_log=options.log_requests, lifespan="off")
        )

    async def serve(self) -> None:
        logger.info("HTTP gateway on %s", self.socket.getsockname())
        await self.server.serve(sockets=[self.socket])

    def stop(self) -> None:
        self.server.should_exit = True


async def run_engine(configs: list[EngineConfig], host: str, grpc_port: int) -> None:
    server = EngineServer(configs)
    await server.start(host, grpc_port)
    try:
        await asyncio.Event().wait()
    finally:
        await server.stop()


async def run_gateway(targets: dict[str, str], options: GatewayOptions) -> None:
    await Gateway(targets, options).serve()


async def run_serve(configs: list[EngineConfig], grpc_host: str, grpc_port: int, options: GatewayOptions) -> None:
    """Engines, their gRPC server and a gateway in front of it, in one process."""
    server = EngineServer(configs)
    port = await server.start(grpc_host, grpc_port)
    address = f"{'127.0.0.1' if grpc_host in ('0.0.0.0', '') else grpc_host}:{port}"
    try:
        await run_gateway({name: address for name in server.models}, options)
    finally:
        await server.stop()
