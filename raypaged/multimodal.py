"""A prompt's images, as they travel from the input processor to the model runner (no torch import here: the core
and the scheduler hold them without reading them).

The input processor runs the model's own Hugging Face processor: it expands each image's placeholder in the prompt
into the run of image tokens the model reads, and makes the pixel values. The scheduler keeps them on the request
and sends them to the workers with the request (again after a preemption that drops its KV cache). The runner
encodes a request's images once, when a step first computes one of their positions, and each step's rows at those
positions take the image's embeddings instead of the token embedding of the placeholder id. Prefix-cache keys
carry each image's hash (the request's cache salt), so that prompts with different images never share blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """A prompt's images: their pixels as the model's processor made them, where their tokens are, their hashes."""

    pixel_values: Any  # torch.Tensor [num_images (LLaVA-NeXT: their patches), 3, height, width], float32 on the CPU
    # per image: (its first prompt position, its number of tokens); Mistral 3's: per row of an image's tokens
    placeholders: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]  # per image: the sha256 of its pixel values
    # LLaVA-NeXT: per image, its rows of pixel_values (the base image, then its grid's patches) and its original
    # (height, width); None: one row an image
    patches: tuple[tuple[int, tuple[int, int]], ...] | None = None
    # Qwen2-VL: per image, its grid of patches (temporal, height, width), its rows of pixel_values being their
    # product, and the vision tower's spatial_merge_size (merge x merge patches make one token); None: another model
    grids: tuple[tuple[int, int, int], ...] | None = None
    merge_size: int = 1
    # Mistral 3 (Pixtral): per image, its (height, width) in pixels inside pixel_values' padded [3, H, W] (its
    # placeholders are its rows of tokens); None: another model
    image_sizes: tuple[tuple[int, int], ...] | None = None
    # Idefics3 (SmolVLM): each tile's pixel mask [tiles, H, W] (pixel_values being the tiles; each tile one
    # placeholder); None: another model
    tile_masks: Any = None
    # Gemma 3: an image's tokens attend to each other both ways, so a step computes an image's tokens together (a
    # chunk never ends inside one)
    bidirectional: bool = False

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions ``start..end-1`` hold image tokens."""
        return any(offset < end and start < offset + length for offset, length in self.placeholders)

    def blocks(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The (first, end) positions of the images with tokens among positions ``start..end-1``."""
        return tuple((o, o + n) for o, n in self.placeholders if o < end and start < o + n)

    def whole_images_end(self, start: int, end: int) -> int:
        """Where a chunk of positions ``start..end-1`` must end so that no image is cut (``bidirectional``): before
        the image its end falls in, or after it where the chunk starts inside it (``start``: none fits)."""
        for offset, length in self.placeholders:
            if offset < end < offset + length:
                return offset if offset > start else start
        return end


def mrope_positions(num_prompt: int, images: ImageInputs) -> tuple[np.ndarray, int]:
    """Qwen2-VL's M-RoPE positions of a prompt with images: ``[3, num_prompt]`` (temporal, height, width) and the
    shift of every later token's position (``position = index + shift`` on all three axes). A text token's three
    positions are one, one after the previous token's largest; an image's tokens, a grid of ``height / merge`` rows
    of ``width / merge``, sit at the next position plus their (frame, row, column) in the grid; the text after it
    goes on from there plus the grid's longer side, so an image takes fewer positions than tokens."""
    assert images.grids is not None, "M-RoPE positions of a model without image grids"
    positions = np.empty((3, num_prompt), dtype=np.int64)
    next_position = index = 0
    for (offset, length), (frames, height, width) in zip(images.placeholders, images.grids):
        positions[:, index:offset] = np.arange(next_position, next_position + offset - index)
        next_position += offset - index
        rows, columns = height // images.merge_size, width // images.merge_size
        grid = np.indices((frames, rows, columns)).reshape(3, -1)
        assert grid.shape[1] == length, "an image's placeholder does not match its grid"
        positions[:, offset : offset + length] = grid + next_position
        next_position += max(rows, columns)
        index = offset + length
    positions[:, index:] = np.arange(next_position, next_position + num_prompt - index)
    return positions, int(positions.max(initial=-1)) + 1 - num_prompt


def image_cache_salt(salt: str | None, images: ImageInputs) -> str:
    """The prefix-cache namespace of a prompt with ``images``: its own salt and its images' hashes."""
    return f"{salt or ''}|images:{','.join(images.hashes)}"


IMAGE_PART_TYPES = ("image_url", "image_pil")  # a chat message's image content parts (OpenAI's; vLLM's offline PIL)


def split_chat_images(
    conversation: list[dict[str, Any]], placeholder: str, as_parts: bool = False
) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's images taken out of its messages' content parts, in order (each an image URL, or a PIL
    image from ``image_pil``), and the conversation for the chat template, as vLLM renders its content formats:
    for ``string``, a message with images becomes its text after one ``placeholder`` line per image (its texts
    joined by newlines); ``as_parts`` (``openai``), each image becomes an ``{"type": "image"}`` part where it
    stands, for the template to write the model's image tokens there. Messages without images are left as they
    are; a part of any other type is refused by name."""
    images: list[Any] = []
    rendered = []
    for message in conversation:
        content = message.get("content")
        if not _has_images(content):
            rendered.append(message)
            continue
        texts, found, parts = [], [], []
        for part in content:
            kind = _part_type(part)
            if kind == "text":
                texts.append(part.get("text") or "")
                parts.append(part)
                continue
            if kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise ValueError("an image_url content part needs image_url.url")
                found.append(url)
            elif kind == "image_pil":
                found.append(part.get("image_pil"))
            else:
                raise ValueError(f"content parts of type {kind!r} are not supported: text and images only")
            parts.append({"type": "image"})
        images += found
        text = "\n".join([placeholder] * len(found) + ["\n".join(texts)])
        rendered.append({**message, "content": parts if as_parts else text})
    return rendered, images


def has_chat_images(conversation: list[dict[str, Any]]) -> bool:
    return any(_has_images(message.get("content")) for message in conversation)


def _has_images(content: Any) -> TypeGuard[list[Any]]:
    """Whether a message's content is a list of parts with an image among them."""
    return isinstance(content, list) and any(_part_type(part) in IMAGE_PART_TYPES for part in content)


def _part_type(part: Any) -> str | None:
    return part.get("type") if isinstance(part, dict) else None
