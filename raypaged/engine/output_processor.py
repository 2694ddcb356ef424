"""Turning the engine core's token deltas into what callers see: text, stop strings, outputs.

``OutputProcessor`` is the one owner of a request's caller-side state: each
sequence's tokens, logprobs and text as they stream out, how it ended, what was
already sent, and its timeline. The core reports tokens per sequence
(``SeqDelta``); this side keeps its own copy, so no list is shared across the
boundary and nothing is copied per step but the new tokens.

Each request's sequences keep their text as it streams out of an O(1)-per-token
detokenizer; stop strings are matched on the newest text only. Outputs come in
the request's ``output_kind``:

- ``CUMULATIVE``: everything so far, every step (the list copies grow with the
  generation: for callers that want whole texts while it runs);
- ``DELTA``: only what is new since the last output. Text that could still begin
  a stop string is held back (at most the longest stop string's length minus one
  character) until the next token settles it, so no stop string is ever sent;
- ``FINAL_ONLY``: one cumulative output, when the request finishes (``LLM.generate``).

A ``best_of > n`` request is shown only when it finishes: its ``n`` best samples
by cumulative logprob, as indices ``0..n-1``. Every output carries the request's
``RequestMetrics`` as of its step (each sequence stamps its first and newest token times
as they are processed), except a one-sequence ``DELTA`` stream's outputs before its last:
what streams is the new tokens, and the timeline comes with the final output (vLLM V1's
outputs carry none; building one per token per step cost 0.5 µs of the 10 at 256 sequences).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from raypaged.core.beam_search import Hypothesis
from raypaged.core.outputs import RequestFailure
from raypaged.engine.core import BeamResult, EngineCoreOutputs, SeqDelta
from raypaged.engine.detokenizer import IncrementalDetokenizer
from raypaged.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    FinishReason,
    Logprob,
    RequestMetrics,
    RequestOutput,
    decode_logprobs,
)
from raypaged.sampling_params import REPETITION_DETECTED, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger("raypaged")


@dataclass(slots=True)
class SeqState:
    """One sequence as its caller sees it: its tokens and text, how it ended, and what was already sent."""

    seq_id: str
    index: int  # which sample of its request
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per token, when the request asked
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None  # why the core ended it (outgrew the KV cache, ...)
    num_sent_tokens: int = 0  # DELTA outputs: tokens, logprobs and characters already sent
    num_sent_chars: int = 0
    done: bool = False  # its last output was sent
    first_scheduled_time: float | None = None
    first_token_time: float | None = None  # time.monotonic() when its first and newest tokens were processed
    last_token_time: float | None = None
    eos_token_id: int | None = None  # the EOS: ending on it, the sequence's text leaves it out


@dataclass(slots=True)
class RequestState:
    """A user request: one sequence, or ``best_of`` of them sharing the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None  # None: a prompt given as embeddings
    params: SamplingParams
    seqs: list[SeqState]
    arrival_time: float = 0.0
    max_tokens: int = 0
    error: RequestFailure | None = None  # it ended alone: handling it failed, or its own fields left nothing to do
    num_cached_tokens: int = 0
    prompt_logprobs_found: list[dict[int, float]] | None = None  # from the first sequence's first delta
    prompt_logprobs_sent: bool = False  # DELTA outputs: the prompt's logprobs went with the first
    pooled: Any = None  # an embedding model's request, ended: its embedding (a float32 tensor)
    num_prompt_embeds: int = 0  # a prompt given as embeddings: its rows

    def prompt_logprobs(self, delta: bool) -> list[dict[int, Logprob] | None] | None:
        """The prompt's logprobs when asked for (``None`` for its first token, as vLLM), once its
        prefill is done; a DELTA stream gets them once."""
        found = self.prompt_logprobs_found
        if found is None or (delta and self.prompt_logprobs_sent):
            return None
        self.prompt_logprobs_sent = True
        return [None, *_decoded_logprobs(found, self.seqs[0].detokenizer.tokenizer)]

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        for seq in self.seqs:
            if seq.finish_reason is None:
                return False
        return True

    @property
    def num_generated_tokens(self) -> int:
        if len(self.seqs) == 1:
            return len(self.seqs[0].token_ids)
        return sum(len(seq.token_ids) for seq in self.seqs)


class OutputProcessor:
    """Request states by request id and sequence id; ``process`` applies one step's ``EngineCoreOutputs``.

    What the core must do in return (sequences a stop string ended, requests whose handling
    failed) comes back from ``process`` as sequence ids, for the caller to pass to the core.
    """

    def __init__(self, tokenizer, stream_interval: int = 1, eos_token_id: int | None = None) -> None:
        """``stream_interval`` (vLLM's ``--stream-interval``): a ``DELTA`` output goes out with a sequence's first
        token, then once it has that many new tokens, and when it ends. ``eos_token_id``: the EOS the core stops
        on, whose text (as a stop token id's) is not part of a sequence's text."""
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.stream_interval = stream_interval
        self.states: dict[str, RequestState] = {}  # by request id
        self._seqs: dict[str, tuple[RequestState, SeqState]] = {}  # by sequence id
        self.beams: dict[str, tuple[RequestState, str]] = {}  # beam searches by request id, with the core's id
        self._beam_ids: dict[str, str] = {}  # the core's id of a beam search -> its request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.beams

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams,
        seq_ids: list[str],
        max_tokens: int,
        arrival_time: float,
        num_prompt_embeds: int = 0,
    ) -> None:
        """``prompt_token_ids`` None: the prompt was ``num_prompt_embeds`` embedding rows (its text starts afresh)."""
        state = RequestState(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            [],
            arrival_time,
            max_tokens,
            num_prompt_embeds=num_prompt_embeds,
        )
        for index, seq_id in enumerate(seq_ids):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids or [], params.skip_special_tokens, params.spaces_between_special_tokens
            )
            seq = SeqState(seq_id, index, params, detok, eos_token_id=self.eos_token_id)
            state.seqs.append(seq)
            self._seqs[seq_id] = (state, seq)
        self.states[request_id] = state

    def add_beam_search(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, core_id: str
    ) -> None:
        self.beams[request_id] = (RequestState(request_id, prompt, prompt_token_ids, params, []), core_id)
        self._beam_ids[core_id] = request_id

    def pop(self, request_id: str) -> tuple[list[str], str | None]:
        """Forget a request (an abort): the ids of its sequences, and the core's id of its beam search."""
        beam = self.beams.pop(request_id, None)
        beam_id = None
        if beam is not None:
            beam_id = beam[1]
            del self._beam_ids[beam_id]
        state = self.states.pop(request_id, None)
        if state is None:
            return [], beam_id
        for seq in state.seqs:
            self._seqs.pop(seq.seq_id, None)
        return [seq.seq_id for seq in state.seqs], beam_id

    def process(self, out: EngineCoreOutputs, now: float) -> tuple[list[RequestOutput], list[str], list[str]]:
        """One step's outputs, the sequences a stop string ended (to finish in the core) and the
        sequences of requests that failed (to abort there). ``now`` is the step's one clock reading."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for seq_id, failure in out.failed.items():
            if (found := self._seqs.get(seq_id)) is not None:
                self._fail(found[0], failure, to_abort)
                touched[found[0].request_id] = found[0]
        stopped = []
        seqs = self._seqs
        for delta in out.seqs:
            found = seqs.get(delta.seq_id)
            if found is None:
                continue
            state, seq = found
            if state.error is None:
                try:
                    if delta.first_scheduled_time is not None:  # the sequence's first delta
                        seq.first_scheduled_time = delta.first_scheduled_time
                        if seq.index == 0:
                            state.num_cached_tokens = delta.num_cached_tokens or 0
                            if delta.prompt_logprobs is not None:
                                state.prompt_logprobs_found = delta.prompt_logprobs
                    if delta.pooled is not None:
                        state.pooled = delta.pooled
                    if delta.message is not None:
                        end_seq(seq, delta)
                    elif process_token(seq, delta, now):
                        stopped.append(delta.seq_id)
                except Exception as exc:
                    self._failed(
                        state, "ending" if delta.message is not None else "detokenizing or stop matching", exc, to_abort
                    )
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            output = None
            if state.error is None:
                try:
                    output = make_output(state, max(self.stream_interval, state.params.stream_interval))
                except Exception as exc:
                    self._failed(state, "building the output", exc, to_abort)
            if state.error is not None:
                output = error_output(state)
            if output is not None:
                if state.pooled is not None:
                    output.pooled = state.pooled
                outputs.append(output)
                if output.finished:
                    self._forget(state)
            elif state.finished:
                self._forget(state)
        for result in out.beams:
            request_id = self._beam_ids.pop(result.request_id, None)
            if request_id is not None:
                state, _ = self.beams.pop(request_id)
                outputs.append(self._beam_output(state, result))
        return outputs, stopped, to_abort

    def _failed(self, state: RequestState, doing: str, exc: Exception, to_abort: list[str]) -> None:
        """``doing`` raised ``exc`` for one request (call inside its ``except``): it alone fails."""
        logger.exception("request %s: %s failed; ending it alone", state.request_id, doing)
        self._fail(state, RequestFailure(f"{doing} failed: {type(exc).__name__}: {exc}"), to_abort)

    def _fail(self, state: RequestState, failure: RequestFailure, to_abort: list[str]) -> None:
        """End a request whose handling failed: its sequences go to ``to_abort`` (the caller aborts
        them, freeing their blocks) and it is reported once, finished, with ``error`` set."""
        if state.error is not None:
            return
        state.error = failure
        to_abort.extend(seq.seq_id for seq in state.seqs)
        for seq in state.seqs:
            if seq.finish_reason is None:
                seq.finish_reason = FinishReason.ERROR

    def _forget(self, state: RequestState) -> None:
        del self.states[state.request_id]
        for seq in state.seqs:
            self._seqs.pop(seq.seq_id, None)

    def _beam_output(self, state: RequestState, result: BeamResult) -> BeamSearchOutput:
        if result.error is not None:  # no beams: a BeamSearchOutput still, as every beam search's output is
            return BeamSearchOutput(
                state.request_id,
                state.prompt,
                state.prompt_token_ids,
                [],
                finished=True,
                error=result.error.message,
                error_param=result.error.param,
            )
        return beam_output(state, result.hypotheses, self.tokenizer)


def beam_output(state: RequestState, hypotheses: list[Hypothesis], tokenizer) -> BeamSearchOutput:
    """A finished beam search as vLLM shows it: its beams best first, as completions and as sequences."""
    texts = [tokenizer.decode(hyp.token_ids, skip_special_tokens=True) for hyp in hypotheses]
    completions = [
        CompletionOutput(
            index=rank,
            text=text,
            token_ids=hyp.token_ids,
            cumulative_logprob=hyp.cumulative_logprob,
            logprobs=None,
            finish_reason=hyp.finish_reason,
        )
        for rank, (hyp, text) in enumerate(zip(hypotheses, texts))
    ]
    sequences = []
    prompt_ids = state.prompt_token_ids or []  # (a beam search's prompt is token ids)
    for hyp, text in zip(hypotheses, texts):
        sequences.append(
            BeamSearchSequence(
                prompt_ids + hyp.token_ids,
                _decoded_logprobs(hyp.logprobs, tokenizer),
                hyp.cumulative_logprob,
                text,
                hyp.finish_reason,
            )
        )
    return BeamSearchOutput(
        state.request_id,
        state.prompt,
        state.prompt_token_ids,
        completions,
        finished=True,
        num_generated_tokens=sum(len(h.token_ids) for h in hypotheses),
        sequences=sequences,
    )


def process_token(seq: SeqState, delta: SeqDelta, now: float) -> bool:
    """Take the tokens the newest step gave the sequence (one, or a run of accepted drafts),
    detokenize them and look for a stop string in the new text; ``now`` (``time.monotonic()``,
    one reading per step) is the sequence's newest token time.

    Returns True when a stop string ended the sequence (the caller finishes it in the
    core); tokens of the run after the one completing the stop string are dropped. A
    sequence the core finished takes its reason from the delta.
    """
    params = seq.params
    seq.last_token_time = now
    if seq.first_token_time is None:
        seq.first_token_time = now
    new_ids = delta.new_token_ids
    seq.token_ids += new_ids
    seq.cumulative_logprob = delta.cumulative_logprob
    if delta.new_logprobs is not None:
        seq.logprobs += _decoded_logprobs(delta.new_logprobs, seq.detokenizer.tokenizer)
    finished = delta.finish_reason is not None
    text_ids = new_ids
    if finished and not params.include_stop_str_in_output and _ends_on_stop_token(delta, params, seq.eos_token_id):
        text_ids = new_ids[:-1]  # as vLLM: a stop token (EOS, stop_token_ids) is not part of the text
    if not params.stop and params.repetition_detection is None:  # nothing to search: the whole run in one piece
        seq.text += seq.detokenizer.add_tokens(text_ids)
        if finished:
            seq.text += seq.detokenizer.flush()
    elif _stopped_in_run(seq, delta, finished, text_ids):
        return True
    if finished:
        seq.finish_reason = delta.finish_reason
        seq.stop_reason = delta.stop_reason
    return False


def _ends_on_stop_token(delta: SeqDelta, params: SamplingParams, eos_token_id: int | None) -> bool:
    """Whether the core ended the sequence on its newest token because it is a stop token: the EOS (unless
    ``ignore_eos``) or one of ``stop_token_ids`` (its ``stop_reason``)."""
    if delta.finish_reason != FinishReason.STOP or not delta.new_token_ids:
        return False
    last = delta.new_token_ids[-1]
    if delta.stop_reason is not None:
        return delta.stop_reason == last
    return last == eos_token_id and not params.ignore_eos


def _stopped_in_run(seq: SeqState, delta: SeqDelta, finished: bool, text_ids: list[int]) -> bool:
    """Detokenize a run token by token (a stop string could end it inside) and search each new piece, and
    check each token for a repeating tail (``repetition_detection``); at a stop string or a repetition, the
    run is cut after the token that made it and the sequence ends. ``text_ids``: the run's tokens that are
    text (all but a final stop token)."""
    params = seq.params
    repetition = params.repetition_detection
    new_ids = delta.new_token_ids
    pieces = [text_ids] if len(text_ids) == 1 else [[token_id] for token_id in text_ids]
    if finished and not pieces:  # the run was the stop token alone
        seq.text += seq.detokenizer.flush()
    for i, piece in enumerate(pieces, 1):
        searched = max(0, len(seq.text) - params.max_stop_len + 1)
        seq.text += seq.detokenizer.add_tokens(piece)
        last = i == len(pieces)
        if finished and last:
            seq.text += seq.detokenizer.flush()
        cut = find_stop(seq.text, params.stop, searched) if params.stop else None
        repeated = (
            cut is None
            and repetition is not None
            and repetition.repeated_tail(seq.token_ids, len(seq.token_ids) - (len(new_ids) - i))
        )
        if cut is None and not repeated:
            continue
        _drop_run_tail(seq, delta, len(new_ids) - i)
        if cut is not None:
            seq.text, seq.stop_reason = cut
            if params.include_stop_str_in_output:
                seq.text += cut[1]
        else:
            if not (finished and last):
                seq.text += seq.detokenizer.flush()
            seq.stop_reason = REPETITION_DETECTED
        seq.finish_reason = FinishReason.STOP
        return True
    return False


def _drop_run_tail(seq: SeqState, delta: SeqDelta, num_dropped: int) -> None:
    """Forget the last ``num_dropped`` tokens of a run: those after the one that ended the sequence."""
    if num_dropped == 0:
        return
    del seq.token_ids[-num_dropped:]
    if delta.new_logprobs is not None:
        del seq.logprobs[-num_dropped:]
    run_logprobs = delta.run_logprobs
    assert run_logprobs is not None, "the core gives a run of several tokens its logprobs"
    seq.cumulative_logprob -= sum(run_logprobs[-num_dropped:])


def end_seq(seq: SeqState, delta: SeqDelta) -> None:
    """A sequence the core ended on its own: its held-back text, the reason and why."""
    seq.text += seq.detokenizer.flush()
    seq.finish_reason = delta.finish_reason
    seq.finish_message = delta.message


_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def make_output(state: RequestState, stream_interval: int = 1) -> RequestOutput | None:
    """This step's output of the request in its ``output_kind``; ``None`` when there is none to give (a
    ``DELTA`` output waits for ``stream_interval`` new tokens of a sequence, except its first and its last)."""
    params = state.params
    if len(state.seqs) == 1:  # the common case, built with no list comprehension or property in between
        seq = state.seqs[0]
        finished = seq.finish_reason is not None
        kind = params.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        delta = kind is _DELTA
        if delta and stream_interval > 1 and not _due(seq, stream_interval):
            return None
        completion = _delta(seq, params) if delta else _cumulative(seq, params)
        seq.done = finished
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [completion],
            finished,
            len(seq.token_ids),
            None,
            request_metrics(state) if finished or not delta else None,
            state.prompt_logprobs(delta),
            state.num_cached_tokens,
            num_prompt_embeds=state.num_prompt_embeds,
        )
    finished = state.finished
    ranked = params.num_samples > params.n
    if (ranked or params.output_kind == RequestOutputKind.FINAL_ONLY) and not finished:
        return None
    delta = params.output_kind == RequestOutputKind.DELTA and not ranked
    if delta and stream_interval > 1 and not finished and not any(_due(seq, stream_interval) for seq in state.seqs):
        return None
    seqs = state.seqs
    if ranked:  # the n best by cumulative logprob (a stable sort: ties keep their sample order)
        seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[: params.n]
    completions = [
        _delta(seq, params) if delta else _cumulative(seq, params) for seq in seqs if not (delta and seq.done)
    ]
    if ranked:
        for rank, completion in enumerate(completions):
            completion.index = rank
    for seq in state.seqs:
        seq.done = seq.finish_reason is not None
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=completions,
        finished=finished,
        num_generated_tokens=state.num_generated_tokens,
        metrics=request_metrics(state),
        prompt_logprobs=state.prompt_logprobs(delta),
        num_cached_tokens=state.num_cached_tokens,
        num_prompt_embeds=state.num_prompt_embeds,
    )


def _due(seq: SeqState, stream_interval: int) -> bool:
    """Whether a streaming sequence's new tokens go out now: its first, ``stream_interval`` of them, or its end
    (not yet sent)."""
    sent = seq.num_sent_tokens
    ended = seq.finish_reason is not None and not seq.done
    return ended or sent == 0 or len(seq.token_ids) - sent >= stream_interval


def error_output(state: RequestState) -> RequestOutput:
    """The one output of a request that failed (``state.error`` set)."""
    failure = state.error
    assert failure is not None, "an error output is of a failed request"
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[],
        finished=True,
        num_generated_tokens=state.num_generated_tokens,
        error=failure.message,
        error_param=failure.param,
        metrics=request_metrics(state),
        num_prompt_embeds=state.num_prompt_embeds,
    )


def request_metrics(state: RequestState) -> RequestMetrics:
    """The request's timeline as of now, over all its sequences (a new object: O(sequences))."""
    if len(state.seqs) == 1:
        seq = state.seqs[0]
        return RequestMetrics(
            state.arrival_time,
            state.params.n,
            state.max_tokens,
            seq.first_scheduled_time,
            seq.first_token_time,
            seq.last_token_time,
            len(seq.token_ids),
        )
    scheduled = [seq.first_scheduled_time for seq in state.seqs if seq.first_scheduled_time is not None]
    first_tokens = [seq.first_token_time for seq in state.seqs if seq.first_token_time is not None]
    last_tokens = [seq.last_token_time for seq in state.seqs if seq.last_token_time is not None]
    return RequestMetrics(
        arrival_time=state.arrival_time,
        n=state.params.n,
        max_tokens=state.max_tokens,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        last_token_time=max(last_tokens, default=None),
        max_num_generation_tokens=max(len(seq.token_ids) for seq in state.seqs),
    )


def _cumulative(seq: SeqState, params: SamplingParams) -> CompletionOutput:
    # positional, in CompletionOutput's field order: index, text, token ids, cumulative logprob,
    # logprobs, finish reason, stop reason, finish message (this runs per sequence per step)
    return CompletionOutput(
        seq.index,
        seq.text,
        list(seq.token_ids),
        seq.cumulative_logprob,
        list(seq.logprobs) if params.logprobs is not None else None,
        seq.finish_reason,
        seq.stop_reason,
        seq.finish_message,
    )


def _delta(seq: SeqState, params: SamplingParams) -> CompletionOutput:
    first = seq.num_sent_tokens
    text = seq.text
    sent = seq.num_sent_chars
    held = stop_holdback(text, params.stop) if params.stop and seq.finish_reason is None else 0
    visible = max(len(text) - held, sent)
    seq.num_sent_tokens = len(seq.token_ids)
    seq.num_sent_chars = visible
    return CompletionOutput(
        seq.index,
        text[sent:visible],
        seq.token_ids[first:],
        seq.cumulative_logprob,
        seq.logprobs[first:] if params.logprobs is not None else None,
        seq.finish_reason,
        seq.stop_reason,
        seq.finish_message,
    )


def _decoded_logprobs(entries: list[dict[int, float]], tokenizer: PreTrainedTokenizerBase) -> list[dict[int, Logprob]]:
    """``entries`` themselves, each ``Logprob`` given its ``decoded_token`` (``decode_logprobs``). The
    sampler makes every value a ``Logprob`` (``worker/sampler.py``'s ``logprob_entry``); the engine
    core, which only carries them, types them as the floats they also are."""
    decode_logprobs(entries, tokenizer)
    return cast("list[dict[int, Logprob]]", entries)


def find_stop(text: str, stops: list[str], start: int) -> tuple[str, str] | None:
    """The text cut before the earliest stop string found at or after ``start``, and that string."""
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    return text[: best[0]], best[1]


def stop_holdback(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` could begin a stop string (0 when none could).

    For each stop string only the prefixes ending in the text's last character
    are compared, so the cost stays near one ``rfind`` per stop string.
    """
    if not text or not stops:
        return 0
    last = text[-1]
    held = 0
    for stop in stops:
        end = min(len(stop) - 1, len(text))  # a whole stop string would have been cut already
        while end > held:
            end = stop.rfind(last, 0, end) + 1  # the longest prefix stop[:end] ending in `last`
            if end <= held:
                break
            if text.endswith(stop[:end]):
                held = end
                break
            end -= 1
    return held
