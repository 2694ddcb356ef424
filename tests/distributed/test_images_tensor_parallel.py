"""Images under tensor parallelism over Ray actors: each shard encodes a request's images with its whole vision
tower, and the answers equal one shard's: Qwen3-VL (M-RoPE positions, DeepStack features added on every shard) and
Gemma 3 (image tokens attending to each other both ways), in 5-token chunks that cut Qwen3-VL's images."""

from __future__ import annotations

import pytest
import torch

from raypaged import SamplingParams
from tests.conftest import make_tiny_gemma3, make_tiny_qwen_vl
from tests.model.image_checks import image, serving

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1, prompt_logprobs=1)


@pytest.mark.parametrize("family", ["qwen3-vl", "gemma3"])
def test_image_prompts_under_tp2_equal_one_shard(ray_session, tmp_path, smollm2_dir, family):
    if family == "gemma3":
        model_dir, placeholder = make_tiny_gemma3(tmp_path, smollm2_dir), "<start_of_image>"
    else:
        model_dir, placeholder = (
            make_tiny_qwen_vl(tmp_path, smollm2_dir, family),
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
    for tp in (1, 2):
        with serving(
            model_dir,
            tensor_parallel_size=tp,
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
