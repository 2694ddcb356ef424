"""Conversions between the gRPC messages and the engine's types."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from raypaged.inputs.limits import InputLimits, check_stop_counts
from raypaged.outputs import CompletionOutput, RequestOutput
from raypaged.sampling_params import SamplingParams
from raypaged.serving.proto import generate_pb2 as pb

FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "abort": pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(request: pb.GenerateRequest, limits: InputLimits) -> SamplingParams:
    """The request's ``SamplingParams``; bad values raise ``ValueError`` naming the field.

    The stop lists' sizes are checked before they are copied out of the message.
    """
    sampling, stopping = request.sampling, request.stopping
    check_stop_counts(len(stopping.stop_sequences), len(stopping.stop_token_ids), limits)
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number, got {value}")
    kwargs: dict = dict(
        n=sampling.n or 1,
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k or None,
        min_p=sampling.min_p,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        seed=sampling.seed if sampling.HasField("seed") else None,
        max_tokens=stopping.max_tokens if stopping.HasField("max_tokens") else None,
        min_tokens=stopping.min_tokens,
        stop=list(stopping.stop_sequences),
        stop_token_ids=list(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        logprobs=request.logprobs if request.HasField("logprobs") else None,
        skip_special_tokens=stopping.skip_special_tokens if stopping.HasField("skip_special_tokens") else True,
    )
    if sampling.HasField("best_of"):
        kwargs["best_of"] = sampling.best_of
    try:
        return SamplingParams(**kwargs)
    except TypeError as exc:  # a field this engine build does not know
        raise ValueError(str(exc)) from None


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: pb.ChatMessages) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template and a generation prompt."""
    conversation = [{"role": m.role, "content": m.content} for m in messages.messages]
    if not conversation:
        raise ValueError("messages must not be empty")
    if tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template; use completions")
    text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


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


@dataclass(slots=True)
class _Sent:
    num_chars: int = 0
    num_tokens: int = 0
    done: bool = False


@dataclass
class DeltaTracker:
    """Turns a request's cumulative outputs into ``GenerateResponse`` deltas.

    While a completion runs, text that could be the start of a stop string is
    held back (the longest end of the text that is a stop string's beginning,
    so at most the longest stop string's length minus one character): a stop
    string completed by a later token is cut from text that must not have been
    sent yet.
    """

    request_id: str
    params: SamplingParams
    tokenizer: PreTrainedTokenizerBase
    _sent: dict[int, _Sent] = field(default_factory=dict)
    _usage: pb.Usage = field(default_factory=pb.Usage)

    def response(self, output: RequestOutput) -> pb.GenerateResponse:
        deltas = [self._delta(c) for c in output.outputs if not self._sent.setdefault(c.index, _Sent()).done]
        self._usage = pb.Usage(prompt_tokens=len(output.prompt_token_ids), completion_tokens=output.num_generated_tokens)
        return pb.GenerateResponse(request_id=self.request_id, outputs=deltas, finished=output.finished, usage=self._usage)

    def aborted(self) -> pb.GenerateResponse:
        """The last message of a request aborted by someone else: every unfinished completion ends."""
        indices = [i for i in range(self.params.n) if not self._sent.get(i, _Sent()).done]
        deltas = [pb.CompletionDelta(index=i, finish_reason=pb.FINISH_REASON_ABORT) for i in indices]
        return pb.GenerateResponse(request_id=self.request_id, outputs=deltas, finished=True, usage=self._usage)

    def _delta(self, completion: CompletionOutput) -> pb.CompletionDelta:
        sent = self._sent[completion.index]
        finished = completion.finish_reason is not None
        holdback = 0 if finished else stop_holdback(completion.text, self.params.stop)
        visible = len(completion.text) - holdback
        text = completion.text[sent.num_chars:visible] if visible > sent.num_chars else ""
        new_ids = completion.token_ids[sent.num_tokens:]
        delta = pb.CompletionDelta(index=completion.index, token_ids=new_ids, text=text)
        if completion.logprobs is not None:
            self._add_logprobs(delta, new_ids, completion.logprobs[sent.num_tokens:])
        if finished:
            delta.finish_reason = FINISH_REASONS[completion.finish_reason]
            if completion.stop_reason is not None:
                delta.stop_reason = str(completion.stop_reason)
            if completion.finish_message is not None:
                delta.finish_message = completion.finish_message
            sent.done = True
        sent.num_chars += len(text)
        sent.num_tokens = len(completion.token_ids)
        return delta

    def _add_logprobs(self, delta: pb.CompletionDelta, token_ids: list[int], logprobs: list[dict[int, float]]) -> None:
        num_top = self.params.logprobs or 0
        for token_id, candidates in zip(token_ids, logprobs):
            delta.logprobs.append(candidates[token_id])
            delta.token_texts.append(self.tokenizer.decode([token_id]))
            top = sorted(candidates.items(), key=lambda item: -item[1])[:num_top]
            delta.top_logprobs.append(
                pb.TopLogprobs(
                    token_ids=[t for t, _ in top],
                    logprobs=[lp for _, lp in top],
                    token_texts=[self.tokenizer.decode([t]) for t, _ in top],
                )
            )
