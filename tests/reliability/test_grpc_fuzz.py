"""Bad input over gRPC: hypothesis-built ``GenerateRequest`` messages against a real engine server.

Every request gets a whole, well-formed stream or a documented refusal; the engine
never dies or stalls; a greedy canary streaming beside them keeps its exact tokens;
and afterwards the engine holds no request and no block. Each input that once killed
or stalled the engine has its own test with its exact answer.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raypaged.serving.channel import MESSAGE_SIZE_OPTIONS, PARAM_METADATA_KEY
from raypaged.serving.gateway.tenants import DEFAULT_MAX_REQUEST_PRIORITY
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from raypaged.serving.protocol import WHOLE_CONTEXT
from tests.serving.conftest import Stack, tiny_config

logger = logging.getLogger(__name__)

VOCAB_SIZE = 49152
MAX_MODEL_LEN = 64
DEADLINE_S = 30
CANARY_DEADLINE_S = 120  # it shares every step with the request being fuzzed
MANY_SAMPLES, SHORT = 8, 4  # requests with more samples generate at most SHORT tokens, so a deadline means a stall
UINT32_MAX = 2**32 - 1
INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
MAX_PRIORITY = DEFAULT_MAX_REQUEST_PRIORITY  # of the open server's one tenant; its least is 0
CANARY = pb.GenerateRequest(
    model="tiny",
    text="A good request",
    sampling=pb.SamplingParameters(temperature=0),
    stopping=pb.StoppingCriteria(max_tokens=20, ignore_eos=True),
)
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}
# the details of the engine's own per-request failure (llm_engine._guarded, model_runner's sampling guard)
ENGINE_ENDED_ONE = re.compile(r"(sampling|ending|detokenizing or stop matching|building the output) failed: ")
BLANKED = r"'.*'|[0-9]+"  # the names and numbers in a refusal's details, to tell refusals apart by kind
ENDED = {pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP}
# request ids drawn again and again, so later requests reuse earlier ones (and the engine's "#" / "/" spellings)
ID_POOL = ["x", "x#1", "x#0", "0:x", "1:x#1", "default/x", "tiny/x", "#", "/", "dup", "canary", " "]
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "\t", "\x00", "🙂", "é", "x#1", "/", "A good"]
CODEPOINT_RANGES = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x2FFF), (0x3000, 0xD7FF), (0xE000, 0x10FFFF)]


# ---- the strategy ----------------------------------------------------------------------------------


def random_text(rng: random.Random, max_chars: int) -> str:
    """Up to ``max_chars`` characters: special-token spellings, control characters and any scalar value."""
    pieces: list[str] = []
    num_chars, target = 0, rng.randint(0, max_chars)
    while num_chars < target:
        if rng.random() < 0.1:
            piece = rng.choice(FRAGMENTS)
        else:
            low, high = rng.choice(CODEPOINT_RANGES)
            piece = chr(rng.randint(low, high))
        pieces.append(piece)
        num_chars += len(piece)
    return "".join(pieces)


def random_token_id(rng: random.Random) -> int:
    """Mostly ids of the vocabulary, some at its edge, some far past it."""
    band = rng.random()
    if band < 0.9:
        return rng.randrange(VOCAB_SIZE)
    if band < 0.97:
        return rng.randint(VOCAB_SIZE - 2, VOCAB_SIZE + 2)
    return rng.randint(VOCAB_SIZE, UINT32_MAX)


def random_message(rng: random.Random) -> pb.ChatMessage:
    role = rng.choice(["system", "user", "assistant", "tool", "", "junk", random_text(rng, 12)])
    return pb.ChatMessage(role=role, content=random_text(rng, 40))


def bulk(make: Callable[[random.Random], Any], max_size: int) -> st.SearchStrategy[list]:
    """Lists of up to ``max_size`` items made from a drawn size and seed (hypothesis' own lists stay short)."""

    def build(size: int, seed: int) -> list:
        rng = random.Random(seed)
        return [make(rng) for _ in range(size)]

    return st.builds(build, st.integers(0, max_size), st.integers(0, UINT32_MAX))


def long_texts(max_chars: int) -> st.SearchStrategy[str]:
    return st.builds(
        lambda size, seed: random_text(random.Random(seed), size), st.integers(0, max_chars), st.integers(0, UINT32_MAX)
    )


CHARS = st.characters(exclude_categories=("Cs",))  # a lone surrogate cannot be put on the wire
short_texts = st.one_of(st.text(CHARS, max_size=12), st.sampled_from(FRAGMENTS))
token_ids = st.one_of(
    st.integers(0, VOCAB_SIZE - 1),
    st.integers(VOCAB_SIZE - 2, VOCAB_SIZE + 2),
    st.integers(0, UINT32_MAX),
)


def uint32s(usual: st.SearchStrategy[int], edges: list[int]) -> st.SearchStrategy[int]:
    return st.one_of(usual, st.sampled_from(edges), st.integers(0, UINT32_MAX))


def doubles(usual: st.SearchStrategy[float]) -> st.SearchStrategy[float]:
    edges = [0.0, -0.0, math.nan, math.inf, -math.inf, -1.0, 1e308, -1e308, 5e-324, 1e-6, 1.0 + 1e-9]
    return st.one_of(usual, st.sampled_from(edges), st.floats())


def optional(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def present(**fields: Any) -> dict[str, Any]:
    """The fields that were drawn (``None`` leaves an optional field unset)."""
    return {name: value for name, value in fields.items() if value is not None}


def prompts(texts: st.SearchStrategy, ids: st.SearchStrategy, turns: st.SearchStrategy) -> st.SearchStrategy[dict]:
    """The prompt oneof as constructor fields: text, token ids or a conversation."""
    return st.one_of(
        st.builds(lambda text: {"text": text}, texts),
        st.builds(lambda token_ids: {"token_ids": pb.TokenIds(ids=token_ids)}, ids),
        st.builds(lambda messages: {"messages": pb.ChatMessages(messages=messages)}, turns),
    )


small_ids = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=40)
few_turns = st.lists(
    st.builds(
        pb.ChatMessage,
        role=st.sampled_from(["system", "user", "assistant", "tool"]),
        content=st.text(CHARS, max_size=8),
    ),
    min_size=1,
    max_size=3,
)
# each field: (a strategy of values a server should serve, one over the field's whole range and size)
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "model": (st.sampled_from(["tiny", ""]), st.text(CHARS, max_size=20)),
    "request_id": (st.one_of(st.just(""), st.sampled_from(ID_POOL), st.text(CHARS, max_size=30)), long_texts(5000)),
    "prompt": (
        prompts(st.one_of(st.sampled_from(FRAGMENTS), st.text(CHARS, min_size=1, max_size=16)), small_ids, few_turns),
        st.one_of(
            prompts(
                st.one_of(short_texts, st.text(CHARS, max_size=200), long_texts(3000)),
                st.one_of(st.lists(token_ids, max_size=80), bulk(random_token_id, 5000)),
                st.one_of(
                    st.lists(st.builds(pb.ChatMessage, role=short_texts, content=short_texts), max_size=6),
                    bulk(random_message, 2000),
                ),
            ),
            st.just({}),
        ),
    ),
    "n": (st.integers(0, 4), uint32s(st.integers(0, 128), [127, 128, 129, 300])),
    "extra_best_of": (optional(st.integers(0, 3)), optional(uint32s(st.integers(0, 300), [UINT32_MAX]))),
    "temperature": (optional(st.floats(0, 2)), optional(doubles(st.floats(-2, 2)))),
    "top_p": (optional(st.floats(0.01, 1)), optional(doubles(st.floats(0, 1)))),
    "top_k": (
        st.one_of(st.integers(-1, 50), st.sampled_from([VOCAB_SIZE - 1, VOCAB_SIZE, VOCAB_SIZE + 1])),
        st.one_of(st.sampled_from(INT32), st.integers(*INT32)),
    ),
    "min_p": (st.floats(0, 1), doubles(st.floats(0, 1))),
    "repetition_penalty": (optional(st.floats(0.5, 2)), optional(doubles(st.floats(0, 2)))),
    "presence_penalty": (st.floats(-2, 2), doubles(st.floats(-2, 2))),
    "frequency_penalty": (st.floats(-2, 2), doubles(st.floats(-2, 2))),
    "seed": (optional(st.integers(0, 100)), st.one_of(st.sampled_from([*INT64, -1]), st.integers(*INT64))),
    "max_tokens": (
        st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.none()),
        uint32s(st.integers(0, 100), [0, 63, 64, 65, UINT32_MAX]),
    ),
    "min_tokens": (st.one_of(st.just(0), st.integers(0, 8)), uint32s(st.integers(0, 100), [63, 64, UINT32_MAX])),
    "stop_sequences": (
        st.lists(st.text(CHARS, min_size=1, max_size=8), max_size=4),
        st.one_of(st.lists(short_texts, max_size=4), bulk(lambda rng: random_text(rng, 400), 100)),
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=8),
        st.one_of(st.lists(token_ids, max_size=8), bulk(random_token_id, 2000)),
    ),
    "logprobs": (
        st.one_of(st.none(), st.integers(0, 5), st.just(20)),
        st.one_of(st.sampled_from([21, VOCAB_SIZE, 100_000]), st.integers(0, 100_000)),
    ),
    "priority": (
        st.one_of(st.just(0), st.just(MAX_PRIORITY), st.integers(0, MAX_PRIORITY)),
        st.one_of(st.sampled_from([*INT32, -1, MAX_PRIORITY + 1]), st.integers(*INT32)),
    ),
    "truncate_prompt_tokens": (
        optional(st.sampled_from([2, 8, WHOLE_CONTEXT])),
        optional(uint32s(st.integers(0, 100), [0, 1, 63, 64, 65, UINT32_MAX - 1])),
    ),
    "add_special_tokens": (optional(st.booleans()), optional(st.booleans())),
    "parent_request_id": (st.one_of(st.just(""), st.sampled_from(["batch-a", "batch-b"])), long_texts(5000)),
}


@st.composite
def generate_requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Any ``GenerateRequest``: every field servable, or one field over its whole range, or any field may be."""
    names = sorted(FIELDS)
    wild = draw(
        st.one_of(
            st.just(frozenset()),
            st.just(frozenset()),
            st.sampled_from(names).map(lambda n: {n}),
            st.sampled_from(names).map(lambda n: {n}),
            st.just(frozenset(names)),
        )
    )

    def field(name: str) -> Any:
        servable, whole_range = FIELDS[name]
        if name not in wild:
            return draw(servable)
        return draw(whole_range if len(wild) == 1 else st.one_of(servable, whole_range))

    n = field("n")
    extra_best_of = field("extra_best_of")
    best_of = extra_best_of if "extra_best_of" in wild or extra_best_of is None else max(n, 1) + extra_best_of
    max_tokens = field("max_tokens")
    if max(n, best_of or 0) > MANY_SAMPLES:  # CPU sampling of 128 rows takes up to a second a step
        max_tokens = SHORT if max_tokens is None else min(max_tokens, SHORT)
    min_tokens = field("min_tokens")
    if "min_tokens" not in wild:
        min_tokens = min(min_tokens, max_tokens or 0)
    sampling = pb.SamplingParameters(
        **present(
            n=n,
            best_of=best_of,
            **{
                name: field(name)
                for name in (
                    "temperature",
                    "top_p",
                    "top_k",
                    "min_p",
                    "repetition_penalty",
                    "presence_penalty",
                    "frequency_penalty",
                    "seed",
                )
            },
        )
    )
    stopping = pb.StoppingCriteria(
        **present(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop_sequences=field("stop_sequences"),
            stop_token_ids=field("stop_token_ids"),
            ignore_eos=draw(st.booleans()),
            skip_special_tokens=draw(optional(st.booleans())),
        )
    )
    return pb.GenerateRequest(
        **present(
            request_id=field("request_id"),
            model=field("model"),
            logprobs=field("logprobs"),
            priority=field("priority"),
            truncate_prompt_tokens=field("truncate_prompt_tokens"),
            add_special_tokens=field("add_special_tokens"),
            parent_request_id=field("parent_request_id"),
        ),
        sampling=sampling,
        stopping=stopping,
        **field("prompt"),
    )


# ---- reading and checking streams -------------------------------------------------------------------


@dataclass
class Finished:
    """A whole stream: each completion's token ids (by index) and the last message's usage."""

    request_id: str
    token_ids: dict[int, list[int]]
    usage: pb.Usage


def read_stream(
    stub: pb_grpc.TextGenerationServiceStub, request: pb.GenerateRequest, timeout_s: float = DEADLINE_S
) -> list[pb.GenerateResponse]:
    """Every message of one ``Generate`` call; a failed call raises its ``grpc.RpcError``."""
    call = stub.Generate(request, timeout=timeout_s)
    try:
        return list(call)
    finally:
        call.cancel()


def check_stream(request: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> Finished:
    """The stream answers ``request``: an empty first message with its id, deltas of ``n`` completions that
    each end once within the token budget, and one last ``finished`` message whose usage counts every sample."""
    assert responses, "the call ended without a message"
    first, *rest = responses
    assert first.request_id == request.request_id if request.request_id else first.request_id
    assert not first.outputs and not first.finished
    assert rest and rest[-1].finished and not any(r.finished for r in rest[:-1])
    num_completions = request.sampling.n or 1
    token_ids: dict[int, list[int]] = {}
    ended: dict[int, pb.CompletionDelta] = {}
    for response in rest:
        assert response.request_id == first.request_id
        for delta in response.outputs:
            assert delta.index < num_completions and delta.index not in ended, delta.index
            token_ids.setdefault(delta.index, []).extend(delta.token_ids)
            num_new = len(delta.token_ids)
            if request.HasField("logprobs"):
                assert len(delta.logprobs) == len(delta.token_texts) == len(delta.top_logprobs) == num_new
                assert all(len(top.token_ids) == request.logprobs for top in delta.top_logprobs)
            else:
                assert not delta.logprobs and not delta.top_logprobs
            if delta.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                ended[delta.index] = delta
    assert sorted(ended) == list(range(num_completions))
    usage = rest[-1].usage
    room = MAX_MODEL_LEN - usage.prompt_tokens
    budget = min(request.stopping.max_tokens, room) if request.stopping.HasField("max_tokens") else room
    for index, delta in ended.items():
        ids = token_ids.get(index, [])
        assert delta.finish_reason in ENDED, delta
        assert 1 <= len(ids) <= budget and all(i < VOCAB_SIZE for i in ids), (index, len(ids), budget)
        if delta.finish_reason == pb.FINISH_REASON_LENGTH and not delta.finish_message:
            assert len(ids) == budget, (index, len(ids), budget)
    num_shown = sum(len(ids) for ids in token_ids.values())
    ranked = request.sampling.HasField("best_of") and request.sampling.best_of > num_completions
    assert usage.completion_tokens >= num_shown if ranked else usage.completion_tokens == num_shown
    return Finished(first.request_id, token_ids, usage)


def generate(stub: pb_grpc.TextGenerationServiceStub, request: pb.GenerateRequest) -> Finished:
    return check_stream(request, read_stream(stub, request))


def canary_ids(stub: pb_grpc.TextGenerationServiceStub) -> list[int]:
    return check_stream(CANARY, read_stream(stub, CANARY, CANARY_DEADLINE_S)).token_ids[0]


@dataclass
class Refusal:
    code: grpc.StatusCode
    details: str
    param: str | None  # trailing metadata raypaged-param: the field at fault
    took_s: float


def refusal(stub: pb_grpc.TextGenerationServiceStub, request: pb.GenerateRequest) -> Refusal:
    """How the server refuses ``request``, and how long that took."""
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        read_stream(stub, request)
    param = dict(info.value.trailing_metadata() or ()).get(PARAM_METADATA_KEY)
    return Refusal(info.value.code(), info.value.details(), param, time.monotonic() - start)


class Canary:
    """The greedy ``CANARY`` request sent again and again on a thread while others arrive; each must keep its ids."""

    def __init__(self, stub: pb_grpc.TextGenerationServiceStub, reference: list[int]) -> None:
        self.num_streams = 0
        self.errors: list[str] = []
        self._stub = stub
        self._reference = reference
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                ids = canary_ids(self._stub)
            except grpc.RpcError as exc:
                self.errors.append(f"{exc.code()}: {exc.details()}")
            except Exception as exc:  # a malformed stream
                self.errors.append(repr(exc))
            else:
                self.num_streams += 1
                if ids != self._reference:
                    self.errors.append(f"token ids {ids} instead of {self._reference}")

    def stop(self) -> int:
        """Stops the thread; returns how many streams it read, all with the reference ids."""
        self._stop.set()
        self._thread.join(timeout=2 * CANARY_DEADLINE_S)
        assert not self._thread.is_alive()
        assert self.errors == []
        return self.num_streams


def assert_serving(stub: pb_grpc.TextGenerationServiceStub) -> None:
    health = stub.Health(pb.HealthRequest(), timeout=5)
    assert health.status == pb.SERVING_STATUS_SERVING, health.message


def assert_engine_idle(stack: Stack, within_s: float = 5) -> None:
    """No request left running, waiting or swapped, and every block free (the last aborts may still apply)."""
    deadline = time.monotonic() + within_s
    while True:
        stats = stack.engine().stats()
        held = {k: stats[k] for k in ("num_requests_running", "num_requests_waiting", "num_requests_swapped")}
        idle = not any(held.values()) and stats["num_gpu_blocks_free"] == stats["num_gpu_blocks_total"]
        if idle:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


# ---- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_model_dir) -> Iterator[Stack]:
    stack = Stack([tiny_config(tiny_model_dir, "tiny", num_gpu_blocks_override=512, max_model_len=MAX_MODEL_LEN)])
    yield stack
    stack.close()


@pytest.fixture(scope="module")
def stub(stack) -> Iterator[pb_grpc.TextGenerationServiceStub]:
    """A stub on a channel with the gateway's message size limits."""
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}", options=MESSAGE_SIZE_OPTIONS)
    yield pb_grpc.TextGenerationServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def reference(stub) -> list[int]:
    """The canary's token ids, from its first call on the idle server."""
    ids = canary_ids(stub)
    assert len(ids) == CANARY.stopping.max_tokens
    return ids


# ---- the fuzzing ------------------------------------------------------------------------------------


def test_fuzzed_generate_requests_get_a_whole_stream_or_a_refusal(stack, stub, reference, soak):
    num_cases = 1000 if soak else 150
    outcomes: Counter[str] = Counter()
    engine_failures: list[str] = []
    answers: Counter[str] = Counter()  # refusals with their numbers blanked out, to see what the fuzzing reached
    canary = Canary(stub, reference)

    @settings(max_examples=num_cases, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(request=generate_requests())
    def fuzz(request: pb.GenerateRequest) -> None:
        try:
            check_stream(request, read_stream(stub, request))
            outcomes["stream"] += 1
        except grpc.RpcError as exc:
            code, details = exc.code(), exc.details()
            engine_ended_one = code == grpc.StatusCode.INTERNAL and ENGINE_ENDED_ONE.match(details or "")
            assert code in REFUSALS or engine_ended_one, (code, details)
            if engine_ended_one:
                logger.warning("the engine ended one request alone: %s (request %.500s)", details, request)
                engine_failures.append(details)
            outcomes[code.name] += 1
            answers[f"{code.name}: {re.sub(BLANKED, 'N', details or '')[:120]}"] += 1
        assert_serving(stub)

    start = time.monotonic()
    try:
        fuzz()
    finally:
        num_canaries = canary.stop()
    print(
        f"{sum(outcomes.values())} fuzzed requests in {time.monotonic() - start:.0f} s: {dict(outcomes)}; "
        f"{num_canaries} canary streams; engine failures of one request: {engine_failures}"
    )
    print("\n".join(f"{count:5d} {answer}" for answer, count in answers.most_common()))
    assert sum(outcomes.values()) >= num_cases and outcomes["stream"] > 0 and num_canaries > 0
    assert_engine_idle(stack)


# ---- inputs that once killed or stalled the engine --------------------------------------------------


def greedy(max_tokens: int, **fields: Any) -> pb.GenerateRequest:
    """``CANARY``'s prompt, greedy with ``ignore_eos``, with ``fields`` set on top."""
    sampling = fields.pop("sampling", pb.SamplingParameters(temperature=0))
    stopping = fields.pop("stopping", pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True))
    return pb.GenerateRequest(model="tiny", text=CANARY.text, sampling=sampling, stopping=stopping, **fields)


@pytest.fixture
def then_canary_unchanged(stack, stub, reference) -> Iterator[None]:
    """After the test: the engine is idle and serving, and the canary still gets its exact ids."""
    yield
    assert_engine_idle(stack)
    assert_serving(stub)
    assert canary_ids(stub) == reference


@pytest.mark.usefixtures("then_canary_unchanged")
@pytest.mark.parametrize(
    ("request_fields", "param", "message", "within_s"),
    [
        (
            dict(stopping=pb.StoppingCriteria(max_tokens=4, stop_token_ids=[VOCAB_SIZE])),
            "stop_token_ids",
            "stop_token_ids must be token ids in [0, 49152), got 49152",
            5,
        ),
        (
            dict(logprobs=100_000),
            "logprobs",
            "logprobs 100000 is more than the limit of 20 (--max-logprobs, at most the vocabulary size 49152)",
            5,
        ),
        (
            dict(sampling=pb.SamplingParameters(n=1000)),
            "n",
            "n has 1000 samples, more than the limit of 128 (--max-num-samples)",
            5,
        ),
        (
            dict(stopping=pb.StoppingCriteria(max_tokens=4, stop_sequences=[f"s{i}" for i in range(200_000)])),
            "stop",
            "stop has 200000 stop strings, more than the limit of 64 (--max-stop-strings)",
            1,
        ),
        # about 3 MB on the wire: under MESSAGE_SIZE_OPTIONS' 256 MiB, so the input gate answers, not gRPC
        (
            dict(stopping=pb.StoppingCriteria(max_tokens=4, stop_token_ids=[i % VOCAB_SIZE for i in range(1_000_000)])),
            "stop_token_ids",
            "stop_token_ids has 1000000 ids, more than the limit of 1024 (--max-stop-token-ids)",
            1,
        ),
    ],
    ids=["stop_token_id_past_vocab", "logprobs_100000", "n_1000", "200k_stop_strings", "1m_stop_token_ids"],
)
def test_input_that_once_broke_the_engine_is_refused_quickly(stub, request_fields, param, message, within_s):
    refused = refusal(stub, greedy(4, **request_fields))
    assert (refused.code, refused.details, refused.param) == (grpc.StatusCode.INVALID_ARGUMENT, message, param)
    assert refused.took_s < within_s, refused.took_s


@pytest.mark.usefixtures("then_canary_unchanged")
def test_best_of_returns_one_ranked_completion_and_counts_every_sample(stub):
    request = greedy(8, sampling=pb.SamplingParameters(n=1, best_of=3, temperature=1.0, seed=7))
    finished = generate(stub, request)
    assert list(finished.token_ids) == [0] and len(finished.token_ids[0]) == 8
    assert finished.usage.completion_tokens == 3 * 8


@pytest.mark.usefixtures("then_canary_unchanged")
def test_request_ids_spelled_like_sample_ids_run_side_by_side(stub):
    # seeded sampling with top_k: the slow path, so the two overlap; same seed, so the same tokens
    sampling = pb.SamplingParameters(n=2, temperature=1.0, top_k=5, seed=11)
    requests = [greedy(40, request_id=request_id, sampling=sampling) for request_id in ("x#1", "x")]
    calls = [stub.Generate(request, timeout=DEADLINE_S) for request in requests]
    with ThreadPoolExecutor(len(calls)) as pool:
        streams = list(pool.map(lambda call: [(time.monotonic(), response) for response in call], calls))
    (first_x1, last_x1), (first_x, last_x) = [(stream[0][0], stream[-1][0]) for stream in streams]
    assert first_x < last_x1 and first_x1 < last_x  # each was accepted while the other ran
    finished = [check_stream(request, [r for _, r in stream]) for request, stream in zip(requests, streams)]
    assert [f.request_id for f in finished] == ["x#1", "x"]
    for f in finished:
        assert {index: len(ids) for index, ids in f.token_ids.items()} == {0: 40, 1: 40}
        assert f.usage.completion_tokens == 80
    assert finished[0].token_ids == finished[1].token_ids


@pytest.mark.usefixtures("then_canary_unchanged")
def test_a_request_id_in_flight_is_refused_to_a_second_request(stub):
    running = greedy(56, request_id="dup", sampling=pb.SamplingParameters(n=32, temperature=0))
    call = stub.Generate(running, timeout=DEADLINE_S)
    first = next(call)
    refused = refusal(stub, greedy(4, request_id="dup"))
    assert (refused.code, refused.details) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id 'dup' is already in use")
    finished = check_stream(running, [first, *call])
    assert finished.request_id == "dup" and finished.usage.completion_tokens == 32 * 56
