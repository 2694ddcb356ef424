"""Data parallelism: ``raypaged serve -dp 2`` runs two engine processes behind one gateway, which balances requests
over them; ``raypaged gateway`` takes several engines for one name; the flags that cannot be honoured are refused."""

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypaged.entrypoints.cli import build_parser, data_parallel_ranks, engine_configs
from raypaged.serving.engine_process import data_parallel_env
from raypaged.serving.launch import parse_engine_targets
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.proto import generate_pb2_grpc as pb_grpc
from tests.conftest import make_tiny_model
from tests.entrypoints.test_cli import free_port


def successes(client: httpx.Client) -> dict[tuple[str, str, str], float]:
    """``request_success_total`` by (model, engine, finish reason); every sample of the exposition is unique."""
    samples = [s for family in text_string_to_metric_families(client.get("/metrics").text) for s in family.samples]
    keys = [(s.name, tuple(sorted(s.labels.items()))) for s in samples]
    assert len(keys) == len(set(keys))
    assert [s.name for s in samples].count("process_resident_memory_bytes") == 1  # the first engine's
    return {
        (s.labels["model_name"], s.labels["engine"], s.labels["finished_reason"]): s.value
        for s in samples
        if s.name == "raypaged:request_success_total"
    }


def served(successes: dict[tuple[str, str, str], float], reason: str = "length") -> dict[str, float]:
    """Requests finished with ``reason`` by engine, all models."""
    by_engine = {"0": 0.0, "1": 0.0}
    for (_, engine, why), value in successes.items():
        if why == reason:
            by_engine[engine] += value
    return by_engine


def test_serve_runs_two_models_on_two_balanced_engine_processes(tmp_path, smollm2_dir):
    tiny = make_tiny_model(tmp_path, smollm2_dir)
    port, grpc_port = free_port(), free_port()
    model_flags = ["--model", str(tiny), "--served-model-name", "a", "--model", str(tiny), "--served-model-name", "b"]
    server = subprocess.Popen(
        [sys.executable, "-m", "raypaged.entrypoints.cli", "serve", *model_flags, "-dp", "2"]
        + ["--port", str(port), "--grpc-port", str(grpc_port), "--num-gpu-blocks-override", "32"]
        + ["--max-model-len", "128", "--disable-log-requests"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES")},
    )
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, server.stdout.read()
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.2)
            engines = psutil.Process(server.pid).children()
            assert len(engines) == 2
            threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
            assert sorted((e.environ()["OMP_NUM_THREADS"], e.environ()["CUDA_VISIBLE_DEVICES"]) for e in engines) == [
                (threads, "0"),
                (threads, "1"),
            ]
            for rank in (0, 1):  # each rank's gRPC server, on the port after the last
                with grpc.insecure_channel(f"127.0.0.1:{grpc_port + rank}") as channel:
                    health = pb_grpc.TextGenerationServiceStub(channel).Health(pb.HealthRequest(), timeout=10)
                    assert health.status == pb.SERVING_STATUS_SERVING
            assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["a", "b"]

            # one after another, each model's requests alternate over the two engines, which answer alike
            texts: dict[str, set[str]] = {"a": set(), "b": set()}
            for name in ("a", "a", "a", "a", "b", "b", "b", "b"):
                body = {"model": name, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
                answer = client.post("/v1/completions", json=body).json()
                assert answer["model"] == name and answer["usage"]["completion_tokens"] == 5
                texts[name].add(answer["choices"][0]["text"])
            assert [len(found) for found in texts.values()] == [1, 1]
            finished = successes(client)
            assert {(m, e): finished[(m, e, "length")] for m in "ab" for e in "01"} == {
                ("a", "0"): 2.0,
                ("a", "1"): 2.0,
                ("b", "0"): 2.0,
                ("b", "1"): 2.0,
            }

            # a stream that its client leaves gives its engine's slot back: the next two go one to each engine
            body = {"model": "a", "prompt": "Hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as stream:
                next(stream.iter_lines())
            deadline = time.monotonic() + 30
            while served(successes(client), "abort") != {"0": 1.0, "1": 0.0} and time.monotonic() < deadline:
                time.sleep(0.1)
            assert served(successes(client), "abort") == {"0": 1.0, "1": 0.0}
            for _ in range(2):
                body = {"model": "b", "prompt": "Hi", "max_tokens": 2, "ignore_eos": True, "stream": True}
                with client.stream("POST", "/v1/completions", json=body) as stream:
                    assert stream.read().endswith(b"data: [DONE]\n\n")
            assert served(successes(client)) == {"0": 5.0, "1": 5.0}

            # rank 1's process dies: rank 0 serves every request while rank 1 is started again, then both do
            seen = {engine.pid for engine in engines}
            engines[1].send_signal(signal.SIGKILL)
            wait_for_ranks(client, {"0"})
            for _ in range(3):
                assert complete(client, "a") == texts["a"]
            wait_for_ranks(client, {"0", "1"})
            assert served(successes(client)) == {"0": 8.0, "1": 0.0}  # the new rank 1 has served nothing yet
            assert [complete(client, "a"), complete(client, "a")] == [texts["a"], texts["a"]]
            assert served(successes(client)) == {"0": 9.0, "1": 1.0}

            # lost more than twice within a minute: the server stops, for its supervisor to start it again
            for again in range(2):
                [rank_1] = [p for p in psutil.Process(server.pid).children() if p.pid not in seen]
                seen.add(rank_1.pid)
                rank_1.send_signal(signal.SIGKILL)
                if again == 0:
                    wait_for_ranks(client, {"0"})
                    wait_for_ranks(client, {"0", "1"})
        assert server.wait(timeout=60) == 1
        assert re.search(
            r"error: data-parallel rank 1: the engine process has exited \(exit code -9\), 3 times within 60 s",
            server.stdout.read(),
        )
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=30)


def complete(client: httpx.Client, name: str) -> set[str]:
    body = {"model": name, "prompt": "Hi", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    return {client.post("/v1/completions", json=body).json()["choices"][0]["text"]}


def wait_for_ranks(client: httpx.Client, ranks: set[str], timeout_s: float = 60) -> None:
    """Until the engines answering ``/metrics`` are ``ranks``; ``/health`` is 200 all the while (one rank serves)."""
    deadline = time.monotonic() + timeout_s
    while {engine for _, engine, _ in successes(client)} != ranks:
        assert client.get("/health").status_code == 200
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_gateway_engines_named_more_than_once_are_replicas():
    assert parse_engine_targets(["m=h:1", "n=h:3", "m=h:2"]) == {"m": ("h:1", "h:2"), "n": ("h:3",)}
    with pytest.raises(ValueError, match=r"^--engine m=h:1 is given twice$"):
        parse_engine_targets(["m=h:1", "m=h:1"])
    from raypaged.entrypoints.cli import cmd_gateway

    args = build_parser().parse_args(["gateway", "--engine", "m=h:1", "--data-parallel-routing", "cache_aware"])
    with pytest.raises(ValueError) as info:
        cmd_gateway(args)
    assert str(info.value) == (
        "--data-parallel-routing cache_aware needs a model served by several engines (--engine NAME=host:port given "
        "more than once for a name)"
    )


def test_each_rank_takes_its_share_of_threads_and_its_devices():
    env = data_parallel_env(1, 2, 2, {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "OMP_NUM_THREADS": "8", "X": "y"})
    assert env == {"CUDA_VISIBLE_DEVICES": "6,7", "OMP_NUM_THREADS": "8", "X": "y"}
    assert data_parallel_env(2, 3, 1, {})["CUDA_VISIBLE_DEVICES"] == "2"
    with pytest.raises(ValueError) as info:
        data_parallel_env(0, 2, 2, {"CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert str(info.value) == (
        "--data-parallel-size 2 with --tensor-parallel-size 2 takes 4 devices, but CUDA_VISIBLE_DEVICES lists 3"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-dp", "0"], "--data-parallel-size must be at least 1, got 0"),
        (
            ["-dp", "2", "-dpl", "1"],
            "--data-parallel-size-local 1 is not supported: `raypaged serve` runs all --data-parallel-size 2 ranks "
            "on this node",
        ),
        (
            ["--data-parallel-routing", "cache_aware"],
            "--data-parallel-routing cache_aware needs --data-parallel-size above 1 (one engine serves every request)",
        ),
        (
            ["-dp", "2", "--enable-expert-parallel"],
            "--enable-expert-parallel with --data-parallel-size 2 is not supported: experts are split over each "
            "replica's tensor-parallel shards, never across data-parallel ranks",
        ),
    ],
)
def test_serve_refuses_data_parallel_flags_it_cannot_honour(argv, message):
    with pytest.raises(ValueError) as info:
        data_parallel_ranks(build_parser().parse_args(["serve", *argv]))
    assert str(info.value) == message


def test_serve_takes_the_ranks_and_leaves_each_engine_one(tiny_model_dir):
    args = build_parser().parse_args(["serve", str(tiny_model_dir), "-dp", "2", "-dpl", "2", "-dpb", "mp"])
    assert data_parallel_ranks(args) == 2
    [config] = engine_configs(args)  # what each rank's engine process builds
    assert config.model == str(tiny_model_dir)


def test_one_engine_refuses_data_parallelism(tiny_model_dir):
    with pytest.raises(ValueError) as info:
        engine_configs(build_parser().parse_args(["engine", str(tiny_model_dir), "-dp", "2"]))
    assert str(info.value) == (
        "--data-parallel-size 2 is not supported: this runs one engine; `raypaged serve -dp N` runs N engine "
        "processes behind its gateway, and `raypaged gateway` balances over the engines named with --engine "
        "NAME=host:port, once per rank"
    )


@pytest.mark.parametrize("routing", ["cache_aware", "least_loaded"])
def test_cache_aware_routing_keeps_a_conversation_on_its_replica(tiny_model_dir, routing):
    """Two engine servers behind one gateway, three conversations of three turns each, one request at a time: with
    cache_aware routing every later turn finds its conversation's earlier turns in its replica's prefix cache;
    least_loaded alternates the replicas, so here no later turn does."""
    import asyncio

    from raypaged.serving.engine_server import EngineServer
    from raypaged.serving.inprocess import InProcessStub
    from raypaged.serving.launch import Gateway, GatewayOptions
    from tests.serving.conftest import BackgroundLoop, tiny_config

    background = BackgroundLoop()
    servers = [EngineServer([tiny_config(tiny_model_dir, "tiny", block_size=4)], engine_index=i) for i in range(2)]
    ports = [background.run(server.start("127.0.0.1", 0)) for server in servers]
    local = {f"127.0.0.1:{port}": InProcessStub(server.servicer) for port, server in zip(ports, servers)}
    options = GatewayOptions(
        port=0, log_level="warning", enable_prompt_tokens_details=True, data_parallel_routing=routing
    )
    gateway = Gateway({"tiny": tuple(local)}, options, local)
    serving = asyncio.run_coroutine_threadsafe(gateway.serve(), background.loop)
    try:
        while not gateway.server.started:
            time.sleep(0.05)
        found_earlier_turns = []  # per later turn: whether its replica held the turn before it (all but a block)
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway.port}", timeout=60) as client:
            conversations = [[{"role": "user", "content": f"Tell me story number {n} about a cat."}] for n in range(3)]
            before = [0] * 3  # each conversation's last prompt length
            for turn in range(3):
                for n, messages in enumerate(conversations):
                    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0}
                    usage = (answer := client.post("/v1/chat/completions", json={**body, "ignore_eos": True}).json())[
                        "usage"
                    ]
                    if turn:
                        found_earlier_turns.append(usage["prompt_tokens_details"]["cached_tokens"] >= before[n] - 4)
                    before[n] = usage["prompt_tokens"]
                    messages += [answer["choices"][0]["message"], {"role": "user", "content": f"And then {turn}?"}]
        if routing == "cache_aware":
            assert found_earlier_turns == [True] * 6
        else:  # three conversations over two replicas in turn: each later turn runs where the one before did not
            assert found_earlier_turns == [False] * 6
    finally:
        gateway.stop()
        serving.result(timeout=30)
        for server in servers:
            background.run(server.stop())
        background.close()
