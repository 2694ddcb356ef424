"""Per-request fault isolation in the engine: one request's failure ends it alone.

Sixteen greedy requests run together; one of them is made to fail in sampling, in
detokenizing or in stop matching. That one ends with an error, the other fifteen
return exactly the tokens of an undisturbed run, every block is free afterwards
and the engine serves the next request.
"""

from __future__ import annotations

import re
import threading

import pytest
import xgrammar

from raypaged import LLM, SamplingParams
from raypaged.core.beam_search import BeamSearchParams
from raypaged.core.block_manager import KVCacheManager
from raypaged.engine import detokenizer, output_processor
from raypaged.sampling_params import StructuredOutputsParams
from raypaged.worker import sampler
from tests.serving.conftest import tiny_model_dir  # noqa: F401  (session fixture)

NUM_REQUESTS = 16
VICTIM = 5
PROMPTS = [f"request number {i} says" for i in range(NUM_REQUESTS)]
PLAIN = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(model=str(tiny_model_dir), num_gpu_blocks_override=128, max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def undisturbed(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PLAIN)]


def run_with_victim(llm: LLM, victim_params: SamplingParams) -> list:
    params = [PLAIN] * NUM_REQUESTS
    params[VICTIM] = victim_params
    return llm.generate(PROMPTS, params, use_tqdm=False)


def assert_only_the_victim_failed(llm: LLM, outputs: list, undisturbed: list[list[int]], message: str) -> None:
    victim = outputs[VICTIM]
    assert victim.finished and victim.error == message
    others = [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != VICTIM]
    assert others == [ids for i, ids in enumerate(undisturbed) if i != VICTIM]
    assert all(o.error is None for i, o in enumerate(outputs) if i != VICTIM)
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
    assert (stats["num_requests_running"], stats["num_requests_waiting"]) == (0, 0)
    again = llm.generate(PROMPTS[:1], PLAIN, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == undisturbed[0]


def test_a_sampling_failure_ends_that_request_alone(llm, undisturbed, monkeypatch):
    real = sampler._apply_penalties

    def failing(logits, inputs):
        if any(s.params.repetition_penalty == 1.5 for s in inputs):
            raise RuntimeError("injected sampling fault")
        return real(logits, inputs)

    monkeypatch.setattr(sampler, "_apply_penalties", failing)
    victim = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5)
    outputs = run_with_victim(llm, victim)
    assert_only_the_victim_failed(llm, outputs, undisturbed, "sampling failed: RuntimeError: injected sampling fault")


def test_a_detokenizer_failure_ends_that_request_alone(llm, undisturbed, monkeypatch):
    real = detokenizer.IncrementalDetokenizer.add_tokens

    def failing(self, new_token_ids):
        if not self.skip_special_tokens:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real(self, new_token_ids)

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "add_tokens", failing)
    victim = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, skip_special_tokens=False)
    outputs = run_with_victim(llm, victim)
    assert_only_the_victim_failed(
        llm,
        outputs,
        undisturbed,
        "detokenizing or stop matching failed: UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in "
        "position 0: injected detokenizer fault",
    )


def fail_stop_matching(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """Stop matching raises ``error`` for every request with the stop string ``VICTIM``."""
    real = output_processor.find_stop

    def failing(text, stops, start):
        if "VICTIM" in stops:
            raise error
        return real(text, stops, start)

    monkeypatch.setattr(output_processor, "find_stop", failing)


def test_a_stop_matching_failure_ends_that_request_alone(llm, undisturbed, monkeypatch):
    fail_stop_matching(monkeypatch, IndexError("injected stop-matching fault"))
    victim = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=["VICTIM"])
    outputs = run_with_victim(llm, victim)
    assert_only_the_victim_failed(
        llm, outputs, undisturbed, "detokenizing or stop matching failed: IndexError: injected stop-matching fault"
    )


def test_a_grammar_mask_failure_ends_that_request_alone(llm, undisturbed, monkeypatch):
    """The masks are filled on the mask thread while the forward runs; a matcher that raises there
    ends its request after the step, and the others' rows and tokens are untouched."""
    real = xgrammar.GrammarMatcher.fill_next_token_bitmask
    calls = []

    def failing(self, bitmask, index=0):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise RuntimeError("injected grammar fault")
        return real(self, bitmask, index)

    monkeypatch.setattr(xgrammar.GrammarMatcher, "fill_next_token_bitmask", failing)
    victim = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    outputs = run_with_victim(llm, victim)
    assert_only_the_victim_failed(
        llm, outputs, undisturbed, "filling the grammar mask failed: RuntimeError: injected grammar fault"
    )
    assert calls == ["MainThread", "raypaged-grammar-mask_0", "raypaged-grammar-mask_0"]  # the compile check first


AMBIGUOUS = 'root ::= s\ns ::= s s | "a" | "aa"'  # an Earley parse whose work grows with every "a"
TOO_SLOW = re.compile(
    r"the request's grammar took (\d+\.\d\d) ms of CPU for one token \((filling its token mask|taking the sampled "
    r"token)\), more than the limit of 2 ms \(max_grammar_ms of --structured-outputs-config\); every request in "
    r"the batch waits for it"
)


def test_a_grammar_slower_than_max_grammar_ms_ends_that_request_alone(tiny_model_dir, undisturbed):
    """An ambiguous grammar costs more CPU with every token, and every sequence of the batch waits for its
    mask: past max_grammar_ms it ends, a client error; the same grammar within the limit runs as asked."""
    strict = LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks_override=128,
        max_model_len=512,
        structured_outputs_config={"max_grammar_ms": 2},
    )
    try:
        grammar = StructuredOutputsParams(grammar=AMBIGUOUS)
        short = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, structured_outputs=grammar)
        [done] = strict.generate(PROMPTS[:1], short, use_tqdm=False)
        assert done.error is None and len(done.outputs[0].token_ids) == 4
        assert set(done.outputs[0].text) == {"a"}
        victim = SamplingParams(temperature=0, max_tokens=200, min_tokens=200, structured_outputs=grammar)
        outputs = run_with_victim(strict, victim)
        error = outputs[VICTIM].error
        assert error is not None and (match := TOO_SLOW.fullmatch(error)), error
        assert float(match[1]) >= 2
        assert outputs[VICTIM].error_param == "structured_outputs"
        assert_only_the_victim_failed(strict, outputs, undisturbed, error)
    finally:
        strict.shutdown()


HELLO, SPACE_HELLO, SEVEN, LETTER_A = 28120, 33662, 39, 81  # "hello", " hello", "7", "a" in SmolLM2's vocabulary


@pytest.mark.parametrize(
    "victim, message",
    [
        (
            SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[HELLO, SPACE_HELLO], bad_words=["hello"]),
            "allowed_token_ids and bad_words together allow no token",
        ),
        (
            SamplingParams(
                temperature=0.8,
                seed=3,
                max_tokens=12,
                allowed_token_ids=[LETTER_A],
                structured_outputs=StructuredOutputsParams(regex="[0-9]+"),
            ),
            "allowed_token_ids and the structured output's grammar together allow no token",
        ),
    ],
    ids=["allowed-and-bad-words", "allowed-and-grammar"],
)
def test_masks_that_leave_no_token_end_that_request_alone_as_its_own_error(llm, undisturbed, victim, message):
    """Nothing is drawn from a row whose masks exclude every token (vLLM draws token 0 there, outside
    allowed_token_ids): the request ends with an error naming its fields, a client's error."""
    outputs = run_with_victim(llm, victim)
    assert_only_the_victim_failed(
        llm, outputs, undisturbed, f"no token is left to sample after 0 output tokens: {message}"
    )
    assert outputs[VICTIM].error_param == "allowed_token_ids"
    assert all(o.error_param is None for i, o in enumerate(outputs) if i != VICTIM)


def test_a_complete_grammar_ends_a_request_below_its_min_tokens(llm, undisturbed):
    """A grammar that allows nothing but EOS lifts min_tokens' ban on it: the request stops with its valid
    output (vLLM's rule) instead of failing; min_tokens still holds while other tokens are allowed."""
    victim = SamplingParams(
        temperature=0,
        max_tokens=12,
        min_tokens=10,
        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
    )
    outputs = run_with_victim(llm, victim)
    done = outputs[VICTIM].outputs[0]
    assert outputs[VICTIM].error is None and done.finish_reason == "stop"
    assert done.text in ("yes", "no") and len(done.token_ids) < 10
    others = [o.outputs[0].token_ids for i, o in enumerate(outputs) if i != VICTIM]
    assert others == [ids for i, ids in enumerate(undisturbed) if i != VICTIM]
    digits = SamplingParams(
        temperature=0, max_tokens=6, min_tokens=6, allowed_token_ids=[SEVEN, llm.get_tokenizer().eos_token_id]
    )
    assert llm.generate(PROMPTS[:1], digits, use_tqdm=False)[0].outputs[0].token_ids == [SEVEN] * 6


def test_a_grammar_failure_in_a_beam_ends_that_beam_search_alone(llm, undisturbed, monkeypatch):
    real = xgrammar.GrammarMatcher.fork
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fork", lambda self: (_ for _ in ()).throw(RuntimeError("no fork")))
    engine = llm.llm_engine
    constraint = StructuredOutputsParams(regex="[a-z]{4} [a-z]{4}")
    search = engine.add_beam_search(
        PROMPTS[VICTIM], BeamSearchParams(beam_width=2, max_tokens=10, structured_outputs=constraint)
    )
    plain = [engine.add_request(prompt, PLAIN) for prompt in PROMPTS[:3]]
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[search].error == "advancing the grammar failed: RuntimeError: no fork"
    assert finished[search].outputs == []
    assert [finished[rid].outputs[0].token_ids for rid in plain] == undisturbed[:3]
    assert engine.core._matchers == {} and engine.core._beams == {} and engine.output_processor.beams == {}
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
    monkeypatch.setattr(xgrammar.GrammarMatcher, "fork", real)
    [again] = llm.beam_search(
        PROMPTS[VICTIM], BeamSearchParams(beam_width=2, max_tokens=10, structured_outputs=constraint), use_tqdm=False
    )
    assert again.error is None and all(re.fullmatch("[a-z]{4} [a-z]{4}", beam.text) for beam in again.outputs)


def test_a_sampling_failure_in_a_beam_ends_that_beam_search_alone(llm, undisturbed, monkeypatch):
    real = sampler._penalized  # asked of every row the sampler takes

    def failing(row):
        if row.params.logprobs == 6:  # the beams of a width-3 search
            raise RuntimeError("injected sampling fault")
        return real(row)

    monkeypatch.setattr(sampler, "_penalized", failing)
    engine = llm.llm_engine
    search = engine.add_beam_search(PROMPTS[VICTIM], BeamSearchParams(beam_width=3, max_tokens=10))
    plain = [engine.add_request(prompt, PLAIN) for prompt in PROMPTS[:3]]
    finished = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished[search].error == "sampling failed: RuntimeError: injected sampling fault"
    assert finished[search].outputs == []
    assert [finished[rid].outputs[0].token_ids for rid in plain] == undisturbed[:3]
    assert engine.core._beams == {} and engine.output_processor.beams == {}
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]


def test_a_request_outgrowing_the_pool_is_reported_not_lost(llm, undisturbed):
    engine = llm.llm_engine
    real_kv = engine.scheduler.kv
    engine.scheduler.kv = KVCacheManager(2, real_kv.block_size)  # a pool of 32 tokens for this test
    try:
        [output] = llm.generate(
            PROMPTS[:1], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False
        )
    finally:
        engine.scheduler.kv = real_kv
    [completion] = output.outputs
    assert output.finished and output.error is None
    assert completion.finish_reason == "length"
    num_prompt = len(output.prompt_token_ids)
    assert len(completion.token_ids) == 33 - num_prompt  # 32 tokens fill the pool; the 33rd was sampled
    assert completion.token_ids[:12] == undisturbed[0]
    seq_id = completion.finish_message.split()[1]
    assert completion.finish_message == (
        f"request {seq_id} outgrew the whole KV cache (2 blocks of 16 tokens) at 33 tokens; finished with what it has"
    )
    assert seq_id.endswith(f":{output.request_id}")


def test_best_of_returns_exactly_n_ranked_choices_and_counts_every_sample(llm):
    params = SamplingParams(temperature=1.0, n=2, best_of=4, max_tokens=6, ignore_eos=True, seed=3)
    [ranked] = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    samples = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=1.0, n=4, max_tokens=6, ignore_eos=True, seed=3), use_tqdm=False
    )[0]
    assert [c.index for c in ranked.outputs] == [0, 1]
    best = sorted(samples.outputs, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.token_ids for c in ranked.outputs] == [c.token_ids for c in best]
    assert ranked.num_generated_tokens == 4 * 6


def test_user_ids_never_collide_with_sample_ids(llm):
    engine = llm.llm_engine
    engine.add_request("first", SamplingParams(temperature=0, max_tokens=3), request_id="x#1")
    engine.add_request("second", SamplingParams(temperature=0, max_tokens=3, n=2), request_id="x")
    with pytest.raises(ValueError, match="request_id 'x' is already in use"):
        engine.add_request("third", PLAIN, request_id="x")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert sorted(finished) == ["x", "x#1"]
    assert [len(c.token_ids) for c in finished["x"].outputs] == [3, 3]
    assert [len(c.token_ids) for c in finished["x#1"].outputs] == [3]
    stats = llm.stats()
    assert stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]


def test_a_pool_too_small_for_one_sequence_is_a_clear_startup_error(tiny_model_dir):
    from raypaged.config import EngineConfig
    from raypaged.engine.llm_engine import LLMEngine

    with pytest.raises(
        ValueError,
        match=re.escape(
            "the KV cache has 2 blocks of 16 tokens (32 tokens), but one sequence of max_model_len 256 needs 16 blocks"
        ),
    ):
        LLMEngine(EngineConfig(model=str(tiny_model_dir), num_gpu_blocks_override=2, max_model_len=256))


WORLD = 905  # " world"


def test_a_row_left_no_token_after_a_rejected_draft_is_never_read(tiny_model_dir):
    """A row verifying drafts is sampled as if the drafts before it were accepted. Here the n-gram draft
    " hello" is rejected by the row before (only " world" is allowed), and the row after it, where
    bad_words bans " world" after " hello", has no token: it is never read, so the request goes on."""
    llm = LLM(
        model=str(tiny_model_dir),
        num_gpu_blocks_override=64,
        max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
    )
    try:
        params = SamplingParams(
            temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=[WORLD], bad_words=["hello world"]
        )
        # after " world", " world": the n-gram drafts " hello", " world" (the prompt's continuation)
        out = llm.generate({"prompt_token_ids": [WORLD, WORLD, SPACE_HELLO, WORLD]}, params, use_tqdm=False)[0]
        assert out.error is None and out.outputs[0].token_ids == [WORLD] * 8
        assert llm.stats()["spec_decode_num_drafts"] > 0  # drafts were proposed (and rejected)
    finally:
        llm.shutdown()
