"""The one place where a request's text becomes what the engine core takes.

``InputProcessor`` tokenizes prompts, renders conversations with the chat template,
checks every request against the input gate (``raypaged/inputs/limits.py``), reads
and checks LoRA adapters, compiles structured-output grammars, and resolves the
``SamplingParams`` (the model's extra EOS ids as stop tokens, bad words as token
ids): the result is an ``EngineCoreRequest``. ``LLM``, the in-process server and the
gRPC service all go through it; servers call it off the engine thread (it never
touches the engine's state), so a huge prompt or a slow grammar stalls no step.
Bad input raises ``InputError`` (a ``ValueError``) naming the field.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from raypaged.config import EngineConfig, check_processor_kwargs
from raypaged.core.beam_search import BeamSearchParams
from raypaged.engine.core import EngineCoreRequest
from raypaged.inputs.chat_template import content_format_of, render_chat, render_chat_text
from raypaged.inputs.limits import (
    InputError,
    check_context,
    check_count,
    check_pooling_len,
    check_prompt_ids,
    check_prompt_len,
    check_sampling,
    check_text,
    check_token_ids,
)
from raypaged.inputs.media import MediaError, MediaOptions, load_image
from raypaged.inputs.multimodal_input import MultiModalInput
from raypaged.inputs.prompt_embeds import checked_prompt_embeds, embeds_salt, load_prompt_embeds, truncated
from raypaged.inputs.tokenizer import is_mistral, load_tokenizer
from raypaged.model.architecture import (
    attends_images_both_ways,
    min_image_tokens,
    reads_image_grids,
    splits_image_rows,
    tiles_images,
)
from raypaged.multimodal import ImageInputs, has_chat_images, image_cache_salt, split_chat_images
from raypaged.pooling_params import PoolingParams
from raypaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from raypaged.structured.backend import PARAM as STRUCTURED_PARAM
from raypaged.structured.backend import GrammarBackend
from raypaged.structured.reasoning import ReasoningParser, closed_in
from raypaged.structured.thinking_budget import ThinkingBudget

if TYPE_CHECKING:
    import xgrammar
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    from raypaged.lora.request import LoRARequest


_IMAGE_BREAK, _IMAGE_END = "[IMG_BREAK]", "[IMG_END]"  # Pixtral's tokens after a row of image tokens, and last


class InputProcessor:
    def __init__(self, config: EngineConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.config = config
        self.tokenizer = (
            tokenizer
            if tokenizer is not None
            else load_tokenizer(config.tokenizer_path, config.resolved_tokenizer_mode)
        )
        if len(self.tokenizer) > config.hf_config.vocab_size:
            raise ValueError(
                f"the tokenizer in {config.tokenizer_path} has {len(self.tokenizer)} tokens, more than "
                f"the model's vocabulary of {config.hf_config.vocab_size}: "
                "it is not this model's tokenizer"
            )
        self.eos_token_ids = self._eos_token_ids()
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None  # the EOS; the others stop too
        self.grammars = GrammarBackend(
            self.tokenizer, config.hf_config.vocab_size, self.eos_token_ids, config.parsed_structured_outputs_config
        )
        self._loras: dict[int, LoRARequest] = {}  # adapters checked against the model, by lora_int_id
        self._lora_lock = threading.Lock()
        self._max_token_bytes: int | None = None  # without a normalizer, the most bytes of text one token stands for
        if getattr(self.tokenizer, "is_fast", False) and self.tokenizer.backend_tokenizer.normalizer is None:
            self._max_token_bytes = max(len(t.encode()) for t in self.tokenizer.get_vocab())
        self._reasoning_ids = self._reasoning_delimiter_ids()
        self._processor: Any = None  # an image-text model's Hugging Face processor, made on its first image

    def _reasoning_delimiter_ids(self) -> tuple[list[int], list[int]] | None:
        """The token ids of a reasoning section's start and end (for ``thinking_token_budget``)."""
        delimiters = self.config.reasoning_delimiters
        if delimiters is None:
            return None
        start, end = (self._delimiter_ids(text) for text in delimiters)
        if not start or not end:
            raise ValueError(f"--reasoning-config: the reasoning section's start and end {delimiters} must be text")
        return start, end

    def _delimiter_ids(self, text: str) -> list[int]:
        """A reasoning delimiter's token ids: a control token's own id where Mistral's tokenizer has one by that name
        (it encodes a control token's name as text, as any other), else the text's tokens."""
        if is_mistral(self.tokenizer):
            token_id = self.tokenizer.convert_tokens_to_ids(text)
            if token_id in self.tokenizer.all_special_ids and self.tokenizer.convert_ids_to_tokens(token_id) == text:
                return [token_id]
        return self.tokenize(text, add_special_tokens=False)

    def _eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation, without repeats: config.json's ``eos_token_id`` (an int or
        a list), the generation config's, then the tokenizer's. The first is the EOS."""
        found = getattr(self.config.hf_config, "eos_token_id", None)
        ids = [found] if isinstance(found, int) else list(found or [])
        ids += self.config.generation_eos_token_ids
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(dict.fromkeys(ids))

    # ---- text ------------------------------------------------------------------
    def checked_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the limits and the vocabulary, with their logprobs resolved against it
        (what outputs are built by)."""
        vocab_size = self.config.hf_config.vocab_size
        check_sampling(params, vocab_size, self.config.limits)
        return params.with_vocabulary_logprobs(vocab_size)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def prompt_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's token ids (with the tokenizer's special tokens unless ``add_special_tokens`` is false), its
        size checked first; a text too long to leave room for one generated token (by a lower bound on its token
        count) is refused untokenized."""
        config = self.config
        max_model_len = config.resolved_max_model_len
        check_text("prompt", len(text), config.limits, max_model_len)
        if self._max_token_bytes is not None:
            min_tokens = -(-len(text.encode()) // self._max_token_bytes)
            if min_tokens >= max_model_len:
                raise InputError(
                    "prompt",
                    f"prompt has at least {min_tokens} tokens, which leaves no room to generate within "
                    f"max_model_len {config.max_model_len}",
                )
        return self.tokenize(text, add_special_tokens)

    def chat_ids(self, conversation: list[dict[str, Any]], **options: Any) -> list[int]:
        """A conversation's prompt token ids, rendered with the chat template (``render_chat``'s options, with its
        ``add_special_tokens``)."""
        if has_chat_images(conversation):
            raise InputError("messages", "a conversation with images is rendered with its images (chat_with_images)")
        return render_chat(self.tokenizer, conversation, self.config, **options)

    def chat_with_images(self, conversation: list[dict[str, Any]], **options: Any) -> tuple[str, list[Any]]:
        """A conversation with image content parts: its text rendered with the chat template and its images in order,
        URLs or PIL images, for ``process``. A template that loops over a message's parts (the ``openai`` content
        format) gets each image as an ``{"type": "image"}`` part where it stands and writes the image tokens itself;
        one that reads content whole (``string``) gets each image as a placeholder line before the message's text."""
        if self.config.image_hf_config is None:
            raise InputError("messages", f"the model {self.config.served_model_names[0]} reads text only (no images)")
        content_format = content_format_of(
            self.tokenizer, self.config, options.get("chat_template"), options.get("content_format")
        )
        as_parts = content_format == "openai"
        try:
            conversation, images = split_chat_images(conversation, self._image_placeholder(), as_parts)
        except ValueError as exc:
            raise InputError("messages", str(exc)) from None
        options = {**options, "content_format": content_format}  # the template renders what was split for it
        return render_chat_text(self.tokenizer, conversation, self.config, **options), images

    @property
    def media_options(self) -> MediaOptions:
        """Where a request's image URLs may point (``--allowed-local-media-path``, ``--allowed-media-domains``)."""
        config = self.config
        domains = config.allowed_media_domains
        return MediaOptions(config.allowed_local_media_path, None if domains is None else tuple(domains))

    def pair_ids(self, text_1: str, text_2: str, add_special_tokens: bool = True) -> tuple[list[int], list[int] | None]:
        """A text pair tokenized together (the tokenizer's pair template) and, where the model embeds token types
        (BERT's), the tokenizer's token types (None: all 0)."""
        from raypaged.model.encoder import uses_token_types

        encoding = self.tokenizer(text_1, text_2, add_special_tokens=add_special_tokens)
        types = encoding.get("token_type_ids") if uses_token_types(self.config.hf_config) else None
        return encoding["input_ids"], types

    def truncated_ids(self, text: str | None, token_ids: list[int], keep: int, keep_first: bool = False) -> list[int]:
        """``token_ids`` cut to ``keep`` tokens, as vLLM's ``truncate_prompt_tokens``: their last (``keep_first``:
        their first). A text's (``text``: the ids are its tokens with the special tokens the tokenizer adds) is cut as
        the tokenizer's own truncation cuts it: the special tokens around the text stay (BERT's [CLS] and [SEP], a
        BOS); ``InputError`` when ``keep`` leaves no room beside them. Token ids alone are cut as they are."""
        if len(token_ids) <= keep:
            return token_ids
        content = None if text is None else self.tokenize(text, add_special_tokens=False)
        start = None
        if content is not None:
            extra = len(token_ids) - len(content)
            start = next((i for i in range(max(extra, 0) + 1) if token_ids[i : i + len(content)] == content), None)
        if content is None or start is None:  # no text, or not its tokens with specials around them
            return token_ids[:keep] if keep_first else token_ids[-keep:]
        prefix, suffix = token_ids[:start], token_ids[start + len(content) :]
        room = keep - len(prefix) - len(suffix)
        if room < 1:
            raise InputError(
                "truncate_prompt_tokens",
                f"truncate_prompt_tokens {keep} leaves no room for the text beside the {len(prefix) + len(suffix)} "
                "special tokens the tokenizer adds",
            )
        return prefix + (content[:room] if keep_first else content[-room:]) + suffix

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would be written alone and after a space, as vLLM bans them."""
        found: list[list[int]] = []
        for word in words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = self.tokenize(text, add_special_tokens=False)
                if ids and ids not in found:
                    found.append(ids)
        return found

    def _checked_prompt(
        self,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        truncate_to: int | None = None,
        keep_first: bool = False,
    ) -> list[int]:
        """The prompt's token ids (only the last ``truncate_to`` of them, when given, as vLLM's
        ``truncate_prompt_tokens``, -1 for ``max_model_len``; the first with ``keep_first``, its ``truncation_side``
        "right"), sizes
        checked before tokenizing or copying."""
        max_model_len = self.config.resolved_max_model_len
        if prompt_token_ids is None:
            if prompt is None:
                raise InputError("prompt", "either prompt or prompt_token_ids is required")
            check_text("prompt", len(prompt), self.config.limits, max_model_len)
            prompt_token_ids = self.tokenize(prompt)
        if truncate_to is not None:
            keep = max_model_len if truncate_to == -1 else truncate_to
            prompt_token_ids = self.truncated_ids(prompt, prompt_token_ids, keep, keep_first)
        check_prompt_ids(prompt_token_ids, self.config.hf_config.vocab_size, max_model_len)
        return list(prompt_token_ids)

    # ---- images ------------------------------------------------------------------
    def image_prompt(
        self, prompt: str, images: list[Any], rendered: bool = False, options: dict[str, Any] | None = None
    ) -> tuple[list[int], ImageInputs]:
        """A text prompt with images: the model's own processor expands each image placeholder of the text into the
        image's run of tokens and makes its pixel values (``InputError`` naming ``multi_modal_data`` when the model
        reads no images, or when the placeholders and the images do not match). ``options``: the image processor's
        (``--mm-processor-kwargs`` and the request's, already checked; None: the server's). ``rendered``: the text is
        a chat template's, whose special tokens are its own (the tokenizer adds none)."""
        config = self.config
        image_config = self.check_image_count(len(images))
        check_text("prompt", len(prompt), config.limits, config.resolved_max_model_len)
        processor = self._image_processor()
        image_token = self._image_token()
        if prompt.count(image_token) != len(images):
            raise InputError(
                "multi_modal_data",
                f"the prompt has {prompt.count(image_token)} image placeholders ({image_token}) for "
                f"{len(images)} images",
            )
        if reads_image_grids(image_config):
            return self._grid_image_prompt(prompt, images, rendered, image_token, options)
        if splits_image_rows(image_config):
            return self._row_image_prompt(prompt, images, rendered, image_token)
        if options is None:  # Gemma 3's pan-and-scan
            options = self.config.mm_processor_kwargs or {}
        try:
            encoded = processor(
                text=prompt, images=images, return_tensors="pt", add_special_tokens=not rendered, **options
            )
        except (ValueError, TypeError, OSError) as exc:
            raise InputError("multi_modal_data", f"the images cannot be processed: {exc}") from None
        ids = encoded["input_ids"][0].tolist()
        pixels = encoded["pixel_values"].to(torch.float32)
        if tiles_images(image_config):
            return ids, self._tiled_images(ids, pixels[0], encoded["pixel_attention_mask"][0])
        if attends_images_both_ways(image_config):
            return ids, self._gemma_images(ids, pixels)
        sizes = [(image.height, image.width) for image in images]  # as the processor counts each image's tokens
        counts = processor._get_num_multimodal_tokens(image_sizes=sizes).num_image_tokens
        placeholders = self._placeholders(ids, counts)
        patches = None  # LLaVA-NeXT: each image's patches (base, then its grid), at their original size
        if "image_sizes" in encoded:
            from raypaged.model.llava_next_vision import num_patches

            image_sizes = tuple((int(h), int(w)) for h, w in encoded["image_sizes"].tolist())
            rows = [num_patches(image_config, size) for size in image_sizes]
            per_image = [pixels[k, :n] for k, n in enumerate(rows)]
            patches = tuple(zip(rows, image_sizes))
            pixels = torch.cat(per_image)
        else:
            per_image = list(pixels)
        hashes = tuple(hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest() for p in per_image)
        return ids, ImageInputs(pixels.contiguous(), placeholders, hashes, patches)

    def _gemma_images(self, ids: list[int], pixels: torch.Tensor) -> ImageInputs:
        """Gemma 3's images: each a run of ``mm_tokens_per_image`` tokens attending to each other both ways, and,
        with pan-and-scan (``--mm-processor-kwargs``), its crops after it, each a run (and a pixel row) of its
        own."""
        runs = self._equal_runs(ids, len(pixels), "images and crops")
        hashes = tuple(hashlib.sha256(row.contiguous().numpy().tobytes()).hexdigest() for row in pixels)
        return ImageInputs(pixels.contiguous(), runs, hashes, bidirectional=True)

    def _grid_image_prompt(
        self, prompt: str, images: list[Any], rendered: bool, image_token: str, options: dict[str, Any] | None
    ) -> tuple[list[int], ImageInputs]:
        """Qwen2-VL's ``image_prompt``: the image processor cuts each image into its grid of patches, and each
        placeholder becomes one image token per ``merge_size`` x ``merge_size`` patches of its image."""
        processor = self._image_processor()
        bounds = (self.config.mm_processor_kwargs or {}) if options is None else options
        size = {}  # --mm-processor-kwargs: the pixel bounds given, the checkpoint's for the others
        if bounds:
            least = bounds.get("min_pixels", processor.size.shortest_edge)
            size["size"] = {
                "shortest_edge": least,
                "longest_edge": bounds.get("max_pixels", processor.size.longest_edge),
            }
        try:
            encoded = processor(images=images, return_tensors="pt", **size)
        except (ValueError, TypeError, OSError) as exc:
            raise InputError("multi_modal_data", f"the images cannot be processed: {exc}") from None
        grids = tuple((int(t), int(h), int(w)) for t, h, w in encoded["image_grid_thw"].tolist())
        merge = int(processor.merge_size)
        counts = [t * h * w // merge**2 for t, h, w in grids]
        first, *rest = prompt.split(image_token)
        text = first + "".join(image_token * count + piece for count, piece in zip(counts, rest))
        ids = self.tokenizer(text, add_special_tokens=not rendered)["input_ids"]
        pixels = encoded["pixel_values"].to(torch.float32).contiguous()
        hashes, row = [], 0
        for t, h, w in grids:  # an image's hash covers its grid and its rows of patches
            digest = hashlib.sha256(f"{t}x{h}x{w}".encode())
            digest.update(pixels[row : row + t * h * w].numpy().tobytes())
            hashes.append(digest.hexdigest())
            row += t * h * w
        placeholders = self._placeholders(ids, counts)
        return ids, ImageInputs(pixels, placeholders, tuple(hashes), grids=grids, merge_size=merge)

    def _row_image_prompt(
        self, prompt: str, images: list[Any], rendered: bool, image_token: str
    ) -> tuple[list[int], ImageInputs]:
        """Mistral 3's (Pixtral's) ``image_prompt``: the image processor sizes each image to whole merged patches
        (``patch_size * spatial_merge_size`` pixels, at most its ``longest_edge``) and pads them to the largest, and
        each placeholder becomes the image's rows of image tokens, ``[IMG_BREAK]`` after each row and ``[IMG_END]``
        in place of the last, as Pixtral's processor writes them (which needs torchvision; the image processor
        alone does not). Each row of tokens is a placeholder of its own, the rows of all images in order."""
        image_config = self._image_config()
        unit = image_config.vision_config.patch_size * image_config.spatial_merge_size
        try:
            encoded = self._image_processor()(
                images=images, patch_size={"height": unit, "width": unit}, return_tensors="pt"
            )
        except (ValueError, TypeError, OSError) as exc:
            raise InputError("multi_modal_data", f"the images cannot be processed: {exc}") from None
        sizes = [(int(h), int(w)) for h, w in encoded["image_sizes"].tolist()]
        expanded = []
        for height, width in sizes:
            rows = [image_token * (width // unit) + _IMAGE_BREAK] * (height // unit)
            expanded.append("".join(rows).removesuffix(_IMAGE_BREAK) + _IMAGE_END)
        first, *rest = prompt.split(image_token)
        text = first + "".join(tokens + piece for tokens, piece in zip(expanded, rest))
        ids = self.tokenizer(text, add_special_tokens=not rendered)["input_ids"]
        pixels = encoded["pixel_values"].to(torch.float32)
        runs = self._image_runs(ids)
        expected = [w // unit for h, w in sizes for _ in range(h // unit)]
        if [length for _, length in runs] != expected:
            raise InputError(
                "multi_modal_data",
                f"the processed prompt's rows of image tokens are {[n for _, n in runs]}, the images' {expected}",
            )
        hashes = tuple(
            hashlib.sha256(pixels[k, :, :h, :w].contiguous().numpy().tobytes()).hexdigest()
            for k, (h, w) in enumerate(sizes)
        )
        return ids, ImageInputs(pixels.contiguous(), runs, hashes, image_sizes=tuple(sizes))

    def _tiled_images(self, ids: list[int], pixels: torch.Tensor, masks: torch.Tensor) -> ImageInputs:
        """Idefics3's (SmolVLM's) images: each is its tiles (its grid's, row by row, then the whole image), the
        prompt's tiles padded with all-zero ones to the batch's most, each tile a run of ``image_seq_len`` image
        tokens: the real tiles and their pixel masks, each run a placeholder of its own."""
        real = pixels.flatten(1).any(dim=1)  # transformers drops the all-zero padding tiles
        pixels, masks = pixels[real].contiguous(), masks[real].bool().contiguous()
        runs = self._equal_runs(ids, len(pixels), "tiles")
        hashes = tuple(hashlib.sha256(tile.numpy().tobytes()).hexdigest() for tile in pixels)
        return ImageInputs(pixels, runs, hashes, tile_masks=masks)

    def _processor_options(self, given: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request's ``mm_processor_kwargs`` checked (``config.check_processor_kwargs``) over the server's
        ``--mm-processor-kwargs``; None: the server's alone."""
        if not given:
            return None
        try:
            check_processor_kwargs(self.config.image_hf_config, given, "mm_processor_kwargs")
        except ValueError as exc:
            raise InputError("mm_processor_kwargs", str(exc)) from None
        return {**(self.config.mm_processor_kwargs or {}), **given}

    def _equal_runs(self, ids: list[int], count: int, what: str) -> tuple[tuple[int, int], ...]:
        """The prompt's runs of image tokens, which must be ``count`` runs (one a pixel row: ``what``) of the model's
        tokens an image each; ``InputError`` else."""
        runs = self._image_runs(ids)
        per_run = min_image_tokens(self._image_config())
        if len(runs) != count or any(length != per_run for _, length in runs):
            raise InputError(
                "multi_modal_data",
                f"the processed prompt's runs of image tokens are {[n for _, n in runs]}, for {count} {what} of "
                f"{per_run} tokens",
            )
        return runs

    def _image_runs(self, ids: list[int]) -> tuple[tuple[int, int], ...]:
        """(first position, length) of each run of image tokens in a processed prompt, in order."""
        token_id = self._image_token_id()
        runs: list[list[int]] = []
        for position, token in enumerate(ids):
            if token != token_id:
                continue
            if runs and runs[-1][0] + runs[-1][1] == position:
                runs[-1][1] += 1
            else:
                runs.append([position, 1])
        return tuple((first, length) for first, length in runs)

    def _placeholders(self, ids: list[int], counts: list[int]) -> tuple[tuple[int, int], ...]:
        """Each image's (first position, number of tokens) in a processed prompt whose images have ``counts``
        tokens; ``InputError`` where the image tokens are not one run of that many an image."""
        token_id = self._image_token_id()
        positions = [i for i, t in enumerate(ids) if t == token_id]
        if sum(counts) != len(positions):
            raise InputError(
                "multi_modal_data", f"the processed prompt has {len(positions)} image tokens, not {sum(counts)}"
            )
        placeholders = []
        for count in counts:
            run, positions = positions[:count], positions[count:]
            if run[-1] - run[0] + 1 != count:
                raise InputError("multi_modal_data", "an image's tokens are not one run in the processed prompt")
            placeholders.append((run[0], count))
        return tuple(placeholders)

    def loaded(self, image: Any) -> Any:
        """A request's image: a PIL image as it is, a URL loaded (``media.load_image``: data, http(s), file)."""
        if not isinstance(image, str):
            return image
        try:
            return load_image(image, self.media_options)
        except MediaError as exc:
            raise InputError(exc.param, str(exc)) from None

    def check_image_count(self, count: int) -> PretrainedConfig:
        """``InputError`` for images on a model of text only, for more images than ``--limit-mm-per-prompt``
        allows, or than the context holds (checked before any image is fetched, decoded or processed); else the
        model's image config."""
        config = self.config
        image_config = config.image_hf_config
        if image_config is None:
            raise InputError(
                "multi_modal_data", f"the model {config.served_model_names[0]} reads text only (no images)"
            )
        limit = config.images_per_prompt
        if limit is not None and count > limit:
            raise InputError("multi_modal_data", f"{count} images in one prompt; --limit-mm-per-prompt allows {limit}")
        per_image = min_image_tokens(image_config)
        if count * per_image >= config.resolved_max_model_len:
            raise InputError(
                "multi_modal_data",
                f"{count} images of {per_image} tokens each leave no room in max_model_len "
                f"{config.resolved_max_model_len}",
            )
        return image_config

    def _image_processor(self) -> Any:
        """The model's Hugging Face processor (its image processor, with this engine's tokenizer), made once;
        Qwen-VL's and Mistral 3's image processor alone (their processors need torchvision, for a video processor or
        Pixtral's; placeholders are expanded as ``_grid_image_prompt`` and ``_row_image_prompt`` do)."""
        if self._processor is None:
            from transformers import AutoImageProcessor, AutoProcessor

            path, image_config = self.config.model_path, self._image_config()
            try:
                if reads_image_grids(image_config) or splits_image_rows(image_config):
                    self._processor = AutoImageProcessor.from_pretrained(path)
                else:
                    self._processor = AutoProcessor.from_pretrained(path, tokenizer=self.tokenizer)
            except (OSError, ValueError, ImportError) as exc:  # the request fails alone, saying why
                raise InputError("multi_modal_data", f"the model's image processor cannot be loaded: {exc}") from None
        return self._processor

    def _image_config(self) -> PretrainedConfig:
        image_config = self.config.image_hf_config
        assert image_config is not None, "images on a model of text only"
        return image_config

    def _image_token_id(self) -> int:
        image_config = self._image_config()
        token_id = getattr(image_config, "image_token_id", None)  # Qwen2-VL's name; LLaVA's image_token_index
        return int(image_config.image_token_index if token_id is None else token_id)

    def _image_token(self) -> str:
        """The token a prompt holds for each of its images, which the processor expands (Qwen-VL's: the image token
        itself; Gemma 3's: its begin-image token)."""
        image_config = self._image_config()
        if reads_image_grids(image_config) or splits_image_rows(image_config):
            return str(self.tokenizer.convert_ids_to_tokens(self._image_token_id()))
        return str(self._image_processor().image_token)

    def _image_placeholder(self) -> str:
        """What a chat message holds for each of its images: the image token, between Qwen2-VL's vision start
        and end tokens."""
        image_config, token = self._image_config(), self._image_token()
        if not reads_image_grids(image_config):
            return token
        start, end = self.tokenizer.convert_ids_to_tokens(
            [image_config.vision_start_token_id, image_config.vision_end_token_id]
        )
        return f"{start}{token}{end}"

    # ---- constraints and adapters ----------------------------------------------
    def compile_grammar(
        self, structured: StructuredOutputsParams, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> xgrammar.CompiledGrammar:
        """The constraint's grammar for this prompt, its size checked first; thread-safe (compiled
        grammars are cached). With a reasoning parser the constraint applies after the output's
        reasoning section, unless the prompt closed that section itself."""
        check_text(STRUCTURED_PARAM, structured.num_chars, self.config.limits, self.config.resolved_max_model_len)
        return self.grammars.compile(structured, self._reasoning(structured, prompt, prompt_token_ids))

    def grammar_is_cached(
        self, structured: StructuredOutputsParams, prompt: str | None = None, prompt_token_ids: list[int] | None = None
    ) -> bool:
        """Whether ``compile_grammar`` would find the grammar compiled (it then neither compiles nor waits)."""
        return self.grammars.cached(structured, self._reasoning(structured, prompt, prompt_token_ids)) is not None

    def _reasoning(
        self, structured: StructuredOutputsParams, prompt: str | None, prompt_token_ids: list[int] | None
    ) -> ReasoningParser | None:
        """The reasoning section the constraint waits for: none where it applies in reasoning too, or where the
        prompt closed that section itself."""
        reasoning = None if structured.in_reasoning else self.config.parsed_structured_outputs_config.reasoning
        if reasoning is not None:
            tail = (
                prompt[-64:]
                if prompt_token_ids is None and prompt is not None
                else self.tokenizer.decode((prompt_token_ids or [])[-16:])
            )
            if closed_in(tail, reasoning.end):
                return None
        return reasoning

    def check_lora(self, lora: LoRARequest) -> LoRARequest:
        """The adapter, read and checked against the model once per ``lora_int_id`` (``InputError``
        naming what does not fit: its rank, a module the model lacks, another adapter's id)."""
        if self.config.lora_config is None:
            raise InputError(
                "lora_request",
                f"LoRA adapter {lora.lora_name!r} asked for, but LoRA is off (--enable-lora, LLM(enable_lora=True))",
            )
        with self._lora_lock:  # servers check adapters on several threads
            if (known := self._known_lora(lora)) is not None:
                return known
        from raypaged.lora.layout import read_checked_adapter

        try:
            read_checked_adapter(lora, self.config.hf_config, self.config.lora_config.max_lora_rank)
        except (ValueError, OSError) as exc:
            raise InputError("lora_request", str(exc)) from None
        with self._lora_lock:
            if (known := self._known_lora(lora)) is not None:
                return known
            self._loras[lora.lora_int_id] = lora
        return lora

    def _known_lora(self, lora: LoRARequest) -> LoRARequest | None:
        """The adapter already checked, ``None`` for a new one; one clashing with another raises."""
        known = self._loras.get(lora.lora_int_id)
        if known is not None and known.lora_name == lora.lora_name and known.lora_path == lora.lora_path:
            return known
        for other in self._loras.values():
            if other.lora_int_id == lora.lora_int_id or other.lora_name == lora.lora_name:
                raise InputError(
                    "lora_request",
                    f"LoRA adapter {lora.lora_name!r} (lora_int_id {lora.lora_int_id}) "
                    f"clashes with {other.lora_name!r} (lora_int_id {other.lora_int_id}, "
                    f"{other.lora_path}): each name and id belongs to one adapter",
                )
        return None

    def lora(self, lora_int_id: int) -> LoRARequest | None:
        return self._loras.get(lora_int_id)

    def forget_lora(self, lora_int_id: int) -> None:
        with self._lora_lock:
            self._loras.pop(lora_int_id, None)

    # ---- requests --------------------------------------------------------------
    def _multi_modal_prompt(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams, given: MultiModalInput
    ) -> tuple[list[int], ImageInputs]:
        """A text prompt's token ids with its images' placeholders expanded, and the images' inputs."""
        if not given.images:
            raise InputError("mm_processor_kwargs", "mm_processor_kwargs applies to a request with images")
        self.check_image_count(len(given.images))  # before any is fetched or decoded
        images = [self.loaded(image) for image in given.images]
        if prompt_token_ids is not None or prompt is None:
            raise InputError("multi_modal_data", "images go with a text prompt (its image placeholders), not ids")
        if params.truncate_prompt_tokens is not None:
            raise InputError("truncate_prompt_tokens", "truncate_prompt_tokens would cut a prompt's image tokens")
        options = self._processor_options(given.processor_kwargs)
        return self.image_prompt(prompt, images, given.rendered, options)

    def _prompt_embeds(self, given: Any, params: SamplingParams) -> torch.Tensor:
        """A request's ``prompt_embeds`` checked (``inputs/prompt_embeds.py``) and truncated as its
        ``truncate_prompt_tokens`` asks; what needs the prompt's token ids is refused by name."""
        config = self.config
        if not config.enable_prompt_embeds:
            raise InputError("prompt_embeds", "prompt_embeds needs the engine started with --enable-prompt-embeds")
        if params.prompt_logprobs is not None:
            raise InputError("prompt_logprobs", "prompt_logprobs needs the prompt's token ids, not prompt_embeds")
        tensor = checked_prompt_embeds(
            load_prompt_embeds(given) if isinstance(given, bytes) else given, config.hf_config.hidden_size
        )
        keep = params.truncate_prompt_tokens
        if keep == -1:
            keep = config.resolved_max_model_len
        return truncated(tensor, keep, params.truncation_side == "right")

    def process(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        multi_modal: MultiModalInput | None = None,
        prompt_embeds: Any = None,
    ) -> tuple[SamplingParams, EngineCoreRequest]:
        """The request checked and resolved: the caller's params (logprobs resolved against the
        vocabulary: what outputs are built by) and the core's request (``request_id`` is the id
        of its first sequence). ``multi_modal``: the images for the image placeholders of the text ``prompt``
        (``image_prompt``) with their options. ``prompt_embeds``: the prompt as embedding rows (a tensor, or the
        bytes ``torch.save`` wrote), instead of ``prompt``/``prompt_token_ids`` (``--enable-prompt-embeds``)."""
        config = self.config
        if config.pooler is not None:
            raise _not_generative(config)
        lora = None if lora_request is None else self.check_lora(lora_request)
        params = self.checked_params(params)
        image_inputs = None
        if multi_modal is not None and (multi_modal.images or multi_modal.processor_kwargs):
            prompt_token_ids, image_inputs = self._multi_modal_prompt(prompt, prompt_token_ids, params, multi_modal)
            cache_salt = image_cache_salt(cache_salt, image_inputs)
        if prompt_embeds is not None:
            if multi_modal is not None or prompt_token_ids is not None or prompt is not None:
                raise InputError("prompt_embeds", "prompt_embeds is the whole prompt: no text, ids or images beside it")
            prompt_embeds = self._prompt_embeds(prompt_embeds, params)
            check_prompt_len(prompt_embeds.shape[0], config.resolved_max_model_len)
            prompt_token_ids = [0] * prompt_embeds.shape[0]  # placeholders: the rows replace them
            known_ids: list[int] = []  # the prompt's token ids as grammars and thinking budgets read them: none
            cache_salt = embeds_salt(cache_salt, prompt_embeds)
        else:
            prompt_token_ids = known_ids = self._checked_prompt(
                prompt, prompt_token_ids, params.truncate_prompt_tokens, params.truncation_side == "right"
            )
        max_model_len = config.resolved_max_model_len
        check_context(len(prompt_token_ids), params.max_tokens, max_model_len)
        max_tokens = params.max_tokens or max_model_len - len(prompt_token_ids)
        matchers = []
        if (structured := params.structured_outputs) is not None:  # cached when a server compiled it already
            grammar = self.compile_grammar(structured, prompt, known_ids)
            matchers = [self.grammars.matcher(grammar) for _ in range(params.num_samples)]
        if params.thinking_token_budget is not None:
            matchers = self._thinking_budgets(params, known_ids, matchers)
        seq_params = self._with_eos_stops(params)
        if params.bad_words:
            seq_params = replace(seq_params, bad_words_token_ids=self._bad_words_token_ids(params.bad_words))
        spec = config.parsed_speculative_config
        return params, EngineCoreRequest(
            request_id,
            prompt_token_ids,
            seq_params,
            max_tokens,
            priority=priority,
            cache_salt=_prefix_namespace(cache_salt, lora),
            lora=lora,
            matchers=matchers,
            num_spec_tokens=0 if spec is None else spec.num_speculative_tokens,
            images=image_inputs,
            prompt_embeds=prompt_embeds,
        )

    def _thinking_budgets(self, params: SamplingParams, prompt_token_ids: list[int], grammars: list) -> list:
        """A ``ThinkingBudget`` per sample, over its grammar matcher if it has one."""
        if self._reasoning_ids is None:
            raise InputError(
                "thinking_token_budget",
                "thinking_token_budget needs to know where a reasoning section starts and ends: serve with "
                "--reasoning-parser or --reasoning-config",
            )
        assert params.thinking_token_budget is not None
        start, end = self._reasoning_ids
        inner = grammars or [None] * params.num_samples
        return [ThinkingBudget(params.thinking_token_budget, start, end, prompt_token_ids, m) for m in inner]

    def process_beam_search(
        self,
        request_id: str,
        prompt: str | None,
        params: BeamSearchParams,
        prompt_token_ids: list[int] | None = None,
        lora_request: LoRARequest | None = None,
        cache_salt: str | None = None,
    ) -> tuple[SamplingParams, EngineCoreRequest]:
        """A beam search checked: its beams' params (greedy, the ``2 * beam_width`` best next
        tokens as logprobs) and the core's request."""
        config = self.config
        if config.pooler is not None:
            raise _not_generative(config)
        check_count("n", params.beam_width, config.limits.max_num_samples, "max_num_samples", "beams")
        lora = None if lora_request is None else self.check_lora(lora_request)
        prompt_token_ids = self._checked_prompt(prompt, prompt_token_ids)
        max_tokens = min(params.max_tokens, config.resolved_max_model_len - len(prompt_token_ids))
        matchers = []
        if params.structured_outputs is not None:
            matchers = [
                self.grammars.matcher(self.compile_grammar(params.structured_outputs, prompt, prompt_token_ids))
            ]
        beam_params = SamplingParams(
            temperature=0, max_tokens=max_tokens, logprobs=2 * params.beam_width, ignore_eos=True
        )
        return beam_params, EngineCoreRequest(
            request_id,
            prompt_token_ids,
            beam_params,
            max_tokens,
            cache_salt=_prefix_namespace(cache_salt, lora),
            lora=lora,
            matchers=matchers,
            beam=params,
        )

    def process_pooling(
        self,
        request_id: str,
        prompt: str | None,
        params: PoolingParams,
        prompt_token_ids: list[int] | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> tuple[SamplingParams, EngineCoreRequest]:
        """An embedding request checked: the params its one output is built by (final only, no tokens) and the
        core's request, which ends when its prompt is computed. The prompt may fill ``max_model_len`` (nothing is
        generated after it); ``truncate_prompt_tokens`` keeps its last tokens (-1: ``max_model_len`` of them).
        ``token_type_ids``: a BERT text pair's, one per token (the tokenizer's: 0 for the first text, 1 for the
        second), cut with the prompt."""
        config = self.config
        pooler = config.pooler
        if pooler is None:
            raise InputError(
                "model",
                f"{config.served_model_name} is a generative model: embeddings need an embedding model "
                "(--runner pooling)",
            )
        pooler.check(params)
        max_model_len = config.resolved_max_model_len
        truncate = params.truncate_prompt_tokens
        if prompt_token_ids is None:
            if prompt is None:
                raise InputError("input", "either a prompt or its token ids is required")
            check_text("input", len(prompt), config.limits, max_model_len)
            prompt_token_ids = self.tokenize(prompt)
        token_type_start = None if token_type_ids is None else self._token_type_start(prompt_token_ids, token_type_ids)
        if truncate is not None:
            keep = max_model_len if truncate == -1 else truncate
            if token_type_ids is None:
                prompt_token_ids = self.truncated_ids(prompt, prompt_token_ids, keep)
            else:  # a pair's ids and types, cut together
                cut = max(0, len(prompt_token_ids) - keep)
                prompt_token_ids = prompt_token_ids[cut:]
                if token_type_start is not None:
                    token_type_start = max(0, token_type_start - cut)
        check_pooling_len(len(prompt_token_ids), max_model_len)
        check_token_ids("input", prompt_token_ids, config.hf_config.vocab_size)
        seq_params = SamplingParams(max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)
        return seq_params, EngineCoreRequest(
            request_id,
            list(prompt_token_ids),
            seq_params,
            1,
            priority=priority,
            cache_salt=_prefix_namespace(cache_salt, None),
            pooling=params,
            token_type_start=token_type_start,
        )

    def _token_type_start(self, prompt_token_ids: list[int], token_type_ids: list[int]) -> int | None:
        """The first token of type 1 (None: all are 0); ``InputError`` for types this model does not have, or not
        one per token, or a type 0 after a type 1 (a text pair's types are the first text's 0s, then 1s)."""
        from raypaged.model.encoder import uses_token_types

        if len(token_type_ids) != len(prompt_token_ids):
            raise InputError(
                "token_type_ids",
                f"token_type_ids has {len(token_type_ids)} entries for {len(prompt_token_ids)} prompt tokens",
            )
        start = next((i for i, t in enumerate(token_type_ids) if t != 0), None)
        if start is None:
            return None
        if not uses_token_types(self.config.hf_config):
            raise InputError("token_type_ids", "this model has one token type (0): token_type_ids must all be 0")
        if any(t != 1 for t in token_type_ids[start:]):
            raise InputError(
                "token_type_ids", "token_type_ids must be 0s then 1s (a text pair's first and second texts)"
            )
        return start

    def _with_eos_stops(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the EOS ids after the first among its stop tokens, as vLLM adds a generation
        config's extra EOS ids to ``stop_token_ids``: such a stop reports its id as ``stop_reason`` and
        ``min_tokens`` bans it. ``ignore_eos`` ignores every EOS id, as in vLLM."""
        extra = [token_id for token_id in self.eos_token_ids[1:] if token_id not in params.stop_token_ids]
        if params.ignore_eos or not extra:
            return params
        return replace(params, stop_token_ids=params.stop_token_ids + extra)


def _not_generative(config: EngineConfig) -> InputError:
    """A generation request to a pooling model, refused naming what the model serves."""
    assert config.pooler is not None
    serves = (
        "an embedding model (--runner pooling): it serves embeddings (/v1/embeddings, /pooling, LLM.embed)"
        if config.pooler.task == "embed"
        else "a classifier (--runner pooling): it serves its scores (/classify, /score, /rerank, LLM.classify)"
    )
    return InputError("model", f"{config.served_model_name} is {serves}, not generation")


def _prefix_namespace(cache_salt: str | None, lora: LoRARequest | None) -> str | None:
    """The prefix-cache namespace of a request: its salt and its adapter (``None``: the shared one).
    The adapter id comes first, before a ``|``: distinct (salt, adapter) pairs never meet."""
    if lora is None and cache_salt is None:
        return None
    return f"{lora.lora_int_id if lora is not None else 0}|{cache_salt or ''}"
