"""The typed boundary between the driver and the workers.

Per step the driver sends one :class:`SchedulerOutput` to every worker and
gets one :class:`ModelRunnerOutput` back. A request's prompt, sampling params
and block table travel once (``NewRequestData``); afterwards only deltas do.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raypaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from concurrent.futures import Future

    import torch

    from raypaged.lora.request import LoRARequest
    from raypaged.multimodal import ImageInputs


@dataclass(slots=True)
class NewRequestData:
    """A request the worker has not seen (or must rebuild after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    sample_index: int = 0
    lora_int_id: int | None = None  # its adapter (in the slot a step's lora_loads put it in)
    num_spec_tokens: int = 0  # drafts it may verify per step (a draft model proposes them for it)
    token_type_start: int | None = None  # BERT's text pair: its second text's first token (token type 1 from there)
    images: ImageInputs | None = None  # the prompt's images (sent again with a request rebuilt after preemption)
    prompt_embeds: Any = None  # its prompt's embedding rows (vLLM's prompt_embeds; sent again as images are)


@dataclass(slots=True)
class CachedRequestData:
    """A request the worker already holds: only what changed since its last step."""

    request_id: str
    new_token_ids: list[int]  # output tokens the worker has not seen yet
    new_block_ids: list[int]  # appended to the block table
    num_computed_tokens: int
    # (table index, block id) after copy-on-write
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
    # the table's length once new_block_ids are appended (None: no change but the append); shorter
    # than the worker's table plus new_block_ids when rejected drafts' blocks were freed
    num_block_ids: int | None = None


class BlockOpKind(enum.StrEnum):
    """What a :class:`BlockOp` copies (a ``str``: equal to its value, which travels and prints as is)."""

    COPY = "copy"  # device -> device (copy-on-write)
    SWAP_OUT = "swap_out"  # device -> CPU
    SWAP_IN = "swap_in"  # CPU -> device


@dataclass(slots=True, frozen=True)
class BlockOp:
    """Copy one whole block: ``copy`` device→device (copy-on-write), ``swap_out``
    device→CPU, ``swap_in`` CPU→device."""

    kind: BlockOpKind
    src: int
    dst: int


@dataclass(slots=True)
class GrammarBitmask:
    """The tokens each constrained request may sample this step: row ``i`` of ``bitmask``
    ([len(request_ids), ceil(vocab / 32)] int32, bit ``t % 32`` of word ``t // 32`` set = token
    ``t`` allowed) belongs to ``request_ids[i]``. The engine fills the rows on a host thread
    while the forward runs; the worker calls ``ready()`` once it has the logits."""

    request_ids: list[str]
    bitmask: torch.Tensor
    # set while a host thread still fills the rows (during the forward); ``ready()`` waits for it
    pending: Future | None = None

    def ready(self) -> torch.Tensor:
        """The filled rows, once the thread filling them is done."""
        if self.pending is not None:
            self.pending.result()
        return self.bitmask

    def __reduce__(self) -> tuple:  # sent to other processes (Ray shards) filled
        return GrammarBitmask, (self.request_ids, self.ready())


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step, in batch order
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # requests the worker must forget: finished, aborted, preempted or swapped out since the last step
    finished_request_ids: set[str] = field(default_factory=set)
    # block copies to run, in this order, before the step's forward
    block_ops: list[BlockOp] = field(default_factory=list)
    # token masks of the constrained requests that sample this step (structured outputs)
    grammar_bitmask: GrammarBitmask | None = None
    # LoRA adapters to write into device slots before this step's forward: (slot, adapter)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # speculative decoding: request id -> the draft tokens it verifies this step (its scheduled tokens
    # are its last token and these); and whether a draft model proposes for the sequences that sample
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not (self.num_scheduled_tokens or self.block_ops)


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprob: float  # log-probability under the model's raw distribution
    top_logprobs: dict[int, float] | None  # the sampled token plus the top-N, when asked


@dataclass(slots=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens ``start, start + 1, ...`` (each given the tokens before it):
    per token, its own logprob plus the top-N, as ``SampledToken.top_logprobs``."""

    start: int
    logprobs: list[dict[int, float]]


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why one request ended alone, the others unharmed. ``param``: the request field whose value left the
    engine nothing it could do (the request's own doing: a client error, 400 over HTTP); ``None``: handling
    the request failed (a server error, 500)."""

    message: str
    param: str | None = None


@dataclass(slots=True)
class ModelRunnerOutput:
    # request id -> the token sampled for it; requests mid-prefill are absent
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request id -> why sampling its row failed (that request alone ends with an error)
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    # request id -> the prompt logprobs this step's positions gave (requests that asked for them)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # requests that verified drafts: the accepted drafts then the target's own next token (absent from sampled)
    sampled_runs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # request id -> the draft model's proposals for its next step
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # an embedding model's requests: request id -> (first position of its chunk this step, what the chunk adds to
    # its vector: a float32 CPU tensor, ``pooling.chunk_part``)
    pooled: dict[str, tuple[int, Any]] = field(default_factory=dict)
