"""The gateway's view of its engines: one gRPC channel per engine address, routes by model name."""

from __future__ import annotations

import asyncio

import grpc
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from raypaged.serving.channel import MESSAGE_SIZE_OPTIONS, RECONNECT_OPTIONS
from raypaged.serving.client import EngineClient
from raypaged.serving.gateway.errors import APIError
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc

_PROBE_TIMEOUT_S = 2.0


class EngineRoutes:
    """``targets`` maps each served model name to the ``host:port`` of the engine serving it.

    ``local`` maps addresses of engine servers in this process to their in-process clients
    (``InProcessStub``, for ``raypaged serve``); every other address is reached over gRPC.
    Either way the gateway holds an ``EngineClient`` per address.
    """

    def __init__(self, targets: dict[str, str], local: dict[str, EngineClient] | None = None) -> None:
        if not targets:
            raise ValueError("the gateway needs at least one engine (--engine NAME=host:port)")
        self.targets = dict(targets)
        self._stubs: dict[str, EngineClient] = dict(local or {})
        self._info: dict[str, pb.ModelInfo] = {}
        self.adapters: dict[str, str] = {}  # LoRA adapter name -> the address of the engine serving it

    def _stub(self, address: str) -> EngineClient:
        """The stub of ``address``; gRPC channels are made on first use, on the serving loop."""
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=MESSAGE_SIZE_OPTIONS + RECONNECT_OPTIONS)
            stub = self._stubs[address] = pb_grpc.TextGenerationServiceStub(channel)
        return stub

    def _all_stubs(self) -> dict[str, EngineClient]:
        return {address: self._stub(address) for address in sorted(set(self.targets.values()))}

    def resolve(self, model: str | None) -> tuple[str, EngineClient]:
        """The served name and stub for a request's ``model`` (omitted: the only model)."""
        if not model:
            if len(self.targets) > 1:
                raise APIError(400, f"model is required; served models: {', '.join(self.targets)}", "model")
            model = next(iter(self.targets))
        address = self.targets.get(model) or self.adapters.get(model)
        if address is None:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model, self._stub(address)

    async def find(self, model: str | None) -> tuple[str, EngineClient]:
        """``resolve``, after asking the engines for their LoRA adapters when ``model`` is no name known here."""
        if model and model not in self.targets and model not in self.adapters:
            await self.refresh_adapters()
        return self.resolve(model)

    async def refresh_adapters(self) -> None:
        """The LoRA adapters every reachable engine serves now (``Info`` lists them with their parent)."""
        found: dict[str, str] = {}
        for address, stub in self._all_stubs().items():
            try:
                response = await stub.Info(pb.InfoRequest(), timeout=_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError:
                found.update({name: a for name, a in self.adapters.items() if a == address})  # keep what was known
                continue
            for info in response.models:
                if info.parent:
                    found[info.name] = address
                    self._info[info.name] = info
        for gone in set(self.adapters) - set(found):
            self._info.pop(gone, None)
        self.adapters = found

    def address_for_base(self, base: str | None) -> str:
        """The engine a new LoRA adapter goes to: ``base``'s, or the only engine's."""
        if base:
            if base not in self.targets:
                raise APIError(404, f"The model `{base}` does not exist.", "base_model_name")
            return self.targets[base]
        addresses = set(self.targets.values())
        if len(addresses) > 1:
            raise APIError(
                400, f"base_model_name is required; served models: {', '.join(self.targets)}", "base_model_name"
            )
        return next(iter(addresses))

    def stub_at(self, address: str) -> EngineClient:
        return self._stub(address)

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
        """``None`` when every engine serves, else why not."""

        async def probe(address: str, stub: EngineClient) -> str | None:
            try:
                response = await stub.Health(pb.HealthRequest(), timeout=_PROBE_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                return f"engine {address} unreachable: {exc.code().name}"
            if response.status != pb.SERVING_STATUS_SERVING:
                return f"engine {address} not serving: {response.message}"
            return None

        problems = await asyncio.gather(*(probe(a, s) for a, s in self._all_stubs().items()))
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
        for text in await asyncio.gather(*(scrape(s) for s in self._all_stubs().values())):
            for family in text_string_to_metric_families(text):
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        return list(merged.values())
