"""What each supported architecture changes in the one Llama-shaped decoder of ``raypaged.model.llama``.

Every one is a pre-norm decoder of RMSNorms, rotate-half RoPE, GQA attention and a gated MLP; they differ in
biases, Qwen3's per-head q/k norms, Granite's four multipliers and Phi-3's checkpoint, which holds q/k/v and
gate/up fused (its partial rotation and longrope are rotary options: ``layers.RotaryEmbedding``). Gemma 2 and
Gemma 3 (text) differ most: (1 + weight) RMSNorms, a norm after the attention and one each side of the MLP, a
GeGLU MLP, embeddings times sqrt(hidden_size), ``query_pre_attn_scalar ** -0.5`` as the attention scale,
sliding-window attention on the layers ``layer_types`` marks sliding, tanh soft-capping of attention scores and
logits (Gemma 2), q/k norms and a rotary base of its own for the sliding layers (Gemma 3). Their attention runs in
the torch attention ops only (``torch_attention_reason``). Mixtral, Qwen2-MoE and Qwen3-MoE are Mistral's, Qwen2's
and Qwen3's decoders with a sparse mixture of experts in place of the MLP (``MoeSpec``, ``raypaged.model.moe``).
SmolLM3 is Llama's with no rotary on every fourth layer (``no_rope_layers``: NoPE); OLMo 2's norms come after the
attention and the MLP, and its q/k norms span whole projections (``raypaged.model.olmo2``); ERNIE 4.5 rotates
feature pairs (interleaved RoPE) and has one ``use_bias`` for every linear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PretrainedConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
    "Ernie4_5ForCausalLM",
    "GlmForCausalLM",
    "Glm4ForCausalLM",
    "Glm4MoeForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
)
_MODEL_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "granite",
    "gemma2",
    "gemma3_text",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "smollm3",
    "olmo2",
    "ernie4_5",
    "glm",
    "glm4",
    "glm4_moe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "llama4_text",
)
# attention_bias puts biases on q, k and v only (o_proj never has one)
_NO_O_BIAS = ("qwen2", "qwen2_moe", "glm", "glm4", "glm4_moe")
_GEMMA_TYPES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_MOE_TYPES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
_TORCH_ATTENTION_TYPES = {"gpt_oss": "GptOssForCausalLM", "llama4_text": "Llama4ForCausalLM"}  # torch attention only
_MLA_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A sparse mixture of experts in place of the MLP: a router picks each token's ``top_k`` of ``num_experts``
    gated (SiLU) MLPs of ``intermediate_size`` and sums their outputs weighted by the router's softmax."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top_k weights are divided by their sum (Mixtral; Qwen's norm_topk_prob)
    fp32_weights: bool  # Mixtral: the weights multiply each expert's output in fp32; Qwen: rounded to the dtype first
    shared_intermediate_size: int  # Qwen2-MoE: one more MLP every token takes, scaled by a sigmoid gate; 0: none
    sparse_layers: tuple[bool, ...]  # per layer: the experts, or the dense MLP of config.intermediate_size (Qwen's)
    # GLM-4.5 (DeepSeek-V3's router): sigmoid scores in fp32 from an fp32 router; experts chosen by score plus a
    # per-expert bias, only within the ``topk_groups`` groups (of ``num_groups`` equal ones) whose two best sum
    # highest; weights are the chosen scores (renormalized where ``renormalize``) times ``routed_scaling``.
    # DeepSeek-V2: softmax scores from an fp32 router, groups ranked by their best score (``group_score`` "max")
    scoring: str = "softmax"
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    fp32_router: bool = False  # the router's weight stays fp32 and its logits are computed in fp32
    group_score: str = "top2_sum"
    shared_gated: bool = True  # Qwen2-MoE's shared expert is scaled by a sigmoid gate; GLM-4.5's are added as they are
    router_bias: bool = False  # gpt-oss: the router's logits have a bias (a linear's)
    score_correction_bias: bool = False  # GLM-4.5, DeepSeek-V3: the sigmoid router's e_score_correction_bias
    weight_inputs: bool = False  # Llama 4: each chosen expert takes the token times its weight (not its output)
    # gpt-oss: each expert's act(gate) * up is clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate at
    # most ``limit`` and up within [-limit, limit], (alpha, limit); None: SiLU(gate) * up
    clamped_swiglu: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class Architecture:
    """One config's decoder, as its transformers model computes it."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over each head's features of q and k, before rotary
    attention_scale: float | None  # Granite's attention_multiplier; None: head_dim ** -0.5
    embedding_multiplier: float  # Granite: the embeddings are multiplied by it
    residual_multiplier: float  # Granite: each attention and MLP output, before its residual add
    logits_scaling: float  # Granite: the logits are divided by it
    fused_checkpoint: bool  # Phi-3: the checkpoint holds qkv_proj ([q; k; v] rows) and gate_up_proj ([gate; up])
    # Gemma: (1 + weight) RMSNorms, post-attention and pre/post-feedforward norms, GeGLU (gelu_pytorch_tanh), and the
    # embeddings' multiplier rounded to the model's dtype
    gemma: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer: the keys a query sees at most; empty or None: all
    rope_layer_types: tuple[str | None, ...] = ()  # per layer: its key in a per-layer-type rope_parameters (Gemma 3)
    attn_softcap: float | None = None  # Gemma 2: scores = softcap * tanh(scores / softcap), before the mask
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    moe: MoeSpec | None = None  # Mixtral, Qwen2-MoE, Qwen3-MoE: experts in place of the MLP (per ``sparse_layers``)
    nope_layers: tuple[bool, ...] = ()  # SmolLM3: per layer, whether its q and k go unrotated (NoPE); empty: none
    # OLMo 2: no norm before the attention and the MLP, one after each (before its residual add), and q and k
    # normed over their whole projection (every head together), every norm's weight applied in fp32
    olmo2: bool = False
    interleaved_rotary: bool = False  # ERNIE 4.5, GLM: RoPE rotates feature pairs (2i, 2i + 1), not halves
    fused_gate_up: bool = False  # Phi-3, GLM: the checkpoint holds gate_up_proj ([gate; up]) whole
    # GLM-4: a norm after the attention and one after the MLP too (post_self_attn_layernorm, post_mlp_layernorm), each
    # before its residual add; post_attention_layernorm is the norm before the MLP, as in Llama
    sandwich_norms: bool = False
    # DeepSeek-V3: multi-head latent attention (``mla.MlaAttention``) in place of q/k/v projections
    mla: bool = False
    # gpt-oss: a learned logit per head (its "sink") joins each query's softmax as one more column, then is dropped
    attn_sinks: bool = False
    # EmbeddingGemma (Gemma 3's use_bidirectional_attention): every token attends to its whole prompt (a sliding layer
    # to the keys fewer than sliding_window positions away on either side); prompts are computed whole
    bidirectional: bool = False
    # Llama 4: per layer, chunked attention (a query sees the keys of its own chunk of this many positions, from the
    # chunk's start) or None; q and k of its rotary layers normed (RMS, no weight) after rotary; on its NoPE layers q
    # scaled by log1p(floor((position + 1) / floor_scale)) * attn_scale + 1, (floor_scale, attn_scale); its dense
    # layers' MLPs of their own size (intermediate_size_mlp)
    attention_chunks: tuple[int | None, ...] = ()
    qk_l2_norm: bool = False
    temperature_tuning: tuple[float, float] | None = None
    dense_intermediate_size: int | None = None


# image-text checkpoints whose language model raypaged serves: the wrapper -> its language model's architecture.
# Those of IMAGE_WRAPPERS read images too (their vision tower and projector are loaded); for the others, text only is
# served (their vision tensors are not loaded; a request with an image is refused by name)
MULTIMODAL_WRAPPERS = {
    "LlavaForConditionalGeneration": "LlamaForCausalLM",  # or the causal LM of its text model's type (_LLAVA_TEXT)
    "LlavaNextForConditionalGeneration": "LlamaForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": "MistralForCausalLM",
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3MoeForCausalLM",
    "Llama4ForConditionalGeneration": "Llama4ForCausalLM",
    "Idefics3ForConditionalGeneration": "LlamaForCausalLM",  # SmolVLM's
}
# Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's: an image of any size is cut into a grid of patches, its tokens placed by
# M-RoPE
GRID_IMAGE_WRAPPERS = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
IMAGE_WRAPPERS = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    *GRID_IMAGE_WRAPPERS,
)
# LLaVA's language models: Llama (Vicuna) or Mistral (BakLLaVA, llava-v1.6-mistral)
_LLAVA_TEXT = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
# their language models' model types, as the family's (Qwen-VL's multimodal rotary is the plain one over text alone:
# a text token's three position axes are the same position)
_TEXT_MODEL_TYPES = {
    "qwen2_vl_text": "qwen2",
    "qwen2_5_vl_text": "qwen2",
    "qwen3_vl_text": "qwen3",
    "qwen3_vl_moe_text": "qwen3_moe",
}
_TOP_LEVEL_KEYS = ("tie_word_embeddings", "dtype", "quantization_config")  # read from the wrapper's config


def language_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the model raypaged runs: an image-text checkpoint's ``text_config`` (``MULTIMODAL_WRAPPERS``),
    named as its language model's architecture and marked ``raypaged_multimodal`` (the wrapper's name) so that the
    loader reads its tensors under their wrapper names and skips the vision ones; any other config as it is."""
    wrapper = next((a for a in getattr(config, "architectures", None) or [] if a in MULTIMODAL_WRAPPERS), None)
    if wrapper is None:
        return config
    text = getattr(config, "text_config", None)
    if text is None:
        raise ValueError(f"architecture {wrapper}: its config has no text_config (no language model to serve)")
    text.architectures = [MULTIMODAL_WRAPPERS[wrapper]]
    if wrapper in IMAGE_WRAPPERS:
        text.architectures = [_LLAVA_TEXT.get(text.model_type, text.architectures[0])]
    for key in _TOP_LEVEL_KEYS:
        if getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    text.raypaged_multimodal = wrapper
    return text


def image_model_config(config: PretrainedConfig) -> PretrainedConfig | None:
    """The whole config of a checkpoint whose images raypaged reads (``IMAGE_WRAPPERS``: its vision tower, projector
    and image token are in it), or None for a model of text only."""
    architectures = getattr(config, "architectures", None) or []
    return config if any(a in IMAGE_WRAPPERS for a in architectures) else None


def reads_image_grids(image_config: PretrainedConfig) -> bool:
    """Whether an image-text config's images are grids of patches placed by M-RoPE (Qwen2-VL, Qwen2.5-VL,
    Qwen3-VL)."""
    return any(a in GRID_IMAGE_WRAPPERS for a in getattr(image_config, "architectures", None) or [])


def attends_images_both_ways(image_config: PretrainedConfig) -> bool:
    """Whether an image-text model's image tokens attend to each other both ways (Gemma 3's)."""
    return "Gemma3ForConditionalGeneration" in (getattr(image_config, "architectures", None) or [])


def splits_image_rows(image_config: PretrainedConfig) -> bool:
    """Whether an image-text model's image tokens come in rows with a break token after each (Mistral 3's, Pixtral's):
    each row is its own placeholder."""
    return "Mistral3ForConditionalGeneration" in (getattr(image_config, "architectures", None) or [])


def tiles_images(image_config: PretrainedConfig) -> bool:
    """Whether an image-text model cuts each image into tiles of its tower's size plus the whole image, each tile a
    run of image tokens (Idefics3's, SmolVLM's)."""
    return "Idefics3ForConditionalGeneration" in (getattr(image_config, "architectures", None) or [])


def processor_kwargs_family(image_config: PretrainedConfig) -> str | None:
    """The family whose ``--mm-processor-kwargs`` an image-text model takes (``config.PROCESSOR_KWARGS``' key)."""
    if reads_image_grids(image_config):
        return "Qwen2-VL, Qwen2.5-VL and Qwen3-VL"
    if attends_images_both_ways(image_config):
        return "Gemma 3"
    return None


def min_image_tokens(image_config: PretrainedConfig) -> int:
    """The fewest tokens an image takes in a prompt of the image-text model: Qwen-VL's and Mistral 3's, by its size
    (one at least); Gemma 3's, ``mm_tokens_per_image``; LLaVA's, one per patch of its tower's image (LLaVA-NeXT's
    more); Idefics3's, one tile's (``image_seq_len``, the whole image when it is not split)."""
    if reads_image_grids(image_config) or splits_image_rows(image_config):
        return 1
    if attends_images_both_ways(image_config):
        return int(image_config.mm_tokens_per_image)
    if tiles_images(image_config):
        vision = image_config.vision_config
        return int((vision.image_size // vision.patch_size) ** 2 // image_config.scale_factor**2)
    vision = image_config.vision_config
    return int((vision.image_size // vision.patch_size) ** 2)


def gemma_name(config: PretrainedConfig) -> str | None:
    """The Gemma architecture of a config, or None for the others."""
    return _GEMMA_TYPES.get(config.model_type)


def attention_backends(config: PretrainedConfig) -> tuple[str, ...] | None:
    """The attention backends that run the config's attention (None: every one). DeepSeek's latent attention runs in
    the torch ops only; Gemma's, gpt-oss's and Llama 4's options of the attention (sliding windows, soft-capping,
    sinks, chunks) in the torch ops and the CPU kernels (``AttentionBackend.windows``), not the CUDA ones."""
    if config.model_type in _MLA_TYPES:
        return ("torch",)
    if gemma_name(config) is not None or config.model_type in _TORCH_ATTENTION_TYPES:
        return ("torch", "cpu")
    return None


def torch_attention_reason(config: PretrainedConfig) -> str | None:
    """Why the config's attention runs only on ``attention_backends``' backends, or None where any runs it."""
    if (mla := _MLA_TYPES.get(config.model_type)) is not None:
        return f"{mla}'s latent attention runs in the torch attention ops only"
    if config.model_type == "gpt_oss":
        return "GptOssForCausalLM's attention sinks and sliding windows run in the torch ops and the CPU kernels only"
    if config.model_type == "llama4_text":
        return "Llama4ForCausalLM's chunked attention runs in the torch ops and the CPU kernels only"
    name = gemma_name(config)
    return None if name is None else f"{name}'s sliding-window attention runs in the torch ops and the CPU kernels only"


def check_options(config: PretrainedConfig, quantized: bool, lora: bool, attention_backend: str) -> None:
    """``ValueError`` naming what the engine's options ask of this architecture that raypaged does not do for it."""
    name = gemma_name(config) or _MLA_TYPES.get(config.model_type) or _TORCH_ATTENTION_TYPES.get(config.model_type)
    if name is None:
        return
    if quantized:
        raise ValueError(f"quantized checkpoints (--quantization) are not supported for {name}")
    if lora:
        raise ValueError(f"LoRA (--enable-lora) is not supported for {name}")
    allowed = attention_backends(config) or ()
    if attention_backend not in ("auto", *allowed):
        raise ValueError(f"--attention-backend {attention_backend} cannot run {name}: {torch_attention_reason(config)}")


def applies_sliding_window(config: PretrainedConfig) -> bool:
    """Whether raypaged applies the config's ``sliding_window`` (else max_model_len stays within it)."""
    return gemma_name(config) is not None or config.model_type == "gpt_oss"


def architecture_of(config: PretrainedConfig) -> Architecture:
    """``ValueError`` for a config of a model type none of the supported architectures has."""
    model_type = _TEXT_MODEL_TYPES.get(config.model_type, config.model_type)
    if model_type not in _MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(_MODEL_TYPES)}, the "
            f"model types of {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if gemma_name(config) is not None:
        return _gemma(config)
    if model_type == "gpt_oss":
        return _gpt_oss(config)
    if model_type == "llama4_text":
        return _llama4(config)
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
    ernie = model_type == "ernie4_5"  # one use_bias for every linear
    glm = model_type in ("glm", "glm4")  # interleaved partial rotary, gate_up_proj whole
    attention_bias = bool(config.use_bias if ernie else getattr(config, "attention_bias", False))
    granite, qwen2 = model_type == "granite", model_type in ("qwen2", "qwen2_moe")
    return Architecture(
        qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and model_type not in _NO_O_BIAS,
        mlp_bias=bool(config.use_bias if ernie else getattr(config, "mlp_bias", False)),
        qk_norm=model_type in ("qwen3", "qwen3_moe") or (model_type == "glm4_moe" and bool(config.use_qk_norm)),
        attention_scale=float(config.attention_multiplier) if granite else None,
        embedding_multiplier=float(config.embedding_multiplier) if granite else 1.0,
        residual_multiplier=float(config.residual_multiplier) if granite else 1.0,
        logits_scaling=float(config.logits_scaling) if granite else 1.0,
        fused_checkpoint=model_type == "phi3",
        moe=_moe(config),
        nope_layers=tuple(not rope for rope in config.no_rope_layers) if model_type == "smollm3" else (),
        olmo2=model_type == "olmo2",
        # DeepSeek-V2 rotates by complex multiplication: pairs, always
        interleaved_rotary=ernie
        or glm
        or model_type == "deepseek_v2"
        or (model_type == "deepseek_v3" and bool(config.rope_interleave)),
        fused_gate_up=model_type == "phi3" or glm,
        sandwich_norms=model_type == "glm4",
        mla=model_type in _MLA_TYPES,
    )


def _moe(config: PretrainedConfig) -> MoeSpec | None:
    """The experts of a Mixtral, Qwen2-MoE, Qwen3-MoE or GLM-4.5 config, as transformers' ``*SparseMoeBlock`` computes
    them; None for the other architectures."""
    name = _MOE_TYPES.get(_TEXT_MODEL_TYPES.get(config.model_type, config.model_type))
    if name is None:
        return None
    layers, mixtral = config.num_hidden_layers, config.model_type == "mixtral"
    # Mixtral's and GLM-4.5's config name it num_local_experts (GLM's an alias of n_routed_experts)
    local = mixtral or config.model_type in ("glm4_moe", "deepseek_v3")
    num_experts, top_k = (config.num_local_experts if local else config.num_experts), config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{name}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    if config.model_type in ("glm4_moe", "deepseek_v3"):
        return _sigmoid_router_moe(config, name, num_experts, top_k)
    if config.model_type == "deepseek_v2":
        return _deepseek_v2_moe(config, name, num_experts, top_k)
    if mixtral:
        return MoeSpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=config.intermediate_size,
            renormalize=True,
            fp32_weights=True,
            shared_intermediate_size=0,
            sparse_layers=(True,) * layers,
        )
    dense, step = set(config.mlp_only_layers or ()), config.decoder_sparse_step
    return MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=config.moe_intermediate_size,
        # Qwen3-VL-MoE's config has no norm_topk_prob: its router always renormalizes
        renormalize=bool(getattr(config, "norm_topk_prob", True)),
        fp32_weights=False,
        shared_intermediate_size=config.shared_expert_intermediate_size if config.model_type == "qwen2_moe" else 0,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
    )


def _check_groups(name: str, num_experts: int, top_k: int, groups: int, topk_groups: int) -> None:
    if num_experts % groups or num_experts // groups < 2 or not 0 < topk_groups <= groups:
        raise ValueError(
            f"{name}: {num_experts} experts in n_group {groups} groups (of two or more experts each), topk_group "
            f"{topk_groups} of them: not a routing transformers runs"
        )
    if top_k > topk_groups * (num_experts // groups):
        raise ValueError(f"{name}: num_experts_per_tok {top_k} is more than the {topk_groups} groups chosen hold")


def _deepseek_v2_moe(config: PretrainedConfig, name: str, num_experts: int, top_k: int) -> MoeSpec:
    """DeepSeek-V2's experts: softmax scores (fp32 router), ``topk_method`` greedy or group_limited_greedy (groups
    ranked by their best score), the chosen scores times ``routed_scaling_factor`` (never renormalized:
    transformers' router does not read ``norm_topk_prob``)."""
    method = config.topk_method
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"{name}: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    groups, topk_groups = (config.n_group, config.topk_group) if method == "group_limited_greedy" else (1, 1)
    if groups > 1:
        _check_groups(name, num_experts, top_k, groups, topk_groups)
    return MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=config.moe_intermediate_size,
        renormalize=False,
        fp32_weights=True,
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(config.num_hidden_layers)),
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=float(config.routed_scaling_factor),
        shared_gated=False,
        fp32_router=True,
        group_score="max",
    )


def _sigmoid_router_moe(config: PretrainedConfig, name: str, num_experts: int, top_k: int) -> MoeSpec:
    """GLM-4.5's and DeepSeek-V3's experts (``MoeSpec.scoring`` "sigmoid")."""
    _check_groups(name, num_experts, top_k, config.n_group, config.topk_group)
    groups, topk_groups = config.n_group, config.topk_group
    return MoeSpec(
        num_experts=num_experts,
        top_k=top_k,
        intermediate_size=config.moe_intermediate_size,
        renormalize=bool(config.norm_topk_prob),
        fp32_weights=True,
        shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        sparse_layers=tuple(i >= config.first_k_dense_replace for i in range(config.num_hidden_layers)),
        scoring="sigmoid",
        num_groups=groups,
        topk_groups=topk_groups,
        routed_scaling=float(config.routed_scaling_factor),
        shared_gated=False,
        fp32_router=True,
        score_correction_bias=True,
    )


def _layer_windows(config: PretrainedConfig, name: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (``sliding_window`` on the layers ``layer_types`` marks sliding_attention, None on
    full_attention ones)."""
    layer_types = tuple(config.layer_types)
    if set(layer_types) - {"sliding_attention", "full_attention"} or len(layer_types) != config.num_hidden_layers:
        raise ValueError(
            f"{name}: layer_types must name sliding_attention or full_attention for each of the "
            f"{config.num_hidden_layers} layers, got {list(layer_types)}"
        )
    return tuple(int(config.sliding_window) if t == "sliding_attention" else None for t in layer_types)


def _unscaled(attention_bias: bool, mlp_bias: bool, **features: Any) -> Architecture:
    """An architecture with ``attention_bias`` on q, k, v and o, no q/k norm, the default attention scale and no
    multipliers (Granite's), its checkpoint's projections unfused, and ``features``."""
    return Architecture(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=mlp_bias,
        qk_norm=False,
        attention_scale=None,
        embedding_multiplier=1.0,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        fused_checkpoint=False,
        **features,
    )


def _gpt_oss(config: PretrainedConfig) -> Architecture:
    """gpt-oss: Mixtral's decoder with biases on q/k/v/o, a sink per head, sliding-window attention on alternate
    layers, and experts with biases, a router with a bias (softmax over the chosen logits) and clamped SwiGLU."""
    name = "GptOssForCausalLM"
    num_experts, top_k = config.num_local_experts, config.num_experts_per_tok
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{name}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    return _unscaled(
        bool(config.attention_bias),
        mlp_bias=True,
        sliding_windows=_layer_windows(config, name),
        moe=MoeSpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=config.intermediate_size,
            renormalize=True,  # a softmax over the chosen logits: the chosen softmax weights renormalized
            fp32_weights=False,
            shared_intermediate_size=0,
            sparse_layers=(True,) * config.num_hidden_layers,
            router_bias=True,
            clamped_swiglu=(float(config.swiglu_alpha), float(config.swiglu_limit)),
        ),
        attn_sinks=True,
    )


def _llama4(config: PretrainedConfig) -> Architecture:
    """Llama 4's text model: NoPE every ``no_rope_layers`` zero, chunked attention on the rotary layers (global on the
    NoPE ones), rotary over interleaved pairs, experts on ``moe_layers`` (a sigmoid router over the top-k logits whose
    weights scale the experts' inputs, plus an ungated shared expert) and dense MLPs of ``intermediate_size_mlp``
    elsewhere."""
    name = "Llama4ForCausalLM"
    num_experts, top_k, layers = config.num_local_experts, config.num_experts_per_tok, config.num_hidden_layers
    if not 0 < top_k <= num_experts:
        raise ValueError(f"{name}: num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    if config.hidden_act != "silu":
        raise ValueError(f"{name}: hidden_act {config.hidden_act!r} is not supported (only silu)")
    rotary = tuple(bool(r) for r in config.no_rope_layers)
    chunk = config.attention_chunk_size
    layer_types = tuple(config.layer_types)
    if (
        len(rotary) != layers
        or len(layer_types) != layers
        or set(layer_types) - {"chunked_attention", "full_attention"}
    ):
        raise ValueError(
            f"{name}: no_rope_layers and layer_types (chunked_attention or full_attention) must name each of the "
            f"{layers} layers, got {list(config.no_rope_layers)} and {layer_types}"
        )
    moe_layers = set(config.moe_layers)
    return _unscaled(
        bool(config.attention_bias),
        mlp_bias=False,
        moe=MoeSpec(
            num_experts=num_experts,
            top_k=top_k,
            intermediate_size=config.intermediate_size,
            renormalize=False,
            fp32_weights=False,
            shared_intermediate_size=config.intermediate_size,
            sparse_layers=tuple(i in moe_layers for i in range(layers)),
            scoring="sigmoid",
            shared_gated=False,
            weight_inputs=True,
        ),
        nope_layers=tuple(not r for r in rotary),
        interleaved_rotary=True,
        attention_chunks=tuple(int(chunk) if t == "chunked_attention" and chunk else None for t in layer_types),
        qk_l2_norm=bool(config.use_qk_norm),
        temperature_tuning=(float(config.floor_scale), float(config.attn_scale))
        if config.attn_temperature_tuning
        else None,
        dense_intermediate_size=int(config.intermediate_size_mlp),
    )


def _gemma(config: PretrainedConfig) -> Architecture:
    name = gemma_name(config)
    if config.hidden_activation != "gelu_pytorch_tanh":
        raise ValueError(
            f"{name}: hidden_activation {config.hidden_activation!r} is not supported (only gelu_pytorch_tanh)"
        )
    windows = _layer_windows(config, str(name))
    attention_bias = bool(config.attention_bias)
    softcap, final_softcap = config.attn_logit_softcapping, config.final_logit_softcapping
    return Architecture(
        qkv_bias=attention_bias,
        o_bias=attention_bias,
        mlp_bias=False,
        qk_norm=config.model_type == "gemma3_text",
        attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
        embedding_multiplier=float(config.hidden_size) ** 0.5,
        residual_multiplier=1.0,
        logits_scaling=1.0,
        fused_checkpoint=False,
        gemma=True,
        sliding_windows=windows,
        rope_layer_types=tuple(config.layer_types) if config.model_type == "gemma3_text" else (),
        attn_softcap=None if softcap is None else float(softcap),
        final_softcap=None if final_softcap is None else float(final_softcap),
        bidirectional=bool(getattr(config, "use_bidirectional_attention", False)),
    )
