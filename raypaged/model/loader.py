"""Build a model from a Hugging Face folder of safetensors files."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from raypaged.model import mistral_format
from raypaged.model.architecture import attends_images_both_ways, reads_image_grids, splits_image_rows, tiles_images
from raypaged.model.encoder import Encoder, build_encoder, is_encoder
from raypaged.model.layers import pack_linears, packs_weights
from raypaged.model.llama import LlamaForCausalLM
from raypaged.model.llava_vision import LlavaImageEncoder, is_vision_tensor
from raypaged.model.moe import grouped_gemms_run
from raypaged.model.parallel import TensorParallel
from raypaged.quantization.base import QuantizationConfig
from raypaged.quantization.linear import cast_model, finish_loading

if TYPE_CHECKING:
    from raypaged.model.gemma3_vision import Gemma3ImageEncoder
    from raypaged.model.idefics3_vision import Idefics3ImageEncoder
    from raypaged.model.llava_next_vision import LlavaNextImageEncoder
    from raypaged.model.pixtral_vision import Mistral3ImageEncoder
    from raypaged.model.qwen2_vl_vision import Qwen2VLImageEncoder
    from raypaged.model.qwen3_vl_vision import Qwen3VLImageEncoder

    ImageEncoder = (
        LlavaImageEncoder
        | LlavaNextImageEncoder
        | Gemma3ImageEncoder
        | Idefics3ImageEncoder
        | Mistral3ImageEncoder
        | Qwen2VLImageEncoder
        | Qwen3VLImageEncoder
    )


def iter_checkpoint(
    model_path: Path, select: Callable[[str], bool] | None = None, pattern: str = "*.safetensors"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the folder's safetensors files (``select``: only the names it takes are read). Hugging Face's
    files (``pattern`` left as it is) leave out Mistral's ``consolidated*.safetensors`` of a folder that holds both
    formats, as vLLM does."""
    files = sorted(model_path.glob(pattern))
    hf_files = [file for file in files if not fnmatch(file.name, mistral_format.WEIGHTS_GLOB)]
    if pattern == "*.safetensors" and hf_files != files:
        if not hf_files:
            raise ValueError(
                f"no Hugging Face *.safetensors weights in {model_path}, only Mistral's consolidated*.safetensors "
                "(--load-format mistral reads them)"
            )
        files = hf_files
    if not files:
        raise ValueError(f"no {pattern} weights in {model_path}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if select is None or select(name):
                    yield name, f.get_tensor(name)


def load_image_encoder(
    model_path: Path,
    image_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    bf16_linears: bool = False,
) -> ImageEncoder:
    """An image-text checkpoint's vision tower and projector (whole on every tensor-parallel rank), in ``dtype``:
    LLaVA-1.5's, LLaVA-NeXT's (which packs each image's grid of patches), or Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's
    (images of any size in patches, merged; Qwen3-VL's with deepstack features). ``bf16_linears``: as
    :func:`load_model`'s."""
    encoder: ImageEncoder
    select = is_vision_tensor
    with torch.device(device), default_dtype(dtype):
        if tiles_images(image_config):
            from raypaged.model.idefics3_vision import Idefics3ImageEncoder, is_idefics3_vision_tensor

            encoder, select = Idefics3ImageEncoder(image_config), is_idefics3_vision_tensor
        elif splits_image_rows(image_config):
            from raypaged.model.pixtral_vision import Mistral3ImageEncoder, is_pixtral_vision_tensor

            encoder, select = Mistral3ImageEncoder(image_config), is_pixtral_vision_tensor
        elif attends_images_both_ways(image_config):
            from raypaged.model.gemma3_vision import Gemma3ImageEncoder, is_gemma3_vision_tensor

            encoder, select = Gemma3ImageEncoder(image_config), is_gemma3_vision_tensor
        elif image_config.model_type in ("qwen3_vl", "qwen3_vl_moe"):
            from raypaged.model.qwen3_vl_vision import Qwen3VLImageEncoder, is_qwen3_vl_vision_tensor

            encoder, select = Qwen3VLImageEncoder(image_config), is_qwen3_vl_vision_tensor
        elif reads_image_grids(image_config):
            from raypaged.model.qwen2_vl_vision import Qwen2VLImageEncoder, is_qwen2_vl_vision_tensor

            encoder, select = Qwen2VLImageEncoder(image_config), is_qwen2_vl_vision_tensor
        elif "LlavaNextForConditionalGeneration" in (image_config.architectures or []):
            from raypaged.model.llava_next_vision import LlavaNextImageEncoder, is_next_vision_tensor

            encoder, select = LlavaNextImageEncoder(image_config), is_next_vision_tensor
        else:
            encoder = LlavaImageEncoder(image_config)
    if load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for param in encoder.parameters():
                param.uniform_(-1e-3, 1e-3, generator=generator)
    else:
        encoder.load_weights(iter_checkpoint(model_path, select))
    encoder = encoder.to(dtype).eval()
    if packs_weights(dtype, device):  # its linears through the model's CPU GEMM
        pack_linears(encoder, bf16_linears)
    return encoder


def load_model(
    model_path: Path,
    hf_config: PretrainedConfig,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = TensorParallel(),
    load_format: str = "auto",
    seed: int = 0,
    quant_config: QuantizationConfig | None = None,
    head: bool = True,
    num_labels: int = 0,
    bf16_linears: bool = False,
) -> LlamaForCausalLM:
    """This rank's shard of the model: each checkpoint tensor is read, sliced and dropped in turn.

    ``load_format="dummy"``: no checkpoint is read; every weight is drawn uniformly from
    [-1e-3, 1e-3] (norm weights are 1), built directly in ``dtype`` on the device, so a
    7B-shaped model is ready in seconds for benchmarks; quantized layers then quantize them as
    ``quant_config`` does online (fp8 only: other schemes need their checkpoint's tensors).
    ``quant_config``: the projections' scheme; their quantized tensors keep their own dtypes. ``head`` False: an
    embedding model's, without the language-model head (a checkpoint's ``lm_head`` tensors are skipped); ``num_labels``:
    a classifier's, with its ``score`` head of that many labels. ``bf16_linears`` (``layers.bf16_linears_on_cpu``):
    a bf16 model on CPU, built and computed in fp32 (``dtype``) with its float linears' weights packed in bf16.
    An fp32 model on a CPU ends with its float linears' weights packed for oneDNN (``pack_weights``); a bf16 mixture
    of experts on an H100 or H200 with its experts' weights stacked for grouped GEMMs (``stack_experts``).
    """
    model: LlamaForCausalLM | Encoder
    # built in its dtype: a bf16 model never takes fp32's memory, nor does one computing in fp32 from bf16 linears
    # (bf16_linears), whose float linears and embeddings keep their bf16 weights until packed, the rest made fp32
    with torch.device(device), default_dtype(torch.bfloat16 if bf16_linears else dtype):
        if is_encoder(hf_config):  # their own modules: no KV cache, no fused, packed or quantized paths
            model = build_encoder(hf_config, num_labels)
        else:
            model = LlamaForCausalLM(hf_config, max_positions, tp, quant_config, head, num_labels)
    if load_format == "dummy":
        fill_dummy(model, dtype, device, seed + tp.rank, bf16_linears)
    else:
        if mistral_format.reads_mistral_weights(model_path, load_format, hf_config):
            consolidated = iter_checkpoint(model_path, pattern=mistral_format.WEIGHTS_GLOB)
            tensors = mistral_format.hf_weights(consolidated, hf_config)
        else:
            tensors = iter_checkpoint(model_path)
        model.load_weights(tensors)
        cast_model(model, dtype, bf16_linears)
    if isinstance(model, Encoder):
        return cast(LlamaForCausalLM, model.eval())  # the runner's model: the same calls as a decoder's
    finish_loading(model)
    if packs_weights(dtype, device):
        model.pack_weights(bf16_linears)
    elif model.architecture.moe is not None and grouped_gemms_run(dtype, device):
        model.stack_experts()
    return model.eval()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """torch's default float dtype set to ``dtype`` within (parameters that keep their own dtype, as quantized tensors
    and fp32 routers, name it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def fill_dummy(
    model: LlamaForCausalLM | Encoder, dtype: torch.dtype, device: torch.device, seed: int, bf16_linears: bool = False
) -> None:
    """Every weight drawn uniformly from [-1e-3, 1e-3] (norms scale by 1: Gemma's (1 + weight) ones hold 0) in
    ``dtype`` (the float linears' and embeddings' in bf16 with ``bf16_linears``, as ``cast_model`` keeps them)."""
    cast_model(model, dtype, bf16_linears)
    unit = 0.0 if isinstance(model, LlamaForCausalLM) and model.architecture.gemma else 1.0
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(unit)
            else:
                param.uniform_(-1e-3, 1e-3, generator=generator)
