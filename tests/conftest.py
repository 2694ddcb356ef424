"""Shared fixtures: the real SmolLM2 weights, Hugging Face references, peft adapters of SmolLM2 and tiny
random Llamas; the CPU kernels built without AVX-512."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from raypaged.attention import cpu_ops
from raypaged.model.default_model import default_model_dir
from tests.pairwise import pytest_addoption, pytest_collection_modifyitems, soak  # noqa: F401 (the run's hooks, --soak)
from tests.prebuild import pytest_collection_finish, pytest_sessionfinish  # noqa: F401 (kernels built meanwhile)

# 512 MiB of KV cache for each CPU engine the tests start without sizing it (servers, Ray shards and engine
# processes inherit it): zeroing the default 4 GiB took 3-4 s of every start on 2 cores
os.environ.setdefault("RAYPAGED_CPU_KVCACHE_SPACE", "0.5")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
RAY_NUM_CPUS = 8  # logical CPUs: enough for a tp=4 placement group on a 2-core machine


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """The test session's one local Ray instance (tests/distributed, tests/reliability)."""
    import ray

    ray.init(address="local", num_cpus=RAY_NUM_CPUS, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_dir):
    from raypaged import LLM

    return LLM(model=str(smollm2_dir), dtype="float32", num_gpu_blocks_override=1024)


# name -> LoraConfig options: different ranks, target modules (short names, full paths, all-linear) and scalings
ADAPTERS = {
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r8-rslora": {"r": 8, "lora_alpha": 16, "target_modules": "all-linear", "use_rslora": True},
    "kogd-r16": {
        "r": 16,
        "lora_alpha": 32,
        "target_modules": ["model.layers.0.self_attn.k_proj", "o_proj", "gate_proj", "down_proj"],
    },
}


def make_peft_adapter(base_dir: Path, out_dir: Path, seed: int, std: float = 0.05, base_model=None, **options) -> Path:
    """An adapter of ``base_dir``'s model saved with ``save_pretrained``: A and B drawn from N(0, std)
    (B is zero at peft's init, which would make the adapter the identity). ``base_model``: that model,
    already loaded (it gets the adapter's layers and loses them again)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = (
        base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    )
    peft_model = get_peft_model(model, LoraConfig(**options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    peft_model.save_pretrained(out_dir)
    if base_model is not None:
        peft_model.unload()
    return out_dir


@pytest.fixture(scope="session")
def smollm2_adapters(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """The ``ADAPTERS`` of SmolLM2, seeds 0, 1, 2: the LoRA tests of the engine, the model and the server."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    return {
        name: make_peft_adapter(smollm2_dir, root / name, seed, base_model=base, **options)
        for seed, (name, options) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="session")
def peft_smollm2(smollm2_dir, smollm2_adapters):
    """One PeftModel holding every adapter (``set_adapter`` picks one, ``disable_adapter`` none)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    names = list(smollm2_adapters)
    model = PeftModel.from_pretrained(base, smollm2_adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(smollm2_adapters[name], adapter_name=name)
    return model.eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Transformers' own greedy decoding of one prompt, EOS ignored."""
    return hf_greedy_batch(model, [prompt_ids], max_new_tokens)[0]


def hf_greedy_batch(model, prompts: Sequence[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Transformers' own greedy decoding of the prompts in one left-padded batch (as its batched ``generate`` is
    used), EOS ignored: one forward a token for all of them, where decoding them one by one reads the weights once
    per prompt and token."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


# the tiny random models' shape: SmolLM2's vocabulary and tokenizer, 8 heads over 2 KV heads of 8
TINY_SHAPE = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


BOS_ID = 1  # what add_bos's tokenizer puts first


def add_bos(path: Path) -> Path:
    """The model folder's tokenizer made to add a BOS (``BOS_ID``) before every text, as Llama's does (SmolLM2's
    adds none), so ``add_special_tokens`` has something to add or leave out."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    bos = tokenizer.convert_ids_to_tokens(BOS_ID)
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, BOS_ID)]
    )
    tokenizer.save_pretrained(path)
    return path


def make_tiny_model(root: Path, smollm2_dir: Path, arch: str = "llama", **overrides) -> Path:
    """A random-weight model folder of the given architecture with SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(TINY_SHAPE, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    base.update(overrides)
    return save_random(AutoModelForCausalLM, AutoConfig.for_model(arch, **base), root / arch, smollm2_dir)


def make_tiny_mistral_format(
    root: Path, smollm2_dir: Path, tokenizer: str = "tekken", arch: str = "mistral"
) -> tuple[Path, Path]:
    """A random Mistral (``arch`` ``mixtral``: a Mixtral of 4 experts, 2 a token) of TINY_SHAPE with Mistral's
    vocabulary twice: in Hugging Face's format (``root / "hf" / arch``, SmolLM2's tokenizer: transformers'
    reference) and the same weights in Mistral's own (``root / "consolidated"``: ``params.json``,
    ``consolidated.safetensors`` in Mistral's names with the query and key rows back in interleaved rotary order,
    and one of mistral_common's tokenizers: ``tekken`` as ``tekken.json``, 131,072 tokens, or ``v3``,
    SentencePiece's, as ``tokenizer.model.v3``, 32,768), written as Mistral's repositories hold them."""
    import importlib.util
    import json

    from safetensors.torch import load_file, save_file

    vocab, source, tokenizer_file = {
        "tekken": (131072, "tekken_240911.json", "tekken.json"),
        "v3": (32768, "mistral_instruct_tokenizer_240323.model.v3", "tokenizer.model.v3"),
    }[tokenizer]
    experts = {"num_local_experts": 4, "num_experts_per_tok": 2} if arch == "mixtral" else {}
    hf = make_tiny_model(root / "hf", smollm2_dir, arch, vocab_size=vocab, sliding_window=None, head_dim=8, **experts)
    out = root / "consolidated"
    out.mkdir(parents=True)
    names = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight"}
    names["lm_head.weight"] = "output.weight"
    parts = {
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
    }
    heads = {"q_proj": TINY_SHAPE["num_attention_heads"], "k_proj": TINY_SHAPE["num_key_value_heads"]}
    tensors = {}
    for name, tensor in load_file(hf / "model.safetensors").items():
        if name in names:
            tensors[names[name]] = tensor
            continue
        layer, part = name.removeprefix("model.layers.").split(".", 1)
        part = part.removesuffix(".weight")
        if part.startswith("block_sparse_moe."):  # Mixtral's router and experts (w1, w2, w3 alike in both formats)
            tensors[f"layers.{layer}.feed_forward.{part.removeprefix('block_sparse_moe.')}.weight"] = tensor
            continue
        if (n := heads.get(part.rsplit(".", 1)[-1])) is not None:  # half-split rotary order -> interleaved pairs
            rows, columns = tensor.shape
            tensor = tensor.view(n, 2, rows // n // 2, columns).transpose(1, 2).reshape(rows, columns)
        tensors[f"layers.{layer}.{parts[part]}.weight"] = tensor.contiguous()
    save_file(tensors, out / "consolidated.safetensors")
    params = {"dim": 64, "n_layers": 2, "head_dim": 8, "hidden_dim": 128, "n_heads": 8, "n_kv_heads": 2}
    params.update(norm_eps=1e-5, vocab_size=vocab, rope_theta=10000.0, max_seq_len=512)
    if experts:
        params["moe"] = {"num_experts": 4, "num_experts_per_tok": 2}
    (out / "params.json").write_text(json.dumps(params))
    shutil.copy(Path(importlib.util.find_spec("mistral_common").origin).parent / "data" / source, out / tokenizer_file)
    return hf, out


def save_random(auto_class, config, path: Path, smollm2_dir: Path) -> Path:
    """``auto_class``'s model of ``config`` with weights drawn from N(0, 0.2) (sharper than init, so greedy tokens
    are far from ties; GLM-4.5's router bias too, a buffer saved with the weights), saved at ``path`` with SmolLM2's
    tokenizer."""
    torch.manual_seed(0)
    model = auto_class.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.2)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    return path


def _tiny_image_tokenizer(smollm2_dir: Path, folder: Path, added: Sequence[str] = (), **options):
    """SmolLM2's tokenizer files copied into ``folder`` and loaded from there with ``options``, ``added`` (an image
    model's tokens) added as special tokens: the tokenizer of the tiny image models below."""
    from transformers import AutoTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder, **options)
    if added:
        tokenizer.add_special_tokens({"additional_special_tokens": list(added)})
    return tokenizer


def _save_tiny_image_model(config, path: Path, smollm2_dir: Path, std: float, *parts) -> Path:
    """``config``'s image-text model (``AutoModelForImageTextToText``) with weights drawn from N(0, ``std``) after
    seed 0, saved at ``path`` with ``parts`` (its tokenizer, processor or image processor: each ``save_pretrained``
    there) and SmolLM2's chat template."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, std)
    model.save_pretrained(path)
    for part in parts:
        part.save_pretrained(path)
    shutil.copy(smollm2_dir / "chat_template.jinja", path / "chat_template.jinja")
    return path


def make_tiny_llava(root: Path, smollm2_dir: Path, next_: bool = False) -> Path:
    """A random LLaVA-1.5 (``LlavaForConditionalGeneration``) of tiny shapes in ``root / "llava"``: a CLIP tower of
    28-pixel images in 14-pixel patches (4 tokens an image), TINY_SHAPE's Llama, SmolLM2's tokenizer and chat
    template with ``<image>`` added, weights drawn from N(0, 0.2) as ``save_random``'s. ``next_``: LLaVA-NeXT
    (``LlavaNextForConditionalGeneration``, in ``root / "llava-next"``), its images cut into a grid of 28-pixel
    patches of 28x56, 56x28 or 56x56 beside the whole image, on a Mistral language model."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaNextConfig,
        LlavaNextImageProcessor,
        LlavaNextProcessor,
        LlavaProcessor,
        MistralConfig,
    )

    name = "llava-next" if next_ else "llava"
    path = root / name
    tokenizer = _tiny_image_tokenizer(smollm2_dir, root / f"{name}-tokenizer", ["<image>"])
    text_class = MistralConfig if next_ else LlamaConfig  # as llava-v1.6-mistral, and llava-1.5's Vicuna
    text = text_class(**{**TINY_SHAPE, "vocab_size": len(tokenizer)}, tie_word_embeddings=False, eos_token_id=2)
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=14
    )
    image_token = tokenizer.convert_tokens_to_ids("<image>")
    pinpoints = [[28, 56], [56, 28], [56, 56]]
    if next_:
        config = LlavaNextConfig(
            vision_config=vision, text_config=text, image_token_index=image_token, image_grid_pinpoints=pinpoints
        )
    else:
        config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token)
    sizes = {"size": {"shortest_edge": 28}, "crop_size": {"height": 28, "width": 28}}
    options = {
        "tokenizer": tokenizer,
        "patch_size": 14,
        "vision_feature_select_strategy": "default",
        "num_additional_image_tokens": 1,  # CLIP's class token, which the default strategy then drops
    }
    processor = (
        LlavaNextProcessor(image_processor=LlavaNextImageProcessor(**sizes, image_grid_pinpoints=pinpoints), **options)
        if next_
        else LlavaProcessor(image_processor=CLIPImageProcessor(**sizes), **options)
    )
    return _save_tiny_image_model(config, path, smollm2_dir, 0.2, processor)


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def make_tiny_gemma3(root: Path, smollm2_dir: Path) -> Path:
    """A random Gemma 3 (``Gemma3ForConditionalGeneration``) of tiny shapes in ``root / "gemma3"``: a 2-layer
    Gemma 3 text model (a sliding layer of window 8, then a global one), a 2-layer SigLIP tower of 56-pixel images in
    14-pixel patches pooled to 4 tokens an image, SmolLM2's tokenizer and chat template with Gemma 3's image tokens
    added, weights drawn from N(0, 0.05) (wider ones make its greedy tokens repeat one token)."""
    from transformers import Gemma3Config, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    path = root / "gemma3"
    tokenizer = _tiny_image_tokenizer(smollm2_dir, path, extra_special_tokens=GEMMA3_TOKENS)
    boi, eoi, image = tokenizer.convert_tokens_to_ids(list(GEMMA3_TOKENS.values()))
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
        eos_token_id=2,
    )
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56)
    config = Gemma3Config(
        text_config=text,
        vision_config=dict(vision, patch_size=14),
        mm_tokens_per_image=4,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=image,
    )
    image_processor = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4)
    return _save_tiny_image_model(config, path, smollm2_dir, 0.05, processor)


PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def make_tiny_mistral3(root: Path, smollm2_dir: Path) -> Path:
    """A random Mistral 3 (``Mistral3ForConditionalGeneration``, Mistral Small 3.1's layout) of tiny shapes in
    ``root / "mistral3"``: TINY_SHAPE's Mistral, a 2-layer Pixtral tower of 14-pixel patches merged 2 x 2 (images of
    at most 112 pixels a side: up to 4 rows of 4 tokens), SmolLM2's tokenizer and chat template with Pixtral's image
    tokens added, weights drawn from N(0, 0.2) as ``save_random``'s."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    path = root / "mistral3"
    tokenizer = _tiny_image_tokenizer(smollm2_dir, path, PIXTRAL_TOKENS)
    text = MistralConfig(**{**TINY_SHAPE, "vocab_size": len(tokenizer)}, tie_word_embeddings=False, eos_token_id=2)
    vision = PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8, patch_size=14
    )
    vision.image_size = 112
    config = Mistral3Config(
        text_config=text, vision_config=vision, image_token_index=tokenizer.convert_tokens_to_ids("[IMG]")
    )
    image_processor = PixtralImageProcessorPil(size={"longest_edge": 112}, patch_size=14)
    # Pixtral's processor needs torchvision: the tokenizer and its image processor alone
    return _save_tiny_image_model(config, path, smollm2_dir, 0.2, tokenizer, image_processor)


QWEN_VL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_tiny_qwen_vl(root: Path, smollm2_dir: Path, family: str = "qwen2-vl", num_hidden_layers: int = 2) -> Path:
    """A random Qwen-VL of tiny shapes in ``root / family``: ``qwen2-vl`` (``Qwen2VLForConditionalGeneration``),
    ``qwen2.5-vl`` (with window attention in its first vision block), ``qwen3-vl`` (16-pixel patches, learned
    position embeddings of a 4 x 4 grid, deepstack features from both vision blocks, interleaved M-RoPE) or
    ``qwen3-vl-moe`` (the same on a Qwen3-MoE of 4 experts, 2 a token). TINY_SHAPE's Qwen2 (Qwen3; with
    ``num_hidden_layers`` layers) with M-RoPE
    sections (1, 1, 2) ((2, 1, 1)), a 2-block vision tower whose patches merge 2 x 2,
    SmolLM2's tokenizer and chat template with Qwen-VL's vision tokens added, weights drawn from N(0, 0.2) as
    ``save_random``'s, and an image processor that makes images of 4 to 32 merged patches (1 to 32 tokens)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig, Qwen3VLMoeConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = root / family
    tokenizer = _tiny_image_tokenizer(smollm2_dir, path, QWEN_VL_TOKENS)
    start, end, image, video = tokenizer.convert_tokens_to_ids(list(QWEN_VL_TOKENS))
    rope = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
    qwen3 = family.startswith("qwen3")
    if qwen3:
        rope.update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    text = {**TINY_SHAPE, "vocab_size": len(tokenizer), "rope_parameters": rope, "eos_token_id": 2}
    text["num_hidden_layers"] = num_hidden_layers
    text["head_dim"] = TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"]  # Qwen3's default is 128
    text["tie_word_embeddings"] = False
    if family == "qwen3-vl-moe":
        text.update(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2)
    patch = 16 if qwen3 else 14
    vision: dict = dict(patch_size=patch, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, depth=2)
    if family == "qwen2-vl":
        vision.update(embed_dim=32, hidden_size=TINY_SHAPE["hidden_size"], num_heads=4, mlp_ratio=2)
    else:
        vision.update(hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=TINY_SHAPE["hidden_size"])
        if qwen3:
            vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        else:
            vision.update(window_size=56, fullatt_block_indexes=[1])
    tokens = dict(image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end)
    config_class = {
        "qwen2-vl": Qwen2VLConfig,
        "qwen2.5-vl": Qwen2_5_VLConfig,
        "qwen3-vl": Qwen3VLConfig,
        "qwen3-vl-moe": Qwen3VLMoeConfig,
    }[family]
    config = config_class(text_config=text, vision_config=vision, tie_word_embeddings=False, **tokens)
    unit = 2 * patch  # a merged patch's side
    image_processor = Qwen2VLImageProcessorPil(patch_size=patch, min_pixels=4 * unit**2, max_pixels=32 * unit**2)
    return _save_tiny_image_model(config, path, smollm2_dir, 0.2, tokenizer, image_processor)


IDEFICS3_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
)


def make_tiny_idefics3(root: Path, smollm2_dir: Path) -> Path:
    """A random Idefics3 (``Idefics3ForConditionalGeneration``, SmolVLM's architecture) of tiny shapes in
    ``root / "idefics3"``: a 2-layer SigLIP tower of 56-pixel tiles in 14-pixel patches, pixel-shuffled 2 x 2 (4
    tokens a tile), TINY_SHAPE's Llama, SmolLM2's tokenizer and chat template with Idefics3's image tokens added,
    weights drawn from N(0, 0.2) as ``save_random``'s, and SmolVLM's processor settings at these sizes: an image's
    longest edge resized to 112 and cut into 56-pixel tiles (up to 2 x 2), the whole image after them."""
    from transformers import Idefics3Config, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    path = root / "idefics3"
    tokenizer = _tiny_image_tokenizer(smollm2_dir, path, IDEFICS3_TOKENS)
    text = {**TINY_SHAPE, "vocab_size": len(tokenizer), "tie_word_embeddings": False, "eos_token_id": 2}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56)
    config = Idefics3Config(
        vision_config=dict(vision, patch_size=14),
        text_config=dict(text, model_type="llama"),
        scale_factor=2,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        tie_word_embeddings=False,
    )
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 112}, max_image_size={"longest_edge": 56}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4)
    return _save_tiny_image_model(config, path, smollm2_dir, 0.2, processor)


def make_tiny_embedding_model(root: Path, smollm2_dir: Path, arch: str = "qwen3", **overrides) -> Path:
    """``make_tiny_model``'s weights saved as the base model (``Qwen3Model``: no head, tensor names without
    ``model.``), as embedding checkpoints are, in ``root / "<arch>-embedding"``."""
    from transformers import AutoModel

    causal = make_tiny_model(root, smollm2_dir, arch, **overrides)
    path = root / f"{arch}-embedding"
    AutoModel.from_pretrained(causal, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (causal / name).exists():
            shutil.copy(causal / name, path / name)
    return path


def use_kernels_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on in the test, ``cpu_ops.library()`` is the CPU kernels built with ``-mno-avx512f``: on a
    machine with AVX-512 their 8-wide loops (and AVX-VNNI) run, as on AVX2-only machines. Skips without AVX2."""
    if "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 here")
    library = cpu_ops.library
    monkeypatch.setattr(cpu_ops, "library", lambda: library(("-mno-avx512f",)))


@pytest.fixture
def one_call_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each step raypaged.model.cpu_step ran in one C call, as they run"""
    from raypaged.model import cpu_step

    runs: list[int] = []
    run = cpu_step.CpuStep.run

    def counted(self, model, x, *args):
        runs.append(x.shape[0])
        return run(self, model, x, *args)

    monkeypatch.setattr(cpu_step.CpuStep, "run", counted)
    return runs


CLASSIFIER_SHAPE = dict(TINY_SHAPE, pad_token_id=0)


def make_classifier(root: Path, smollm2_dir: Path, arch: str, num_labels: int) -> Path:
    """A random-weight ``*ForSequenceClassification`` of ``num_labels`` (named ``class_i`` where several) with
    SmolLM2's tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.for_model(arch, **CLASSIFIER_SHAPE, num_labels=num_labels)
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {name: i for i, name in config.id2label.items()}
    return save_random(AutoModelForSequenceClassification, config, root / f"{arch}-{num_labels}", smollm2_dir)


ENCODER_WORDS = (
    "what is paged attention a kv cache in blocks cat on mat over pages of keys bread the encoder embeds text "
    "and scores pairs query document"
).split()


def save_encoder_tokenizer(path: Path, arch: str, token_types: bool = True) -> None:
    """A small WordPiece tokenizer over ``ENCODER_WORDS`` and the letters, saved at ``path``: BERT's
    ``[CLS] A [SEP] B [SEP]`` (token types 0, then 1) for ``bert``, RoBERTa's ``<s> A </s></s> B </s>`` otherwise."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    bert = arch == "bert"
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if bert else ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = {t: i for i, t in enumerate([*specials, *ENCODER_WORDS, *letters, *("##" + c for c in letters)])}
    pad, unk, cls, sep, mask = specials
    backend = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if bert:
        backend.post_processor = processors.BertProcessing((sep, vocab[sep]), (cls, vocab[cls]))
    else:
        backend.post_processor = processors.RobertaProcessing((sep, vocab[sep]), (cls, vocab[cls]))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        unk_token=unk,
        cls_token=cls,
        sep_token=sep,
        mask_token=mask,
        bos_token=None if bert else cls,
        eos_token=None if bert else sep,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"]
        if bert and token_types
        else ["input_ids", "attention_mask"],
    )
    tokenizer.save_pretrained(path)


def make_tiny_encoder(root: Path, arch: str = "bert", num_labels: int = 0, **overrides) -> Path:
    """A random-weight BERT, XLM-RoBERTa or ModernBERT (``arch``: ``bert``, ``xlm-roberta``, ``modernbert``: a
    global layer, then two sliding ones of 4 either way) with its own small tokenizer (ModernBERT's as BERT's, one
    token type): the base model, or with ``num_labels`` its ``*ForSequenceClassification``."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    shape: dict = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    if arch == "modernbert":
        shape.update(
            num_hidden_layers=3,
            local_attention=8,
            global_attn_every_n_layers=3,
            max_position_embeddings=64,
            pad_token_id=0,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
        )
    else:
        shape.update(
            max_position_embeddings=66 if arch != "bert" else 64,
            pad_token_id=0 if arch == "bert" else 1,
            type_vocab_size=2 if arch == "bert" else 1,  # as the published checkpoints
        )
    config = AutoConfig.for_model(arch, **shape, **overrides, **({"num_labels": num_labels} if num_labels else {}))
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {name: i for i, name in config.id2label.items()}
    auto = AutoModelForSequenceClassification if num_labels else AutoModel
    path = save_random(auto, config, root / f"{arch}-{num_labels}-{len(overrides)}", root)
    save_encoder_tokenizer(path, "bert" if arch == "modernbert" else arch, token_types=arch == "bert")
    return path
