"""Turning sampled tokens into what callers see: text, stop strings, outputs.

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
``RequestMetrics`` as of its step: each sequence stamps its first and newest token
times as they are processed, whatever the output kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from raypaged.core.request import Request
from raypaged.engine.detokenizer import IncrementalDetokenizer
from raypaged.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput, decode_logprobs
from raypaged.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class SeqState:
    """One sequence as its caller sees it: its text, how it ended, and what was already sent."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    finish_message: str | None = None  # why the scheduler ended it (outgrew the KV cache, ...)
    num_sent_tokens: int = 0  # DELTA outputs: tokens, logprobs and characters already sent
    num_sent_chars: int = 0
    done: bool = False  # its last output was sent
    first_token_time: float | None = None  # time.monotonic() when its first and newest tokens were processed
    last_token_time: float | None = None


@dataclass(slots=True)
class RequestState:
    """A user request: one sequence, or ``best_of`` of them sharing the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[SeqState]
    error: str | None = None  # handling this request failed: it ended alone, with this message
    prompt_logprobs_sent: bool = False  # DELTA outputs: the prompt's logprobs went with the first

    def prompt_logprobs(self, delta: bool) -> list[dict[int, float] | None] | None:
        """The prompt's logprobs when asked for (``None`` for its first token, as vLLM), once its
        prefill is done; a DELTA stream gets them once."""
        if self.params.prompt_logprobs is None or (delta and self.prompt_logprobs_sent):
            return None
        first = self.seqs[0].request
        if first.prompt_logprobs_missing:
            return None
        self.prompt_logprobs_sent = True
        decode_logprobs(first.prompt_logprobs, self.seqs[0].detokenizer.tokenizer)
        return [None, *first.prompt_logprobs]

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
            return len(self.seqs[0].request.output_token_ids)
        return sum(seq.request.num_output_tokens for seq in self.seqs)


def process_token(seq: SeqState, now: float) -> bool:
    """Detokenize the tokens the newest step appended (one, or a run of accepted drafts) and look
    for a stop string in the new text; ``now`` (``time.monotonic()``, one reading per step) is
    the sequence's newest token time.

    Returns True when a stop string ended the sequence (the caller finishes it in the
    scheduler); tokens of the run after the one completing the stop string are dropped. A
    sequence the scheduler finished takes its reason from it.
    """
    request = seq.request
    params = request.sampling_params
    seq.last_token_time = now
    if seq.first_token_time is None:
        seq.first_token_time = now
    num_new = request.num_new_tokens
    new_ids = request.output_token_ids[-num_new:]
    if params.logprobs is not None and request.output_logprobs:
        decode_logprobs(request.output_logprobs[-num_new:], seq.detokenizer.tokenizer)
    if not params.stop:  # nothing to search: the whole run in one piece
        seq.text += seq.detokenizer.add_tokens(new_ids)
        if request.status.finished:
            seq.text += seq.detokenizer.flush()
    elif _stopped_in_run(seq, new_ids):
        return True
    if request.status.finished:
        seq.finish_reason = request.status.finish_reason
        seq.stop_reason = request.stop_reason
    return False


def _stopped_in_run(seq: SeqState, new_ids: list[int]) -> bool:
    """Detokenize a run token by token (a stop string could end it inside) and search each new piece;
    at a stop string, the run is cut after the token completing it and the sequence ends."""
    request = seq.request
    params = request.sampling_params
    pieces = [new_ids] if len(new_ids) == 1 else [[token_id] for token_id in new_ids]
    for i, piece in enumerate(pieces, 1):
        searched = max(0, len(seq.text) - params.max_stop_len + 1)
        seq.text += seq.detokenizer.add_tokens(piece)
        if request.status.finished and i == len(pieces):
            seq.text += seq.detokenizer.flush()
        cut = find_stop(seq.text, params.stop, searched)
        if cut is not None:
            request.truncate_output(request.num_output_tokens - len(pieces) + i)
            seq.text, seq.stop_reason = cut
            if params.include_stop_str_in_output:
                seq.text += cut[1]
            seq.finish_reason = FinishReason.STOP
            return True
    return False


def end_seq(seq: SeqState, message: str) -> None:
    """A sequence the scheduler ended on its own: its held-back text and the reason."""
    seq.text += seq.detokenizer.flush()
    seq.finish_reason = seq.request.status.finish_reason
    seq.finish_message = message


def make_output(state: RequestState) -> RequestOutput | None:
    """This step's output of the request in its ``output_kind``; ``None`` when there is none to give."""
    finished = state.finished
    params = state.params
    ranked = params.num_samples > params.n
    if (ranked or params.output_kind == RequestOutputKind.FINAL_ONLY) and not finished:
        return None
    delta = params.output_kind == RequestOutputKind.DELTA and not ranked
    completions = [_delta(seq, params) if delta else _cumulative(seq, params)
                   for seq in state.seqs if not (delta and seq.done)]
    if ranked:
        completions = sorted(completions, key=lambda c: c.cumulative_logprob, reverse=True)[: params.n]
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
        num_cached_tokens=state.seqs[0].request.num_cached_tokens or 0,
    )


def error_output(state: RequestState) -> RequestOutput:
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[],
        finished=True,
        num_generated_tokens=state.num_generated_tokens,
        error=state.error,
        metrics=request_metrics(state),
    )


def request_metrics(state: RequestState) -> RequestMetrics:
    """The request's timeline as of now, over all its sequences (a new object: O(sequences))."""
    first = state.seqs[0].request
    if len(state.seqs) == 1:
        seq = state.seqs[0]
        return RequestMetrics(first.arrival_time, state.params.n, first.max_tokens, first.first_scheduled_time,
                              seq.first_token_time, seq.last_token_time, first.num_output_tokens)
    scheduled = [seq.request.first_scheduled_time for seq in state.seqs if seq.request.first_scheduled_time is not None]
    first_tokens = [seq.first_token_time for seq in state.seqs if seq.first_token_time is not None]
    last_tokens = [seq.last_token_time for seq in state.seqs if seq.last_token_time is not None]
    return RequestMetrics(
        arrival_time=first.arrival_time,
        n=state.params.n,
        max_tokens=first.max_tokens,
        first_scheduled_time=min(scheduled, default=None),
        first_token_time=min(first_tokens, default=None),
        last_token_time=max(last_tokens, default=None),
        max_num_generation_tokens=max(seq.request.num_output_tokens for seq in state.seqs),
    )


def _cumulative(seq: SeqState, params: SamplingParams) -> CompletionOutput:
    request = seq.request
    return CompletionOutput(
        index=request.sample_index,
        text=seq.text,
        token_ids=list(request.output_token_ids),
        cumulative_logprob=request.cumulative_logprob,
        logprobs=list(request.output_logprobs) if params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        finish_message=seq.finish_message,
    )


def _delta(seq: SeqState, params: SamplingParams) -> CompletionOutput:
    request = seq.request
    first = seq.num_sent_tokens
    held = 0 if seq.finish_reason is not None or not params.stop else stop_holdback(seq.text, params.stop)
    visible = max(len(seq.text) - held, seq.num_sent_chars)
    text = seq.text[seq.num_sent_chars:visible]
    seq.num_sent_tokens = request.num_output_tokens
    seq.num_sent_chars = visible
    return CompletionOutput(
        index=request.sample_index,
        text=text,
        token_ids=request.output_token_ids[first:],
        cumulative_logprob=request.cumulative_logprob,
        logprobs=request.output_logprobs[first:] if params.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        finish_message=seq.finish_message,
    )


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
