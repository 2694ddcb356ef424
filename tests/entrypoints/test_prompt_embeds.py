"""vLLM's prompt_embeds offline: a prompt given as embedding rows generates transformers' tokens for the same
``inputs_embeds``, beside text prompts in one batch, across chunked prefill, preemption and the prefix cache; what
cannot be honoured is refused by name."""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from transformers import AutoModelForCausalLM

from raypaged import LLM, SamplingParams
from raypaged.config import EngineConfig
from raypaged.inputs.limits import InputError
from raypaged.sampling_params import StructuredOutputsParams
from tests.conftest import make_tiny_model

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_dir):
    return make_tiny_model(tmp_path_factory.mktemp("embeds"), smollm2_dir)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def embeds_of(hf, ids: list[int], seed: int) -> torch.Tensor:
    """The embeddings of ``ids`` moved off the vocabulary's rows (as a soft prompt is)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        rows = hf.get_input_embeddings()(torch.tensor(ids))
    return rows + 0.05 * torch.randn(rows.shape, generator=generator)


def hf_tokens(hf, embeds: torch.Tensor, max_tokens: int = MAX_TOKENS, **options) -> list[int]:
    """Transformers' greedy tokens for ``inputs_embeds``, EOS ignored."""
    with torch.inference_mode():
        out = hf.generate(
            inputs_embeds=embeds[None],
            attention_mask=torch.ones(1, embeds.shape[0], dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **options,
        )
    return out[0].tolist()  # inputs_embeds alone: generate returns the new tokens only


@pytest.fixture(scope="module")
def prompts(hf):
    ids = list(range(300, 360))
    return [embeds_of(hf, ids[:n], seed) for seed, n in enumerate((5, 23, 40))]


@pytest.fixture(scope="module")
def llm(model_dir):
    # 16 tokens a step: the longer prompts' rows arrive over several chunks
    return LLM(
        model=str(model_dir),
        enable_prompt_embeds=True,
        block_size=16,
        num_gpu_blocks_override=64,
        max_num_batched_tokens=16,
        max_num_seqs=8,
    )


def test_embeds_prompts_equal_transformers_beside_text_prompts(llm, hf, prompts):
    texts = ["The cat sat on", "Paged attention keeps"]
    outputs = llm.generate([{"prompt_embeds": e} for e in prompts] + texts, GREEDY, use_tqdm=False)
    for output, embeds in zip(outputs, prompts):
        assert output.outputs[0].token_ids == hf_tokens(hf, embeds)
        assert output.prompt_token_ids is None and output.num_prompt_tokens == embeds.shape[0]
        assert output.outputs[0].text == llm.get_tokenizer().decode(output.outputs[0].token_ids)
    for output, text in zip(outputs[3:], texts):
        ids = llm.get_tokenizer()(text)["input_ids"]
        with torch.inference_mode():
            expected = hf.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS
            )[0, len(ids) :]
        assert output.outputs[0].token_ids == expected.tolist()


def test_n_samples_fork_after_the_rows_and_a_choice_constrains_them(llm, hf, prompts):
    """``n=2`` greedy samples share the prompt's blocks and both get transformers' tokens; a structured choice
    is enforced on a prompt of rows alike."""
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = llm.generate({"prompt_embeds": prompts[1]}, params, use_tqdm=False)
    assert [c.token_ids for c in output.outputs] == [hf_tokens(hf, prompts[1])] * 2
    choice = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    [chosen] = llm.generate({"prompt_embeds": prompts[0]}, choice, use_tqdm=False)
    assert chosen.outputs[0].text in ("yes", "no")


def test_repetition_penalty_weighs_the_generated_tokens_as_transformers(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.5)
    [output] = llm.generate({"prompt_embeds": prompts[2]}, params, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_tokens(hf, prompts[2], repetition_penalty=1.5)


def test_half_precision_rows_and_a_leading_batch_of_one_are_taken(llm, hf, prompts):
    """bfloat16 rows are the model's input as given (cast to its dtype), as a [1, n, hidden] tensor too."""
    rows = prompts[1].to(torch.bfloat16)
    [output] = llm.generate({"prompt_embeds": rows[None]}, GREEDY, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_tokens(hf, rows.float())


def test_truncate_prompt_tokens_keeps_the_last_rows(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, truncate_prompt_tokens=10)
    [output] = llm.generate({"prompt_embeds": prompts[2]}, params, use_tqdm=False)
    assert output.outputs[0].token_ids == hf_tokens(hf, prompts[2][-10:])
    assert output.num_prompt_tokens == 10


def test_the_prefix_cache_shares_blocks_of_the_same_rows_only(llm, prompts):
    llm.generate({"prompt_embeds": prompts[2]}, GREEDY, use_tqdm=False)
    [again] = llm.generate({"prompt_embeds": prompts[2].clone()}, GREEDY, use_tqdm=False)
    assert again.num_cached_tokens == 32  # its two full blocks of 16
    other = prompts[2].clone()
    other[-1] += 0.01  # the same length, one row differs: no block is shared (every key chains the rows' hash)
    [fresh] = llm.generate({"prompt_embeds": other}, GREEDY, use_tqdm=False)
    assert fresh.num_cached_tokens == 0
    salted = llm.generate({"prompt_embeds": prompts[2], "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)
    assert salted[0].num_cached_tokens == 0


def test_preempted_embeds_prompts_are_recomputed_from_their_rows(model_dir, hf, prompts):
    """A pool of 6 blocks of 16 holds two of these sequences: the others wait or are preempted, and every one
    still gets transformers' tokens."""
    llm = LLM(
        model=str(model_dir),
        enable_prompt_embeds=True,
        block_size=16,
        num_gpu_blocks_override=6,
        max_model_len=96,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_embeds": e} for e in prompts * 2], params, use_tqdm=False)
    assert llm.llm_engine.stats().num_preemptions > 0
    for output, embeds in zip(outputs, prompts * 2):
        assert output.outputs[0].token_ids == hf_tokens(hf, embeds, 24)


def saved(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_torch_save_bytes_give_the_same_tokens_as_the_tensor(llm, prompts):
    engine = llm.llm_engine
    request_id = engine.add_request(None, GREEDY, prompt_embeds=saved(prompts[0]))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    [expected] = llm.generate({"prompt_embeds": prompts[0]}, GREEDY, use_tqdm=False)
    assert done[request_id].outputs[0].token_ids == expected.outputs[0].token_ids


class _Exploit:
    def __reduce__(self):
        return (print, ("never run",))


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (torch.zeros(4, 32), "prompt_embeds must be [num_tokens, 64] (the model's hidden size), got [4, 32]"),
        (torch.zeros(2, 4, 64), "prompt_embeds must be [num_tokens, 64] (the model's hidden size), got [2, 4, 64]"),
        (torch.zeros(0, 64), "prompt_embeds has no rows"),
        (torch.zeros(4, 64, dtype=torch.int64), "prompt_embeds must be float32, float16 or bfloat16, got torch.int64"),
        (torch.full((4, 64), float("nan")), "prompt_embeds has values that are not finite (inf or NaN)"),
        (torch.zeros(4, 64).to_sparse(), "prompt_embeds must be a dense tensor, got layout torch.sparse_coo"),
        ([[0.0] * 64], "prompt_embeds must be a tensor, got list"),
        (saved({"rows": torch.zeros(4, 64)}), "prompt_embeds must be a tensor, got dict"),
        (b"not a checkpoint", "prompt_embeds is not a tensor saved by torch.save"),
        (pickle.dumps(_Exploit()), "prompt_embeds is not a tensor saved by torch.save"),
        (
            saved(torch.zeros(600, 64)),
            "prompt has 600 tokens, which leaves no room to generate within max_model_len 512",
        ),
    ],
    ids=[
        "hidden-size",
        "batch-of-two",
        "no-rows",
        "integers",
        "nan",
        "sparse",
        "list",
        "saved-dict",
        "not-saved",
        "pickled-call",
        "too-long",
    ],
)
def test_bad_prompt_embeds_are_refused_by_name(llm, given, message):
    with pytest.raises(InputError) as refused:
        llm.llm_engine.add_request(None, GREEDY, prompt_embeds=given)
    assert refused.value.param in ("prompt_embeds", "prompt")
    assert message in str(refused.value)


def test_what_needs_the_prompts_token_ids_is_refused_by_name(llm, prompts):
    rows = prompts[0]
    with pytest.raises(ValueError, match="prompt_logprobs needs the prompt's token ids, not prompt_embeds"):
        llm.generate({"prompt_embeds": rows}, SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_embeds is the whole prompt: no text, ids or images beside it"):
        llm.generate({"prompt": "Hi", "prompt_embeds": rows}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="a prompt's 'prompt_embeds' is not supported: a prompt dict takes"):
        llm.beam_search({"prompt_embeds": rows}, _beam())


def _beam():
    from raypaged.sampling_params import BeamSearchParams

    return BeamSearchParams(beam_width=2, max_tokens=2)


def test_without_the_flag_prompt_embeds_are_refused(model_dir, prompts):
    llm = LLM(model=str(model_dir), num_gpu_blocks_override=32)
    with pytest.raises(ValueError, match="prompt_embeds needs the engine started with --enable-prompt-embeds"):
        llm.generate({"prompt_embeds": prompts[0]}, GREEDY, use_tqdm=False)


def test_an_engine_that_cannot_take_embeddings_refuses_the_flag(model_dir):
    with pytest.raises(ValueError, match="--enable-prompt-embeds is not supported for LlamaForCausalLM: speculative"):
        EngineConfig(
            model=str(model_dir),
            enable_prompt_embeds=True,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
        )
