"""What one ``Generate`` response costs on the token path, as protobuf messages and as plain objects.

Per response: ``DeltaTracker.response`` builds it from a ``RequestOutput`` (the engine server's
part), then the gateway's ``ChunkWriter.chunks`` turns it into its stream chunk (the reading
part), with ``generate_pb2`` (the gRPC link's form, before serialization) or ``serving/messages.py``
(the in-process link's). Two outputs: one token of one completion, and one token with 5 top
logprobs. Beside them, the once-per-request part of the request direction: the gateway's
``GenerateRequest`` (``CompletionRequest.generate_request``) and the engine server's reading of it
(``sampling_params_from_proto``). Each time is the median of ``--passes`` passes, the variants
taking turns, each pass the mean of ``--calls`` calls; microseconds.

    python benchmarks/stream_messages.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from transformers import AutoTokenizer

from raypaged.inputs.limits import InputLimits
from raypaged.model.default_model import default_model_dir
from raypaged.outputs import CompletionOutput, Logprob, RequestOutput
from raypaged.sampling_params import SamplingParams
from raypaged.serving import messages
from raypaged.serving.gateway.responses import ChunkWriter, ResponseShape
from raypaged.serving.gateway.schemas import CompletionRequest
from raypaged.serving.proto import generate_pb2 as pb
from raypaged.serving.protocol import DeltaTracker, sampling_params_from_proto

PROMPT_IDS = list(range(100, 164))
FORMS = {"protobuf": pb, "plain": messages}


def _output(step: int, num_top: int) -> RequestOutput:
    token = 1000 + step % 50
    logprobs = None
    if num_top:
        logprobs = [{token: Logprob(-0.5, 1), **{token + k: Logprob(-1.0 - k, k + 1) for k in range(1, num_top)}}]
    completion = CompletionOutput(0, " word", [token], None, logprobs)
    return RequestOutput("r", None, PROMPT_IDS, [completion], False, step + 1)


def _per_response(tokenizer, messages_of, num_top: int, calls: int) -> Callable[[], float]:
    params = SamplingParams(max_tokens=calls + 1, logprobs=num_top or None)
    outputs = [_output(step, num_top) for step in range(calls)]

    def run() -> float:
        tracker = DeltaTracker("r", params, tokenizer, messages_of)
        writer = ChunkWriter(ResponseShape(False, "m", 1, num_top > 0), 1, include_usage=False)
        start = time.perf_counter()
        for output in outputs:
            writer.chunks(0, tracker.response(output))
        return (time.perf_counter() - start) / calls * 1e6

    return run


def _per_request(calls: int) -> Callable[[], float]:
    body = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "hello",
            "max_tokens": 100,
            "temperature": 0.7,
            "top_p": 0.9,
            "stop": ["\n\n"],
            "seed": 3,
        }
    )
    limits = InputLimits()

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            request = body.generate_request("m", {"text": "hello"}, None, body.resolved_max_tokens, 0, None)
            sampling_params_from_proto(request, limits)
        return (time.perf_counter() - start) / calls * 1e6

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    variants = {
        f"{label}, {form}": _per_response(tokenizer, module, num_top, args.calls)
        for label, num_top in (("1 token", 0), ("1 token + 5 top logprobs", 5))
        for form, module in FORMS.items()
    }
    variants["GenerateRequest built + read (once per request)"] = _per_request(args.calls)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.passes):
        for name, run in variants.items():
            times[name].append(run())
    print("| per response: build (DeltaTracker) + read (ChunkWriter) | µs, median |\n| --- | ---: |")
    for name, found in times.items():
        print(f"| {name} | {statistics.median(found):.2f} |")


if __name__ == "__main__":
    main()
