"""fp32 CPU linears run on weights packed once at load into oneDNN's layout (layers.pack_weight)."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from raypaged.model.layers import Linear, linear, pack_weight, packs_weights
from raypaged.model.loader import load_model
from raypaged.model.parallel import RowParallelLinear
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(
    not packs_weights(torch.float32, torch.device("cpu")), reason="this torch has no oneDNN linear"
)


@pytest.mark.parametrize("rows", [2, 3, 32, 129])
def test_packed_products_equal_the_plain_weights_bit_for_bit(rows):
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(rows, 80)
    packed = pack_weight(weight)
    assert packed.is_mkldnn and not packed.requires_grad and tuple(packed.shape) == (96, 80)
    assert torch.equal(packed.to_dense(), weight)
    assert torch.equal(linear(x, packed), linear(x, weight))


def test_a_single_row_through_the_packed_weight_is_the_product_within_rounding():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 80), torch.randn(1, 80)
    torch.testing.assert_close(linear(x, pack_weight(weight)), x @ weight.T, rtol=1e-5, atol=1e-5)


def _load(path, dtype=torch.float32):
    return load_model(path, AutoConfig.from_pretrained(path), 64, dtype, torch.device("cpu"))


@pytest.mark.parametrize("tied", [False, True])
def test_loading_an_fp32_model_on_cpu_packs_every_float_linear_and_the_head(tmp_path, smollm2_dir, tied):
    path = make_tiny_model(tmp_path, smollm2_dir, "llama", tie_word_embeddings=tied)
    checkpoint = load_file(path / "model.safetensors")
    model = _load(path)
    linears = [m for m in model.modules() if isinstance(m, (Linear, RowParallelLinear))]
    assert len(linears) == 2 * 4 and all(m.weight.is_mkldnn for m in linears)
    layer = model.model.layers[1]
    assert torch.equal(layer.self_attn.o_proj.weight.to_dense(), checkpoint["model.layers.1.self_attn.o_proj.weight"])
    embed = model.model.embed_tokens
    assert not embed.weight.is_mkldnn  # looked up by row
    assert torch.equal(embed.weight, checkpoint["model.embed_tokens.weight"])
    if tied:  # the head is a packed copy beside the embedding's rows
        assert model.lm_head is None and embed.head_weight.is_mkldnn
        assert torch.equal(embed.head_weight.to_dense(), checkpoint["model.embed_tokens.weight"])
    else:
        assert embed.head_weight is None and model.lm_head.head_weight is None and model.lm_head.weight.is_mkldnn
        assert torch.equal(model.lm_head.weight.to_dense(), checkpoint["lm_head.weight"])
    hidden = torch.randn(3, 64)
    head = checkpoint["model.embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(model.compute_logits(hidden), linear(hidden, head))


def test_other_dtypes_keep_plain_weights(tmp_path, smollm2_dir):
    model = _load(make_tiny_model(tmp_path, smollm2_dir, "llama"), torch.bfloat16)
    assert not any(p.is_mkldnn for p in model.parameters())
    assert model.model.embed_tokens.head_weight is None
