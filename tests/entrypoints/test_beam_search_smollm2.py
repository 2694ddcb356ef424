"""Beam search in the engine against transformers' own beam search, and its block sharing."""

import pytest
import torch

from raypaged import LLM, BeamSearchParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


def test_best_beam_equals_transformers(smollm2_dir, smollm2_llm, hf_smollm2):
    params = BeamSearchParams(beam_width=4, max_tokens=24, ignore_eos=True)
    outputs = smollm2_llm.beam_search(PROMPTS, params)
    tokenizer = smollm2_llm.get_tokenizer()
    for prompt, output in zip(PROMPTS, outputs):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.inference_mode():
            reference = hf_smollm2.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=4,
                do_sample=False,
                eos_token_id=None,
                length_penalty=1.0,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        beams = output.outputs
        assert beams[0].token_ids == reference
        assert len(beams) == 4 and [b.index for b in beams] == [0, 1, 2, 3]
        scores = [b.cumulative_logprob for b in beams]
        assert scores == sorted(scores, reverse=True)
        assert beams[0].text == tokenizer.decode(reference, skip_special_tokens=True)
    assert smollm2_llm.stats()["num_gpu_blocks_free"] == 1024


def test_beams_share_the_prompt_blocks(smollm2_dir, smollm2_llm):
    prompt = smollm2_llm.get_tokenizer()("Write a long story about a cat. " * 25)["input_ids"][:200]
    llm = LLM(model=str(smollm2_dir), num_gpu_blocks_override=128, max_model_len=2048, enable_prefix_caching=False)
    engine = llm.llm_engine
    engine.add_beam_search(
        None, BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True), prompt_token_ids=prompt
    )
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, 128 - llm.stats()["num_gpu_blocks_free"])
    prompt_blocks = -(-200 // 16)  # 13
    assert peak <= prompt_blocks + 4 * 3  # each beam: its copy of the last prompt block and up to 2 more
    assert llm.stats()["num_gpu_blocks_free"] == 128


def test_eos_ends_beams_when_not_ignored(smollm2_llm):
    chat = smollm2_llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    [output] = smollm2_llm.beam_search(chat, BeamSearchParams(beam_width=3, max_tokens=40))
    eos = smollm2_llm.llm_engine.eos_token_id
    best = output.outputs[0]
    assert best.finish_reason == "stop" and best.token_ids[-1] == eos
    assert "Paris" in best.text
    with pytest.raises(ValueError, match="beam_width must be at least 1, got 0"):
        BeamSearchParams(beam_width=0)


def test_beam_search_returns_vllms_beam_search_output(smollm2_llm):
    from raypaged.outputs import BeamSearchOutput

    params = BeamSearchParams(beam_width=3, max_tokens=12)
    [output] = smollm2_llm.beam_search("The capital of France is", params, use_tqdm=False)
    tokenizer = smollm2_llm.get_tokenizer()
    assert isinstance(output, BeamSearchOutput) and len(output.sequences) == 3
    for sequence, beam in zip(output.sequences, output.outputs):
        assert sequence.tokens == output.prompt_token_ids + beam.token_ids
        assert (sequence.text, sequence.cum_logprob, sequence.finish_reason) == (
            beam.text,
            beam.cumulative_logprob,
            beam.finish_reason,
        )
        assert len(sequence.logprobs) == len(beam.token_ids)
        # each step's candidates hold the token the beam took; their logprobs add up to its score
        assert sum(step[token] for step, token in zip(sequence.logprobs, beam.token_ids)) == pytest.approx(
            sequence.cum_logprob, abs=1e-4
        )
        for step, token in zip(sequence.logprobs, beam.token_ids):
            assert len(step) >= 2 * params.beam_width and step[token].decoded_token == tokenizer.decode([token])
            assert sorted(v.rank for v in step.values())[0] == 1
