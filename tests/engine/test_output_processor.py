"""OutputProcessor: the engine core's deltas become text, stop strings and outputs.

Fed hand-made ``SeqDelta`` s with SmolLM2's tokenizer: DELTA streams hold back what
could begin a stop string and never send one; a character split over tokens appears
whole, never broken; a run of accepted drafts is cut after the token completing a
stop string (tokens, logprobs and cumulative logprob alike); ``best_of`` shows the best
sample only at the end; a failure ends its request alone, with every sequence to abort.
"""

from __future__ import annotations

import re

import pytest
from transformers import AutoTokenizer

from raypaged.core.outputs import RequestFailure
from raypaged.engine.core import EngineCoreOutputs, SeqDelta
from raypaged.engine.output_processor import OutputProcessor
from raypaged.outputs import FinishReason
from raypaged.sampling_params import RepetitionDetectionParams, RequestOutputKind, SamplingParams

PROMPT = [1, 504]
HELLO = [19556, 905, 17, 1428, 85]  # "Hello", " world", "!", " By", "e"
ROCKET = [37366, 15107, 244, 218, 10907]  # " café", then " 🚀" in three byte tokens, then " ok"
NOW = 100.0


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def delta(
    seq_id: str,
    token_ids: list[int],
    cumulative: float = 0.0,
    finish: FinishReason | None = None,
    run_logprobs: list[float] | None = None,
    **more,
) -> SeqDelta:
    return SeqDelta(seq_id, token_ids, None, run_logprobs, cumulative, finish, None, **more)


def stream(processor: OutputProcessor, deltas: list[SeqDelta]) -> list[tuple]:
    """Each step's (outputs, stopped, to_abort), one delta per step."""
    return [processor.process(EngineCoreOutputs(seqs=[d]), NOW + i) for i, d in enumerate(deltas)]


def new(tokenizer, params: SamplingParams, seq_ids=("0:r",)) -> OutputProcessor:
    processor = OutputProcessor(tokenizer)
    processor.add("r", None, PROMPT, params, list(seq_ids), 16, 1.0)
    return processor


def test_a_delta_stream_holds_back_a_possible_stop_string_and_never_sends_it(tokenizer):
    params = SamplingParams(stop=["! B"], output_kind=RequestOutputKind.DELTA)
    processor = new(tokenizer, params)
    steps = stream(processor, [delta("0:r", [t]) for t in HELLO[:4]])
    texts = [outputs[0].outputs[0].text for outputs, _, _ in steps]
    assert texts == ["Hello", " world", "", ""]  # "!" could begin "! B": held; " By" completes it
    last, stopped, to_abort = steps[-1]
    completion = last[0].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == (FinishReason.STOP, "! B")
    assert last[0].finished and stopped == ["0:r"] and to_abort == []
    assert [o[0].outputs[0].token_ids for o, _, _ in steps] == [[t] for t in HELLO[:4]]
    assert "r" not in processor  # forgotten once finished


def test_a_character_split_over_tokens_appears_whole(tokenizer):
    processor = new(tokenizer, SamplingParams(output_kind=RequestOutputKind.DELTA))
    finals = [None] * 4 + [FinishReason.LENGTH]
    steps = stream(processor, [delta("0:r", [t], finish=f) for t, f in zip(ROCKET, finals)])
    texts = [outputs[0].outputs[0].text for outputs, _, _ in steps]
    assert texts == [" café", "", "", " 🚀", " ok"]
    assert "".join(texts) == tokenizer.decode(ROCKET)
    assert steps[-1][0][0].outputs[0].finish_reason == FinishReason.LENGTH


def test_a_run_of_drafts_is_cut_after_the_token_completing_a_stop_string(tokenizer):
    params = SamplingParams(stop=["world"], include_stop_str_in_output=True)
    processor = new(tokenizer, params)
    run = [-0.5, -0.25, -0.125, -1.0]  # "Hello", " world", "!", " By": the last two go
    outputs, stopped, _ = processor.process(
        EngineCoreOutputs(seqs=[delta("0:r", HELLO[:4], cumulative=sum(run), run_logprobs=run)]), NOW
    )
    [completion] = outputs[0].outputs
    assert completion.token_ids == HELLO[:2] and completion.text == "Hello world"
    assert completion.cumulative_logprob == -0.75 and completion.finish_reason == FinishReason.STOP
    assert stopped == ["0:r"] and outputs[0].num_generated_tokens == 2


def test_best_of_shows_only_the_best_sample_and_only_at_the_end(tokenizer):
    params = SamplingParams(n=1, best_of=2, temperature=1.0)
    processor = new(tokenizer, params, seq_ids=("0:r", "0:r#1"))
    first, _, _ = processor.process(
        EngineCoreOutputs(seqs=[delta("0:r", [19556], -1.0), delta("0:r#1", [504], -0.5)]), NOW
    )
    assert first == []
    last, _, _ = processor.process(
        EngineCoreOutputs(
            seqs=[delta("0:r", [905], -1.5, FinishReason.LENGTH), delta("0:r#1", [2988], -3.0, FinishReason.LENGTH)]
        ),
        NOW + 1,
    )
    [output] = last
    assert [(c.index, c.token_ids, c.text) for c in output.outputs] == [(0, [19556, 905], "Hello world")]
    assert output.finished and output.num_generated_tokens == 4


def test_a_failure_ends_its_request_alone_with_every_sequence_to_abort(tokenizer):
    processor = OutputProcessor(tokenizer)
    processor.add("bad", None, PROMPT, SamplingParams(n=2), ["0:bad", "0:bad#1"], 16, 1.0)
    processor.add("good", None, PROMPT, SamplingParams(), ["1:good"], 16, 1.0)
    out = EngineCoreOutputs(
        seqs=[delta("0:bad#1", [19556]), delta("1:good", [19556])],
        failed={"0:bad": RequestFailure("sampling failed: RuntimeError: injected")},
    )
    outputs, stopped, to_abort = processor.process(out, NOW)
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finished and by_id["bad"].error == "sampling failed: RuntimeError: injected"
    assert by_id["bad"].error_param is None  # the engine's failure, not the request's own doing
    assert by_id["bad"].outputs == [] and to_abort == ["0:bad", "0:bad#1"] and stopped == []
    assert by_id["good"].error is None and by_id["good"].outputs[0].text == "Hello"
    assert "bad" not in processor and "good" in processor


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA], ids=str)
def test_a_delta_stream_carries_metrics_on_its_last_output_only(tokenizer, kind):
    processor = new(tokenizer, SamplingParams(output_kind=kind))
    steps = stream(
        processor,
        [
            delta("0:r", [19556], first_scheduled_time=50.0),
            delta("0:r", [905]),
            delta("0:r", [17], finish=FinishReason.LENGTH),
        ],
    )
    metrics = [outputs[0].metrics for outputs, _, _ in steps]
    if kind is RequestOutputKind.DELTA:  # what is streamed is new tokens; the timeline comes at the end
        assert metrics[:2] == [None, None]
    else:
        assert [m.max_num_generation_tokens for m in metrics[:2]] == [1, 2] and metrics[1].last_token_time == NOW + 1
    assert (metrics[2].first_token_time, metrics[2].last_token_time, metrics[2].max_num_generation_tokens) == (
        NOW,
        NOW + 2,
        3,
    )


def test_metrics_come_from_the_deltas_and_the_steps_clock(tokenizer):
    processor = new(tokenizer, SamplingParams())
    steps = stream(
        processor,
        [
            delta("0:r", [19556], first_scheduled_time=50.0, num_cached_tokens=16),
            delta("0:r", [905], finish=FinishReason.LENGTH),
        ],
    )
    metrics = steps[-1][0][0].metrics
    assert (metrics.arrival_time, metrics.first_scheduled_time, metrics.first_token_time, metrics.last_token_time) == (
        1.0,
        50.0,
        NOW,
        NOW + 1,
    )
    assert metrics.max_num_generation_tokens == 2 and steps[-1][0][0].num_cached_tokens == 16


def test_a_stream_interval_sends_the_first_token_then_every_nth_and_the_end(tokenizer):
    processor = OutputProcessor(tokenizer, stream_interval=3)
    processor.add("r", None, PROMPT, SamplingParams(output_kind=RequestOutputKind.DELTA), ["0:r"], 16, 1.0)
    tokens = ROCKET + HELLO[:3]
    finals = [None] * (len(tokens) - 1) + [FinishReason.LENGTH]
    steps = stream(processor, [delta("0:r", [t], -1.0 * (i + 1), f) for i, (t, f) in enumerate(zip(tokens, finals))])
    sent = [outputs[0].outputs[0] for outputs, _, _ in steps if outputs]
    assert [c.token_ids for c in sent] == [tokens[:1], tokens[1:4], tokens[4:7], tokens[7:]]
    assert [o == [] for o, _, _ in steps] == [False, True, True, False, True, True, False, False]
    assert "".join(c.text for c in sent) == tokenizer.decode(tokens)
    assert (sent[-1].finish_reason, sent[-1].cumulative_logprob) == (FinishReason.LENGTH, -8.0)


def test_a_stream_interval_holds_back_parallel_samples_until_one_is_due(tokenizer):
    processor = OutputProcessor(tokenizer, stream_interval=2)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.DELTA)
    processor.add("r", None, PROMPT, params, ["0:r", "1:r"], 16, 1.0)
    steps = [
        processor.process(EngineCoreOutputs(seqs=[delta("0:r", [a]), delta("1:r", [b], finish=f)]), NOW + i)
        for i, (a, b, f) in enumerate(zip(HELLO[:3], ROCKET[:3], [None, None, FinishReason.STOP]))
    ]
    per_step = [[(c.index, c.token_ids) for c in outputs[0].outputs] if outputs else None for outputs, _, _ in steps]
    assert (
        per_step
        == [
            [(0, HELLO[:1]), (1, ROCKET[:1])],  # the first tokens go at once
            None,  # one new token each: not yet two
            [(0, HELLO[1:3]), (1, ROCKET[1:3])],  # two new each, and sample 1 ended
        ]
    )


def test_repetition_detection_ends_a_sequence_at_the_token_completing_the_repeats(tokenizer):
    params = SamplingParams(
        output_kind=RequestOutputKind.DELTA,
        repetition_detection=RepetitionDetectionParams(max_pattern_size=3, min_pattern_size=2, min_count=3),
    )
    processor = new(tokenizer, params)
    a, b, c = HELLO[:3]
    tokens = [c, a, b, a, b, a, b, c]  # "a b" three times in a row once the 7th token is in
    steps = stream(processor, [delta("0:r", [t], -1.0 * (i + 1)) for i, t in enumerate(tokens)])
    # the 7th token completes the third "a b"; an 8th, from a step before the core heard, changes nothing
    assert [stopped for _, stopped, _ in steps] == [[]] * 6 + [["0:r"], []]
    assert steps[7][0] == []
    last = steps[6][0][0].outputs[0]
    assert (last.finish_reason, last.stop_reason) == (FinishReason.STOP, "repetition_detected")
    assert "".join(o[0].outputs[0].text for o, _, _ in steps[:7]) == tokenizer.decode(tokens[:7])


def test_repetition_detection_cuts_a_run_of_drafts_after_the_repeat(tokenizer):
    params = SamplingParams(
        output_kind=RequestOutputKind.CUMULATIVE,
        logprobs=0,
        repetition_detection=RepetitionDetectionParams(max_pattern_size=1, min_count=4),
    )
    processor = new(tokenizer, params)
    a, b = HELLO[:2]
    ids = [b, a, a, a, a, b]
    run = SeqDelta("0:r", ids, [{t: -1.0} for t in ids], [-1.0] * 6, -6.0, None, None)
    [output], stopped, _ = processor.process(EngineCoreOutputs(seqs=[run]), NOW)
    completion = output.outputs[0]
    assert stopped == ["0:r"] and completion.token_ids == [b, a, a, a, a]
    assert (completion.cumulative_logprob, len(completion.logprobs)) == (-5.0, 5)
    assert completion.stop_reason == "repetition_detected"


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"max_pattern_size": 2, "min_pattern_size": 3, "min_count": 2},
            "min_pattern_size <= max_pattern_size, got 3 and 2",
        ),
        ({"max_pattern_size": 2, "min_count": 1}, "repetition_detection: min_count must be at least 2, got 1"),
    ],
)
def test_repetition_detection_refuses_settings_vllm_refuses(settings, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(repetition_detection=settings)
    assert SamplingParams(repetition_detection={"max_pattern_size": 0}).repetition_detection is None  # off
