"""Derender: what Generate streamed for tokens it generated, made again without generating.

The tokens go through the engine's own output path, ``OutputProcessor`` (the detokenizer seeded with the
prompt's tokens, the request's special-token settings, its stop strings), one token per step as Generate
runs them without speculative decoding, and out through ``DeltaTracker`` as Generate sends them: the same
text, stop reasons and logprob texts by construction. The deltas of each streamed response (``step_lens``)
are merged into one response.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, cast

from raypaged.engine.core import EngineCoreOutputs, SeqDelta
from raypaged.engine.output_processor import OutputProcessor
from raypaged.inputs.limits import InputError
from raypaged.outputs import CompletionOutput, FinishReason, RequestOutput
from raypaged.sampling_params import REPETITION_DETECTED, RequestOutputKind, SamplingParams
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import DeltaTracker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_FINISH_REASONS = {
    pb.FINISH_REASON_UNSPECIFIED: None,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}


def derendered(
    tokenizer: PreTrainedTokenizerBase,
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    completions: list[pb.GeneratedCompletion],
    return_token_ids: bool,
) -> list[pb.GenerateResponse]:
    """A response per step of each completion (completion by completion), as Generate streamed them.

    ``params``: the request's, as the engine ran it; a stop string a completion reports is searched for too
    (a repetition it reports is found again where ``params`` detect repetitions).
    A completion's tokens after the one its stop string ends with are dropped, as Generate never made them.
    """
    reported = [c.stop_reason for c in completions if c.stop_reason not in ("", REPETITION_DETECTED, *params.stop)]
    params = replace(
        params,
        n=len(completions),
        best_of=None,
        stop=[*params.stop, *dict.fromkeys(reported)],
        stream_interval=1,
        output_kind=RequestOutputKind.DELTA,
    )
    processor = OutputProcessor(tokenizer, eos_token_id=getattr(tokenizer, "eos_token_id", None))
    seq_ids = [str(index) for index in range(len(completions))]
    processor.add(request_id, None, prompt_token_ids, params, seq_ids, 0, 0.0)
    tracker = DeltaTracker(request_id, params, tokenizer, pb, return_token_ids=return_token_ids)
    responses = []
    for index, (seq_id, completion) in enumerate(zip(seq_ids, completions)):
        steps = list(completion.step_lens) or [len(completion.token_ids)]
        if sum(steps) != len(completion.token_ids) or 0 in steps[:-1]:
            raise InputError("step_lens", f"completion {index}: step_lens {steps} do not split its tokens")
        if params.logprobs is not None and len(completion.candidates) != len(completion.token_ids):
            raise InputError("candidates", f"completion {index}: logprobs were asked, so each token needs them")
        feed = _Feed(processor, seq_id, index, completion)
        for step_len in steps:
            merged = feed.step(step_len)
            if merged is None:  # its stop string came in an earlier step: Generate sent nothing after it
                break
            output = RequestOutput(request_id, None, prompt_token_ids, [merged], False, feed.num_fed)
            responses.append(cast(pb.GenerateResponse, tracker.response(output)))  # messages=pb: gRPC's
    if responses and all(c.finish_reason != pb.FINISH_REASON_UNSPECIFIED for c in completions):
        responses[-1].finished = True
    return responses


class _Feed:
    """One completion's tokens into the processor, one per step; each ``step`` its outputs merged."""

    def __init__(self, processor: OutputProcessor, seq_id: str, index: int, completion: pb.GeneratedCompletion):
        self.processor = processor
        self.seq_id = seq_id
        self.index = index
        self.completion = completion
        self.num_fed = 0
        self.ended = False
        stop_reason: int | str | None = completion.stop_reason or None
        if completion.HasField("stop_token_id"):
            stop_reason = completion.stop_token_id
        self.stop_reason = stop_reason
        self.finish_reason = _FINISH_REASONS[completion.finish_reason]

    def step(self, num_tokens: int) -> CompletionOutput | None:
        """The step's next ``num_tokens`` tokens, fed; their outputs as one (``None``: it already ended)."""
        if self.ended:
            return None
        found: list[CompletionOutput] = []
        token_ids = self.completion.token_ids
        last = self.num_fed + num_tokens == len(token_ids)
        for position in range(self.num_fed, self.num_fed + num_tokens):
            found += self._fed([token_ids[position]], position, last and position == len(token_ids) - 1)
            if self.ended:
                break
        if num_tokens == 0 and last:  # no tokens, and the completion ends
            found += self._fed([], self.num_fed, True)
        return _merged(found, self.index)

    def _fed(self, new_token_ids: list[int], position: int, ends: bool) -> list[CompletionOutput]:
        """One step's tokens fed (``ends``: the completion's last, which takes its finish reason); its outputs."""
        candidates = None
        if self.completion.candidates and new_token_ids:
            top = self.completion.candidates[position]
            candidates = [dict(zip(top.token_ids, top.logprobs))]
            if new_token_ids[0] not in candidates[0]:
                raise InputError("candidates", f"the candidates of token {position} do not include the token")
        delta = SeqDelta(
            self.seq_id,
            new_token_ids,
            candidates,
            None,
            0.0,
            self.finish_reason if ends else None,
            self.stop_reason if ends else None,
        )
        outputs, stopped, _ = self.processor.process(EngineCoreOutputs([delta]), 0.0)
        self.num_fed = position + len(new_token_ids)
        found = [c for output in outputs for c in output.outputs if c.index == self.index]
        for output in outputs:
            if output.error is not None:
                raise InputError("token_ids", f"the tokens cannot be derendered: {output.error}")
        self.ended = bool(stopped) or any(c.finish_reason is not None for c in found)
        return found


def _merged(outputs: list[CompletionOutput], index: int) -> CompletionOutput:
    """A step's deltas of one completion as one."""
    merged = CompletionOutput(index, "", [], None, None)
    for output in outputs:
        merged.text += output.text
        merged.token_ids += output.token_ids
        if output.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + output.logprobs
        merged.finish_reason = output.finish_reason
        merged.stop_reason = output.stop_reason
        merged.finish_message = output.finish_message
    return merged
