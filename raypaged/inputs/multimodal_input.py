"""What a request carries beside its prompt for an image-text model: one object from the entry points
(``LLM.generate``/``LLM.chat``, the gRPC service, the in-process server) through the engines to the input
processor, instead of a parameter for each part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MultiModalInput:
    """A request's images (PIL, one per image placeholder of its text prompt; vLLM's ``multi_modal_data``),
    ``processor_kwargs`` (vLLM's ``mm_processor_kwargs``: the image processor's options for this request, over
    ``--mm-processor-kwargs``) and ``rendered``: the prompt is a chat template's rendering, so the tokenizer adds
    no special tokens to it. ``processor_kwargs`` without images is refused by the input processor."""

    images: list[Any]
    processor_kwargs: dict[str, Any] | None = None
    rendered: bool = False

    @classmethod
    def of(
        cls, images: list[Any] | None, processor_kwargs: dict[str, Any] | None = None, rendered: bool = False
    ) -> MultiModalInput | None:
        """The bundle, or None when there is nothing in it (no images, no options)."""
        if not images and not processor_kwargs:
            return None
        return cls(list(images or ()), processor_kwargs or None, rendered)
