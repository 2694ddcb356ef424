"""LLaVA-1.5's image encoder (``LlavaForConditionalGeneration``'s vision side): a CLIP vision tower and the
multi-modal projector that maps its features to the language model's hidden size.

An image of ``image_size`` pixels square is cut into ``patch_size`` patches; the tower embeds them (a convolution
without bias), puts a class token before them, adds learned position embeddings and normalizes (``pre_layrnorm``),
then runs pre-norm transformer layers in which every token attends to every other. The features are the hidden
state ``vision_feature_layer`` picks, as transformers' ``hidden_states[vision_feature_layer]`` does (0: the
embeddings; -2: the output of the second-to-last layer; a list: those states concatenated on the last dim), with
the class token dropped (``vision_feature_select_strategy`` "default") or kept ("full"); only the layers up to the
deepest one picked are built and run. ``post_layernorm`` is not used for these features. The projector is
``linear_2(act(linear_1(features)))``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from raypaged.model.vision_common import activation, load_named_weights

_LAYER = re.compile(r"^vision_tower\.encoder\.layers\.(\d+)\.")


def tower_name(name: str) -> str | None:
    """A checkpoint tensor's name inside ``LlavaImageEncoder`` (and Gemma 3's, whose tower and projector are named
    alike), None for a tensor outside the vision tower and the projector. Every layout: ``model.`` before
    ``vision_tower.``/``multi_modal_projector.`` or not (transformers 5 in memory: with it), and ``vision_model.``
    after ``vision_tower.`` or not (the published checkpoints: with it; transformers 5's ``save_pretrained``:
    without)."""
    name = name.removeprefix("model.")
    if name.startswith("vision_tower."):
        return "vision_tower." + name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return name
    return None


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the vision tower or the projector (either layout)."""
    return tower_name(name) is not None


class _Embeddings(nn.Module):
    """Patch embeddings (a convolution of stride ``patch_size``, no bias) after the class embedding, plus the
    learned position embedding of each of those ``num_patches + 1`` tokens."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, patch = config.hidden_size, config.patch_size
        self.image_size = config.image_size
        self.patch_embedding = nn.Conv2d(config.num_channels, hidden, patch, stride=patch, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.position_embedding = nn.Embedding((config.image_size // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [n, C, H, W] -> [n, 1 + patches, hidden]
        height, width = pixel_values.shape[-2:]
        if height != self.image_size or width != self.image_size:
            raise ValueError(
                f"image of {height}x{width} pixels, the vision tower takes {self.image_size}x{self.image_size}"
            )
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(len(patches), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    """Multi-head self-attention over all of an image's tokens (no mask), q/k/v and out projections with biases."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        if hidden % config.num_attention_heads:
            raise ValueError(
                f"vision hidden_size {hidden} is not a multiple of num_attention_heads {config.num_attention_heads}"
            )
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, T, hidden] -> [n, T, hidden]
        n, t, _ = x.shape
        q, k, v = (p(x).view(n, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # scale head_dim ** -0.5, as CLIP's
        return self.out_proj(out.transpose(1, 2).reshape(n, t, -1))


class _Mlp(nn.Module):
    """``fc2(act(fc1(x)))``, ``act`` being the vision config's ``hidden_act``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.act = activation(config.hidden_act, "LLaVA vision hidden_act")
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class _EncoderLayer(nn.Module):
    """Pre-norm layer: ``x + attn(layer_norm1(x))``, then ``x + mlp(layer_norm2(x))``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _Mlp(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class EncoderLayers(nn.Module):
    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(num_layers))


class _VisionTower(nn.Module):
    """CLIP's vision transformer up to its ``num_layers``-th layer, without the pooler's ``post_layernorm``."""

    def __init__(self, config: PretrainedConfig, num_layers: int) -> None:
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.pre_layrnorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.encoder = EncoderLayers(config, num_layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """The hidden states: the normalized embeddings, then each layer's output (``num_layers + 1`` of them)."""
        states = [self.pre_layrnorm(self.embeddings(pixel_values))]
        for layer in self.encoder.layers:
            states.append(layer(states[-1]))
        return states


class _Projector(nn.Module):
    """``linear_2(act(linear_1(features)))`` from the selected features to the text hidden size."""

    def __init__(self, config: PretrainedConfig, in_features: int) -> None:
        super().__init__()
        text_hidden, bias = config.text_config.hidden_size, getattr(config, "multimodal_projector_bias", True)
        self.act = activation(config.projector_hidden_act, "LLaVA projector_hidden_act")
        self.linear_1 = nn.Linear(in_features, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaImageEncoder(nn.Module):
    """Images to the embeddings that replace their image tokens in the prompt: the CLIP tower's selected features
    through the projector. Built from the whole ``LlavaConfig``; parameters are filled by ``load_weights``."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        vision = config.vision_config
        self.strategy = config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy {self.strategy!r} is not supported (default, full)")
        self.num_patches = (vision.image_size // vision.patch_size) ** 2
        layers = config.vision_feature_layer
        self.feature_layers = [layers] if isinstance(layers, int) else list(layers)
        num_states = vision.num_hidden_layers + 1  # the embeddings, then each layer's output
        for index in self.feature_layers:
            if not -num_states <= index < num_states:
                raise ValueError(f"vision_feature_layer {index} is out of range for {num_states} hidden states")
        self.num_layers = vision.num_hidden_layers
        self.vision_tower = _VisionTower(vision, max(i % num_states for i in self.feature_layers))
        self.multi_modal_projector = _Projector(config, vision.hidden_size * len(self.feature_layers))

    def tokens_per_image(self) -> int:
        """Embeddings per image: one per patch, and the class token's under the "full" strategy."""
        return self.num_patches + (1 if self.strategy == "full" else 0)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_images, 3, H, W]`` pixels (cast to the parameters' dtype and device) to
        ``[num_images, tokens_per_image, text_hidden_size]``."""
        pixel_values = pixel_values.to(self.multi_modal_projector.linear_1.weight)
        states = self.vision_tower(pixel_values)
        # an index counts the states transformers would hold (num_hidden_layers + 1), not the ones run
        features = torch.cat([states[i % (self.num_layers + 1)] for i in self.feature_layers], dim=-1)
        if self.strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def _skipped(self, name: str) -> bool:
        """Whether a vision tensor (by its module name) is one the features do not use: ``post_layernorm``, the
        layers after the deepest one selected, a saved ``position_ids`` buffer."""
        if name.startswith("vision_tower.post_layernorm.") or name.endswith(".position_ids"):
            return True
        layer = _LAYER.match(name)
        return layer is not None and len(self.vision_tower.encoder.layers) <= int(layer[1]) < self.num_layers

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the vision tower's and the projector's tensors (either layout) out of all of a checkpoint's tensors;
        the others are not read. ``ValueError`` naming a vision or projector tensor with no place or of the wrong
        shape, or the parameters left unfilled."""

        def key_of(name: str) -> str | None:
            key = tower_name(name)
            return None if key is None or self._skipped(key) else key

        load_named_weights(self, weights, key_of)
