"""The adapters an engine serves, by name (what a request's ``model`` says) and by id. Torch-free."""

from __future__ import annotations

from raypaged.lora.request import LoRARequest


class UnknownLoRAError(LookupError):
    """A request or unload names an adapter that is not loaded (an HTTP 404)."""


class LoRARegistry:
    """Names and ids of the loaded adapters; each name and each id belongs to one adapter."""

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._by_id: dict[int, LoRARequest] = {}

    def add(self, request: LoRARequest) -> None:
        if request.lora_name in self._by_name:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is already loaded")
        owner = self._by_id.get(request.lora_int_id)
        if owner is not None:
            raise ValueError(f"lora_int_id {request.lora_int_id} of {request.lora_name!r} is already used by "
                             f"{owner.lora_name!r}")
        self._by_name[request.lora_name] = request
        self._by_id[request.lora_int_id] = request

    def remove(self, name: str) -> LoRARequest:
        request = self.get(name)
        del self._by_name[name], self._by_id[request.lora_int_id]
        return request

    def get(self, name: str) -> LoRARequest:
        request = self._by_name.get(name)
        if request is None:
            raise UnknownLoRAError(f"LoRA adapter {name!r} is not loaded")
        return request

    def by_id(self, lora_int_id: int) -> LoRARequest:
        request = self._by_id.get(lora_int_id)
        if request is None:
            raise UnknownLoRAError(f"no LoRA adapter has lora_int_id {lora_int_id}")
        return request

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def requests(self) -> list[LoRARequest]:
        """The loaded adapters in load order (``/v1/models`` lists them)."""
        return list(self._by_name.values())
