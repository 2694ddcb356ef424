"""What the end-to-end image tests against transformers share (``test_llava_vs_hf``, ``test_qwen2_vl_vs_hf``,
``test_gemma3_images_vs_hf``, ``test_mistral3_images_vs_hf``): seeded random images, a prompt list's greedy tokens
through ``LLM.generate``, and the checks that are the same test whichever model runs them, given its folder, its
transformers model and its processed inputs. A prompt is ``(text, images)``: a text with a placeholder an image."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer

from raypaged import LLM, SamplingParams

Prompt = tuple[str, list[Image.Image]]


def image(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    """An RGB image of ``size`` (height, width) random pixels, the same for the same seed."""
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@contextmanager
def serving(model_dir: Path, **options) -> Iterator[LLM]:
    """``LLM(model=model_dir, **options)``, shut down on leaving."""
    llm = LLM(model=str(model_dir), **options)
    try:
        yield llm
    finally:
        llm.shutdown()


def request(text: str, images: list[Image.Image]) -> str | dict:
    """The prompt as ``LLM.generate`` takes it: its images in vLLM's ``multi_modal_data``, a text-only one as text."""
    return {"prompt": text, "multi_modal_data": {"image": images}} if images else text


def generate(llm: LLM, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens, the prompts submitted together."""
    outputs = llm.generate([request(text, images) for text, images in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def transformers_greedy(hf, inputs: Mapping[str, Any], max_tokens: int) -> list[int]:
    """transformers' greedy tokens after the processed ``inputs`` (one prompt), ``max_tokens`` of them."""
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def check_logprobs_equal_transformers(
    model_dir: Path,
    hf,
    prompt: Prompt,
    inputs: Mapping[str, Any],
    option_sets: Sequence[dict],
    block_size: int,
    token_types: str | None = None,
) -> None:
    """The prompt's prompt logprobs and 4 sampled ones (greedy) within 1e-4 of transformers' log-softmax of its logits
    over the processed ``inputs`` and those tokens, on an LLM of each of ``option_sets`` (64 blocks of
    ``block_size``, 128 tokens a sequence). ``token_types``: the input that marks the prompt's image tokens, 0 over
    the sampled tokens."""
    text, images = prompt
    ids = inputs["input_ids"][0].tolist()
    with torch.no_grad():
        tokens = hf.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(ids) :].tolist()
        whole = dict(inputs, input_ids=torch.tensor([ids + tokens]))
        whole["attention_mask"] = torch.ones_like(whole["input_ids"])
        if token_types is not None:
            whole[token_types] = torch.nn.functional.pad(inputs[token_types], (0, len(tokens)))
        expected = hf(**whole).logits[0, :-1].log_softmax(-1)
    targets = ids[1:] + tokens
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
    for options in option_sets:
        with serving(model_dir, num_gpu_blocks_override=64, block_size=block_size, max_model_len=128, **options) as llm:
            [out] = llm.generate([request(text, images)], params, use_tqdm=False)
        assert out.prompt_token_ids == ids and list(out.outputs[0].token_ids) == tokens
        got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
        got += [e[t].logprob for e, t in zip(out.outputs[0].logprobs, tokens, strict=True)]
        want = expected[torch.arange(len(targets)), torch.tensor(targets)]
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def check_greedy_tokens(
    model_dir: Path,
    prompts: Sequence[Prompt],
    params: SamplingParams,
    expected: list[list[int]],
    option_sets: Sequence[dict],
    block_size: int,
    again: bool = False,
) -> None:
    """The prompts' tokens equal ``expected`` on an LLM of each of ``option_sets`` (64 blocks of ``block_size``, 128
    tokens a sequence), and ``again`` a second time (from the prefix cache); every block is free after."""
    for options in option_sets:
        with serving(model_dir, num_gpu_blocks_override=64, block_size=block_size, max_model_len=128, **options) as llm:
            assert generate(llm, prompts, params) == expected
            if again:
                assert generate(llm, prompts, params) == expected  # again, from the prefix cache
            assert llm.stats()["num_gpu_blocks_free"] == 64


def check_prefix_cache_keys_images(
    model_dir: Path, params: SamplingParams, prompt: Prompt, other: Prompt
) -> tuple[list[int], list[int]]:
    """``prompt`` run twice, then ``other`` (its text with another image) on an LLM of 4-token blocks: the second run
    reads the cache and gives the first's tokens, ``other`` reads none. Returns ``prompt``'s tokens and ``other``'s."""
    with serving(model_dir, num_gpu_blocks_override=64, block_size=4, max_model_len=128) as llm:
        [first] = llm.generate([request(*prompt)], params, use_tqdm=False)
        [again] = llm.generate([request(*prompt)], params, use_tqdm=False)
        [another] = llm.generate([request(*other)], params, use_tqdm=False)
        assert again.num_cached_tokens > 0 and another.num_cached_tokens == 0
        assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    return list(first.outputs[0].token_ids), list(another.outputs[0].token_ids)


def check_preempted(
    model_dir: Path, prompts: Sequence[Prompt], params: SamplingParams, expected: list[list[int]], **options
) -> None:
    """The prompts' tokens equal ``expected`` on an LLM of 4-token blocks, without the prefix cache, whose
    ``options`` (its few blocks) make it preempt (recompute) some."""
    with serving(model_dir, block_size=4, preemption_mode="recompute", enable_prefix_caching=False, **options) as llm:
        assert generate(llm, prompts, params) == expected
        assert llm.stats()["num_preemptions"] > 0


def check_chat_with_image_parts(
    model_dir: Path,
    hf,
    images: list[Image.Image],
    placeholder: str,
    process: Callable[[str, list[Image.Image]], Mapping[str, Any]],
    params: SamplingParams,
    block_size: int,
    chat_template: str | None = None,
) -> None:
    """``LLM.chat`` of a user message of text, then ``images`` as image parts, on an LLM (64 blocks of ``block_size``,
    128 tokens a sequence): its prompt is the chat template's of the string content of a ``placeholder`` line an
    image before the text, as ``process`` (the model's processing of a text, special tokens not added, and its images)
    makes it, and its tokens transformers' greedy ones after that. A ``chat_template`` that loops over a message's
    parts gets the parts instead, each image an ``{"type": "image"}`` part where it stands (vLLM's ``openai``
    content format), and writes the image tokens itself."""
    content = [{"type": "text", "text": "Compare these"}, *({"type": "image_pil", "image_pil": i} for i in images)]
    with serving(model_dir, num_gpu_blocks_override=64, block_size=block_size, max_model_len=128) as llm:
        [out] = llm.chat([{"role": "user", "content": content}], params, use_tqdm=False, chat_template=chat_template)
    lines = "".join(f"{placeholder}\n" for _ in images)
    parts = [{"type": "text", "text": "Compare these"}, *({"type": "image"} for _ in images)]
    text = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": f"{lines}Compare these" if chat_template is None else parts}],
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = process(text, images)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert list(out.outputs[0].token_ids) == transformers_greedy(hf, inputs, params.max_tokens)
