"""Images under tensor and pipeline parallelism over Ray actors, and the answers equal one shard's. Tensor
parallelism: each shard encodes a request's images with its whole vision tower: Qwen3-VL (M-RoPE positions,
DeepStack features added on every shard) and Gemma 3 (image tokens attending to each other both ways), in 5-token
chunks that cut Qwen3-VL's images. Pipeline parallelism: the first stage alone holds the vision tower: Qwen2-VL
(every stage reads the M-RoPE positions), Qwen3-VL (its DeepStack features added in the first stage) and Gemma 3
(every stage's layers attend both ways)."""

from __future__ import annotations

import pytest
import torch

from raypaged import SamplingParams
from raypaged.config import EngineConfig
from tests.conftest import make_tiny_gemma3, make_tiny_qwen_vl
from tests.model.image_checks import image, serving

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen3-vl", {"tensor_parallel_size": 2}),
        ("gemma3", {"tensor_parallel_size": 2}),
        ("qwen2-vl", {"pipeline_parallel_size": 2}),
        ("qwen3-vl", {"pipeline_parallel_size": 2}),
        ("gemma3", {"pipeline_parallel_size": 2}),
    ],
)
def test_image_prompts_over_shards_equal_one_shard(ray_session, tmp_path, smollm2_dir, family, options):
    if family == "gemma3":
        model_dir, placeholder = make_tiny_gemma3(tmp_path, smollm2_dir), "<start_of_image>"
    else:
        # at 2 stages Qwen3-VL has 4 layers: its 2 DeepStack features feed the first stage's 2
        layers = 4 if family == "qwen3-vl" and "pipeline_parallel_size" in options else 2
        model_dir, placeholder = (
            make_tiny_qwen_vl(tmp_path, smollm2_dir, family, layers),
            "<|vision_start|><|image_pad|><|vision_end|>",
        )
    prompts = [
        {
            "prompt": f"Compare {placeholder} with {placeholder}",
            "multi_modal_data": {"image": [image(1), image(2, (90, 40))]},
        },
        "A plain text prompt",
    ]
    tokens, logprobs = [], []
    for sizes in ({}, options):
        with serving(
            model_dir,
            **sizes,
            num_gpu_blocks_override=64,
            block_size=4,
            max_model_len=128,
            max_num_batched_tokens=5,
        ) as llm:
            outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        logprobs.append(
            [e[t].logprob for o in outputs for e, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
            + [
                e[t].logprob
                for o in outputs
                for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)
            ]
        )
    assert tokens[1] == tokens[0]
    torch.testing.assert_close(torch.tensor(logprobs[1]), torch.tensor(logprobs[0]), atol=1e-4, rtol=0)


def test_deepstack_layers_beyond_the_first_stage_are_refused(tmp_path, smollm2_dir):
    """Qwen3-VL's 2 DeepStack features feed its first 2 layers; at 2 stages the first holds 1 of the tiny 2."""
    model_dir = make_tiny_qwen_vl(tmp_path, smollm2_dir, "qwen3-vl")
    with pytest.raises(ValueError) as refused:
        EngineConfig(model=str(model_dir), pipeline_parallel_size=2)
    assert str(refused.value) == (
        "--pipeline-parallel-size 2 is not supported: the vision tower's DeepStack features feed the first 2 "
        "layers, and the first stage holds 1"
    )
