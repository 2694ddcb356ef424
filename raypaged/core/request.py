"""One request's token state as the driver tracks it."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raypaged.outputs import FinishReason
from raypaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raypaged.lora.request import LoRARequest
    from raypaged.multimodal import ImageInputs
    from raypaged.pooling_params import PoolingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    # set on each member below: plain attributes, read several times per sequence per step
    # (an enum property would hash the member in Python on every read)
    finished: bool
    finish_reason: FinishReason | None  # that of a finished status


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
for _status in RequestStatus:
    _status.finished = _status in _FINISH_REASONS
    _status.finish_reason = _FINISH_REASONS.get(_status)
del _status


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """Sequences sampled from one prompt (``n``/``best_of``).

    Only the first sequence is scheduled at first; once it has computed
    ``fork_at`` tokens (all of the prompt but its last token) the others are
    forked from it, sharing its blocks, and each computes the last prompt token
    and samples on its own.
    """

    group_id: str
    fork_at: int
    pending_children: list["Request"] = field(default_factory=list)


@dataclass(eq=False)
class Gang:
    """Sequences that advance together (a beam search's beams), owned by the engine core.

    The scheduler appends no token to a member: what a member samples waits in ``held``
    (its id -> the step's top logprobs) until the owner appends tokens, forks members
    (``Scheduler.fork``) or finishes them. The scheduler never preempts a member for a
    sibling, recomputes members rather than swapping them (they fork and drop every
    step), and treats the gang as one unit when a step could run nothing; a member it
    ends on its own is reported by ``take_ended`` like any sequence. It clears a member's
    held sample when the member loses its K/V; ``members`` is the owner's to keep.
    """

    gang_id: str
    members: list["Request"] = field(default_factory=list)  # live
    held: dict[str, dict[int, float]] = field(default_factory=dict)

    def ready(self) -> bool:
        """Every live member has sampled: the owner may advance the gang."""
        return bool(self.members) and all(member.request_id in self.held for member in self.members)


@dataclass(slots=True, eq=False)
class Request:
    """A sequence being generated.

    ``num_computed_tokens`` counts tokens whose K/V sit in the cache; it drops to
    0 on preemption (the request is recomputed from ``all_token_ids``).
    ``max_tokens`` is already resolved against ``max_model_len``.
    ``first_scheduled_time`` is stamped (``time.monotonic()``) the first time
    ``status`` becomes ``RUNNING`` (admitted, forked or swapped in) and never
    moves after, so a preempted request keeps its first queue exit.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)  # of prompt tokens 1, 2, ...
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when it was first admitted
    cumulative_logprob: float = 0.0
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    priority: int = 0  # lower runs first under the priority policy
    sample_index: int = 0  # which sample of its group: seeds a distinct random stream
    group: SequenceGroup | None = None
    # the client request it is a part of (the prompts of one multi-prompt completion share it): FCFS shares the
    # batch and the pool between owners, else between sample groups (``Scheduler._share_key``); None: its own
    owner: str | None = None
    gang: Gang | None = None  # set on every live member of a gang (the beams of a beam search)
    cache_salt: str | None = None  # prefix-cache namespace: only equal salts share cached blocks
    lora: LoRARequest | None = None  # the adapter it runs on (None: the base model)
    # speculative decoding: drafts it may verify per step (0: it never speculates), the drafts proposed
    # for its next step, the tokens its newest update appended, with their logprobs when more than one
    num_spec_tokens: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_new_tokens: int = 0
    run_logprobs: list[float] | None = None
    # output tokens the workers hold (the next step sends them the rest: sampled ones, accepted drafts)
    num_outputs_sent: int = 0
    # async scheduling: tokens a step in flight is sampling for it, counted in ``num_tokens`` before they
    # are known (the workers have them already; the scheduler appends them when the step's results come)
    num_placeholders: int = 0
    # pipeline parallelism: a micro-batch in flight computes it; no other is scheduled for it until that one's
    # results come
    in_flight: bool = False
    # an embedding model's request (--runner pooling): what it asks of its vector, and the vector so far (the
    # pooled parts of its computed prompt chunks: a float32 tensor); it ends when its prompt is computed
    pooling: PoolingParams | None = None
    pooled: Any = None
    token_type_start: int | None = None  # BERT's text pair: its second text's first token (token type 1 from there)
    images: ImageInputs | None = None  # the prompt's images: the workers encode them where their tokens are computed
    prompt_embeds: Any = None  # vLLM's prompt_embeds ([num_prompt, hidden] tensor): its prompt ids are placeholders
    # FCFS: the request it gave its slot to (``Scheduler._free_slot_for``); it may have the slot back once that
    # one has ended, even in a batch that its group's forks took past max_num_seqs
    gave_slot_to: Request | None = field(default=None, init=False)
    first_scheduled_time: float | None = field(default=None, init=False)
    _status: RequestStatus = field(default=RequestStatus.WAITING, init=False)

    @property
    def status(self) -> RequestStatus:
        return self._status

    @status.setter
    def status(self, status: RequestStatus) -> None:
        if status is RequestStatus.RUNNING and self.first_scheduled_time is None:
            self.first_scheduled_time = time.monotonic()
        self._status = status

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Its tokens, those a step in flight samples for it included (``num_placeholders``)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_placeholders

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def prompt_logprobs_missing(self) -> bool:
        """It asked for prompt logprobs and some are still to compute."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    def add_prompt_logprobs(self, start: int, logprobs: list[dict[int, float]]) -> None:
        """Record prompt tokens ``start...``'s logprobs; those already known (a recomputed prefill) are kept."""
        known = len(self.prompt_logprobs) + 1  # the first prompt token has none
        if start <= known < start + len(logprobs):
            self.prompt_logprobs.extend(logprobs[known - start :])

    def append_output_token(self, token_id: int, logprob: float, top_logprobs: dict[int, float] | None) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top_logprobs is not None:
            self.output_logprobs.append(top_logprobs)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drop the newest tokens past ``num_output_tokens`` (a stop string ended the sequence inside
        its newest run of tokens); its cumulative logprob loses theirs."""
        num_dropped = self.num_output_tokens - num_output_tokens
        if num_dropped <= 0:
            return
        assert self.run_logprobs is not None and num_dropped < len(self.run_logprobs), "only the newest run's tokens"
        self.cumulative_logprob -= sum(self.run_logprobs[-num_dropped:])
        del self.output_token_ids[num_output_tokens:]
        if len(self.output_logprobs) > num_output_tokens:
            del self.output_logprobs[num_output_tokens:]
        self.num_new_tokens -= num_dropped
        del self.run_logprobs[-num_dropped:]

    def check_stop(self) -> RequestStatus | None:
        """The finished status the newest token puts this request in, if any. A stop token ends it even below
        ``min_tokens``: the sampler bans them there unless they are all its row allows (a complete grammar)."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last == self.eos_token_id:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
