"""The gateway's view of its engines: one gRPC channel per engine address, routes by model name (a name served by
several engines, its data-parallel replicas, routes to their ``Replicas``)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from raypaged.serving.channel import MESSAGE_SIZE_OPTIONS, RECONNECT_OPTIONS
from raypaged.serving.client import EngineClient
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.gateway.replicas import Replicas
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc

_PROBE_TIMEOUT_S = 2.0


Addresses = tuple[str, ...]  # the engines serving a name: one, or its data-parallel replicas


class EngineRoutes:
    """``targets`` maps each served model name to the ``host:port`` of the engine serving it, or to the
    addresses of its data-parallel replicas.

    ``local`` maps addresses of engine servers in this process to their in-process clients
    (``InProcessStub``, for ``raypaged serve``); every other address is reached over gRPC.
    Either way the gateway holds an ``EngineClient`` per address, and a ``Replicas`` per group of them.
    """

    def __init__(
        self,
        targets: Mapping[str, str | Addresses],
        local: dict[str, EngineClient] | None = None,
        routing: str = "least_loaded",
    ) -> None:
        """``routing``: how a data-parallel group picks the replica of a request (``replicas.ROUTING``)."""
        if not targets:
            raise ValueError("the gateway needs at least one engine (--engine NAME=host:port)")
        self.targets: dict[str, Addresses] = {
            name: (where,) if isinstance(where, str) else tuple(where) for name, where in targets.items()
        }
        self._stubs: dict[str, EngineClient] = dict(local or {})
        self._groups: dict[Addresses, Replicas] = {}
        self.routing = routing
        self._info: dict[str, pb.ModelInfo] = {}
        self.adapters: dict[str, Addresses] = {}  # LoRA adapter name -> the engines serving it

    def _stub(self, address: str) -> EngineClient:
        """The stub of ``address``; gRPC channels are made on first use, on the serving loop."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=MESSAGE_SIZE_OPTIONS + RECONNECT_OPTIONS)
            stub = self._stubs[address] = pb_grpc.TextGenerationServiceStub(channel)
        return stub

    def client(self, addresses: Addresses) -> EngineClient:
        """The client of one engine, or the ``Replicas`` of several (one per group, so each counts its calls)."""
        if len(addresses) == 1:
            return self._stub(addresses[0])
        group = self._groups.get(addresses)
        if group is None:
            group = self._groups[addresses] = Replicas([self._stub(a) for a in addresses], self.routing)
        return group

    def _all_stubs(self) -> dict[str, EngineClient]:
        return {address: self._stub(address) for address in sorted({a for g in self.targets.values() for a in g})}

    def resolve(self, model: str | None) -> tuple[str, EngineClient]:
        """The served name and stub for a request's ``model`` (omitted: the only model)."""
        if not model:
            if len(self.targets) > 1:
                raise APIError(400, f"model is required; served models: {', '.join(self.targets)}", "model")
            model = next(iter(self.targets))
        addresses = self.targets.get(model) or self.adapters.get(model)
        if addresses is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model, self.client(addresses)

    async def find(self, model: str | None) -> tuple[str, EngineClient]:
        """``resolve``, after asking the engines for their LoRA adapters when ``model`` is no name known here."""
        if model and model not in self.targets and model not in self.adapters:
            await self.refresh_adapters()
        return self.resolve(model)

    async def refresh_adapters(self) -> None:
        """The LoRA adapters every reachable engine serves now (``Info`` lists them with their parent); an adapter
        goes to the engines of its parent's group that hold it."""
        held: dict[str, set[str]] = {}
        for address, stub in self._all_stubs().items():
            try:
                response = await stub.Info(pb.InfoRequest(), timeout=_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError:  # keep what was known
                for name in (name for name, group in self.adapters.items() if address in group):
                    held.setdefault(name, set()).add(address)
                continue
            for info in response.models:
                if info.parent:
                    held.setdefault(info.name, set()).add(address)
                    self._info[info.name] = info
        found = {name: tuple(sorted(addresses)) for name, addresses in held.items()}
        for gone in set(self.adapters) - set(found):
            self._info.pop(gone, None)
        self.adapters = found

    def engines_for_base(self, base: str | None) -> Addresses:
        """The engines a new LoRA adapter goes to: ``base``'s (each replica), or the only group's."""
        if base:
            if base not in self.targets:
                raise APIError(404, f"The model `{base}` does not exist.", "base_model_name")
            return self.targets[base]
        groups = set(self.targets.values())
        if len(groups) > 1:
            raise APIError(
                400, f"base_model_name is required; served models: {', '.join(self.targets)}", "base_model_name"
            )
        return next(iter(groups))

    def engines(self) -> list[EngineClient]:
        """Every engine's client, one per address."""
        return list(self._all_stubs().values())

    async def model_info(self, model: str) -> pb.ModelInfo | None:
        """The engine's description of ``model`` (cached), or ``None`` while it is unreachable."""
        if model not in self._info:
            _, stub = self.resolve(model)
            try:
                response = await stub.Info(pb.InfoRequest(), timeout=_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                return None
            self._info.update({m.name: m for m in response.models})
        return self._info.get(model)

    async def answered_info(self, model: str) -> pb.ModelInfo:
        """``model_info``, which a request cannot do without: a 503 while the engine does not answer."""
        info = await self.model_info(model)
        if info is None:
            raise APIError(
                503, f"the engine is unavailable: the one serving {model} did not answer; send the request again"
            )
        return info

    async def health(self) -> str | None:
        """``None`` when every engine serves (of a data-parallel group: one of its replicas), else why not."""

        async def probe(address: str, stub: EngineClient) -> str | None:
            try:
                response = await stub.Health(pb.HealthRequest(), timeout=_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                return f"engine {address} unreachable: {exc.code().name}"
            if response.status != pb.SERVING_STATUS_SERVING:
                return f"engine {address} not serving: {response.message}"
            return None

        groups = sorted(set(self.targets.values()))  # a data-parallel group serves while one of its replicas does
        problems = await asyncio.gather(*(probe(",".join(g), self.client(g)) for g in groups))
        found = [p for p in problems if p]
        return "; ".join(found) if found else None

    async def metric_families(self) -> list[Metric]:
        """Every reachable engine's metrics, families of the same name merged."""

        async def scrape(stub: EngineClient) -> str:
            try:
                return (await stub.Metrics(pb.MetricsRequest(), timeout=_PROBE_TIMEOUT_S)).prometheus_text
            except grpc.aio.AioRpcError:
                return ""

        merged: dict[str, Metric] = {}
        at: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}  # a sample's name and labels -> its index
        for text in await asyncio.gather(*(scrape(s) for s in self._all_stubs().values())):
            for family in text_string_to_metric_families(text):
                samples = family.samples
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = family
                    family.samples = []
                for sample in samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    if key not in at:
                        at[key] = len(into.samples)
                        into.samples.append(sample)
                    elif into.type == "counter":  # a counter without an engine label, from data-parallel ranks
                        into.samples[at[key]] = sample._replace(value=into.samples[at[key]].value + sample.value)
        return list(merged.values())
