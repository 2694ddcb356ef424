"""Under tensor parallelism each rank's quantized tensors are its share of the whole layer's: the
ranks' dequantized column-parallel rows and row-parallel columns put back together equal the
unsharded layer's dequantized weight exactly (loading only: no collective runs)."""

import pytest
import torch

from raypaged.model.parallel import TensorParallel
from tests.quantization.conftest import load

SIZE = 2


def qkv_rows(model, layer: int) -> list[torch.Tensor]:
    """The q, k and v rows of a layer's qkv_proj, dequantized."""
    attn = model.model.layers[layer].self_attn
    return list(attn.qkv_proj.dequantize().split(attn.shard_sizes))


@pytest.mark.parametrize(
    "name", ["w8a8-int8", "fp8", "fp8-block", "w4a16-asym", "gptq", "gptq-actorder-asym", "gptq-8bit-actorder", "awq"]
)
def test_ranks_hold_their_share_of_every_quantized_layer(name, quantized_dirs):
    whole = load(quantized_dirs[name])
    ranks = [load(quantized_dirs[name], TensorParallel(rank, SIZE)) for rank in range(SIZE)]
    for i in range(len(whole.model.layers)):
        for part, rows in enumerate(zip(*(qkv_rows(r, i) for r in ranks))):
            assert torch.equal(torch.cat(rows), qkv_rows(whole, i)[part])
        mlp = [r.model.layers[i].mlp for r in ranks]
        gate_up = [m.gate_up_proj.dequantize().chunk(2) for m in mlp]
        assert torch.equal(
            torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up]),
            whole.model.layers[i].mlp.gate_up_proj.dequantize(),
        )
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            columns = [r.model.layers[i].get_submodule(proj).dequantize() for r in ranks]
            assert torch.equal(torch.cat(columns, dim=1), whole.model.layers[i].get_submodule(proj).dequantize())


def test_block_scales_refuse_a_rank_share_of_partial_blocks(quantized_dirs):
    """w8a8-fp8-block [32, 48]: a rank of o_proj (64 inputs) would hold 32, not whole blocks of 48
    (vLLM refuses it too)."""
    with pytest.raises(
        ValueError,
        match=r"^fp8: the weight block size 48 does not divide a layer's 32 input features "
        r"\(tensor parallelism splits the layer's 64\)$",
    ):
        load(quantized_dirs["w8a8-fp8-block"], TensorParallel(0, SIZE))


def test_act_order_row_parallel_ranks_keep_every_group(quantized_dirs):
    rank = load(quantized_dirs["gptq-actorder-asym"], TensorParallel(1, SIZE)).model.layers[0].mlp.down_proj
    plain = load(quantized_dirs["gptq"], TensorParallel(1, SIZE)).model.layers[0].mlp.down_proj
    assert (tuple(rank.scales.shape), tuple(rank.g_idx.shape)) == ((4, 64), (64,))  # all 128 / 32 groups
    assert tuple(plain.scales.shape) == (2, 64)  # its own 64 / 32


def test_two_ray_shards_of_an_act_order_gptq_model_give_one_shards_tokens(ray_session, quantized_dirs):
    """W4A16 multiplies in fp32 after dequantizing: two shards differ from one only in summation order."""
    from raypaged import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [1, 17 + 5 * i, 400 + 31 * i]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(
            model=str(quantized_dirs["gptq-actorder-asym"]),
            device="cpu",
            tensor_parallel_size=tp,
            num_gpu_blocks_override=32,
            max_model_len=64,
        )
        try:
            tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        finally:
            llm.shutdown()
    assert tokens[0] == tokens[1]
    assert len({tuple(t) for t in tokens[0]}) > 1  # the prompts lead to different tokens
