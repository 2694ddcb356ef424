"""``raypaged run-batch``: vLLM's ``vllm run-batch``, a file of OpenAI Batch requests answered offline.

Each input line is ``{"custom_id", "method": "POST", "url", "body"}``. The engines run in this process and
each body goes to its url through the HTTP gateway's own app (an ASGI call, no socket), so answers, errors
and validation are ``raypaged serve``'s. Output lines keep the input's order, as vLLM writes them:
``{"id": "vllm-…", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`` with

- an answer (2xx): ``body`` the endpoint's JSON, ``error`` null;
- an error answer: ``status_code`` its status, ``body`` null, ``error`` the gateway's error body;
- a line that is not sent (not JSON, no ``custom_id``, a method other than POST, a url not served,
  ``"stream": true``): ``status_code`` 400, ``body`` null, ``error`` a message naming what is wrong.

``request_id`` is also the request's ``X-Request-Id``: the answer's id and the engine's log lines carry it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import logging.config
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from raypaged.entrypoints.server_args import add_gateway_args
from raypaged.entrypoints.vllm_compat import check_default_only, flag
from raypaged.entrypoints.vllm_options import SERVER_ANY_VALUE, SERVER_DEFAULT_ONLY, Option

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI

    from raypaged.config import EngineConfig
    from raypaged.serving.engine_server import EngineServer
    from raypaged.serving.launch import GatewayOptions

logger = logging.getLogger("raypaged")

BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score", "/v1/rerank")
# the gateway flags (add_gateway_args) a batch honours; --host and --port place the metrics server, and the
# vLLM ones (vllm_options' SERVER tables) are checked as serve checks them; any other is refused when given
_TAKEN_GATEWAY_FLAGS = frozenset(
    {
        "response_role",
        "enable_prompt_tokens_details",
        "enable_force_include_usage",  # vLLM's run-batch flag: every answer has usage, and no stream is sent
        "enable_server_load_tracking",  # vLLM's, taken by serve at any value: changes nothing
        "reasoning_parser",
        "enable_auto_tool_choice",
        "tool_call_parser",
        "exclude_tools_when_tool_choice_none",
        "return_tokens_as_token_ids",
        "fingerprint_mode",
        "fingerprint_value",
        "enable_log_requests",
        "enable_log_outputs",
        "enable_log_deltas",
        "max_log_len",
        "log_error_stack",
        "log_config_file",
        "max_request_body_bytes",
        "max_prompts_per_request",
        *(name for name, *_ in SERVER_DEFAULT_ONLY),
        *SERVER_ANY_VALUE,
    }
)
_METRICS_FLAGS = ("host", "port")
# engine flags a batch refuses when set: a refused request would be an error line, never answered
_ANSWERS_ALL = "a batch answers every request (the queue limits refuse a server's; --max-num-seqs caps each step)"
_NOT_FOR_BATCHES: list[Option] = [
    ("max_num_queued_reqs", (), int, (None,), _ANSWERS_ALL),
    ("max_num_queued_tokens", (), int, (None,), _ANSWERS_ALL),
]
_LOCAL = "in-process"  # the engine server's address in the gateway's routes: its in-process stub
_IN_FLIGHT_PER_SEQ = 2  # requests in flight per batch slot: the engines' batches stay full between answers
_UPLOAD_ATTEMPTS = 5
_UPLOAD_RETRY_S = 5.0
_HTTP_TIMEOUT_S = 1000.0  # reading the input and uploading the results (large files)
_PROGRESS = "{desc}: {n_fmt}/{total_fmt} requests [{elapsed}<{remaining}, {rate_fmt}]\n"  # plain lines, no redraw


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``run-batch`` flags that are no engine or gateway flag."""
    parser.add_argument(
        "-i",
        "--input-file",
        required=True,
        metavar="PATH_OR_URL",
        help="the OpenAI Batch requests, one JSON object a line: a local file or an http(s) URL read with GET",
    )
    parser.add_argument(
        "-o",
        "--output-file",
        required=True,
        metavar="PATH_OR_URL",
        help="where the results go, one line per request in input order: a local file, or an http(s) URL "
        "they are uploaded to with PUT",
    )
    parser.add_argument(
        "--output-tmp-dir",
        default=None,
        metavar="DIR",
        help="with an http(s) --output-file: the folder the results are written to before the upload "
        "(default: the system's temporary folder)",
    )
    parser.add_argument(
        "--enable-metrics",
        action="store_true",
        help="serve Prometheus metrics at http://HOST:PORT/metrics while the batch runs (--host, default "
        "127.0.0.1, and --port, default 8000)",
    )
    parser.add_argument(
        "--url", default=None, metavar="HOST", help="vLLM's older spelling of --host for --enable-metrics"
    )


@dataclass(frozen=True, slots=True)
class BatchJob:
    """Where a batch's requests come from and where its results go; ``metrics_address``: where its
    Prometheus metrics are served (``None``: nowhere)."""

    input_file: str
    output_file: str
    output_tmp_dir: str | None = None
    metrics_address: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.output_tmp_dir is not None and not is_url(self.output_file):
            raise ValueError("--output-tmp-dir needs an http(s) --output-file: a local one is written in place")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BatchJob:
        """The job of ``run-batch``'s flags, after refusing by name the gateway and engine flags a batch cannot
        honour."""
        check_default_only(
            {name: getattr(args, name) for name, *_ in _NOT_FOR_BATCHES}, as_flags=True, options=_NOT_FOR_BATCHES
        )
        defaults = _gateway_defaults()
        for name, default in defaults.items():
            if name not in _TAKEN_GATEWAY_FLAGS and name not in _METRICS_FLAGS and getattr(args, name) != default:
                raise ValueError(
                    f"{flag(name)} is not taken by raypaged run-batch: it sets the HTTP server, and a batch is "
                    "answered in this process without one"
                )
        if args.url is not None and args.host != defaults["host"]:
            raise ValueError("--url is vLLM's older spelling of --host: give one of them")
        host = args.url if args.url is not None else args.host
        if not args.enable_metrics:
            given = [f for f in ("url", *_METRICS_FLAGS) if getattr(args, f) != defaults.get(f)]
            if given:
                raise ValueError(
                    f"{flag(given[0])} needs --enable-metrics: it places the Prometheus metrics server, the only "
                    "thing run-batch serves"
                )
        address = (host, args.port) if args.enable_metrics else None
        return cls(args.input_file, args.output_file, args.output_tmp_dir, address)


def _gateway_defaults() -> dict[str, Any]:
    """Each gateway flag's destination and default."""
    parser = argparse.ArgumentParser(add_help=False)
    add_gateway_args(parser)
    return vars(parser.parse_args([]))


def is_url(path_or_url: str) -> bool:
    return path_or_url.startswith(("http://", "https://"))


def read_lines(path_or_url: str) -> list[tuple[int, str]]:
    """The input's non-blank lines with their 1-based numbers (a local file, or an http(s) URL read with GET)."""
    if is_url(path_or_url):
        import httpx

        try:
            answer = httpx.get(path_or_url, timeout=_HTTP_TIMEOUT_S, follow_redirects=True)
            answer.raise_for_status()
        except httpx.HTTPError as exc:
            raise OSError(f"--input-file {path_or_url}: {exc}") from None
        text = answer.content.decode("utf-8")
    else:
        try:
            text = Path(path_or_url).read_text(encoding="utf-8")
        except OSError as exc:
            raise OSError(f"--input-file {path_or_url}: {exc.strerror}") from None
    # "\n" only: a JSON string may hold U+2028 and the other breaks str.splitlines() would split at
    return [(number, line) for number, line in enumerate(text.split("\n"), 1) if line.strip()]


def put_file(path: Path, url: str) -> None:
    """Upload ``path`` to ``url`` with PUT, retrying transport errors, 429 and 5xx; a failure keeps the file and
    says where it is."""
    import httpx

    problem = ""
    for attempt in range(1, _UPLOAD_ATTEMPTS + 1):
        try:
            with path.open("rb") as data:
                answer = httpx.put(url, content=data, timeout=_HTTP_TIMEOUT_S)
            if answer.is_success:
                return
            problem = f"HTTP {answer.status_code} {answer.text[:200]!r}"
            if answer.status_code < 500 and answer.status_code != 429:
                break
        except httpx.HTTPError as exc:
            problem = str(exc)
        if attempt < _UPLOAD_ATTEMPTS:
            logger.warning("run-batch: PUT %s failed (%s); trying again in %g s", url, problem, _UPLOAD_RETRY_S)
            time.sleep(_UPLOAD_RETRY_S)
    raise OSError(f"--output-file {url}: the upload failed ({problem}); the results are in {path}")


class _LineError(Exception):
    """A line that is not sent: answered with status 400 and this message."""

    def __init__(self, custom_id: object, message: str) -> None:
        super().__init__(message)
        self.custom_id = custom_id


@dataclass(frozen=True, slots=True)
class BatchRequest:
    custom_id: str
    url: str
    body: dict[str, Any]


def parse_line(number: int, line: str) -> BatchRequest:
    """Input line ``number`` as a request to send; ``_LineError`` says why it cannot be sent."""
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise _LineError(None, f"line {number} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise _LineError(None, f"line {number} is not a JSON object with custom_id, method, url and body")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str):
        problem = "has no custom_id" if custom_id is None else "has a custom_id that is not a string"
        raise _LineError(custom_id, f"line {number} {problem}")
    method, url, body = data.get("method"), data.get("url"), data.get("body")
    if method != "POST":
        raise _LineError(custom_id, f"method {method!r} is not supported: batch requests are POST")
    if url not in BATCH_URLS:
        raise _LineError(
            custom_id, f"url {url!r} is not supported by raypaged run-batch: use {' or '.join(BATCH_URLS)}"
        )
    if not isinstance(body, dict):
        raise _LineError(custom_id, f"line {number} has no body object (the request to send to {url})")
    if body.get("stream") not in (None, False):
        shown = json.dumps(body["stream"])
        raise _LineError(custom_id, f'"stream": {shown} is not supported in a batch: each request gets one JSON answer')
    return BatchRequest(custom_id, url, body)


def result_line(
    custom_id: object, request_id: str, status_code: int, body: object = None, error: object = None
) -> dict[str, Any]:
    return {
        "id": f"vllm-{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body},
        "error": error,
    }


async def answer(client: httpx.AsyncClient, number: int, line: str) -> dict[str, Any]:
    """Input line ``number``'s output line: its request sent to the gateway's app, or why it was not sent."""
    request_id = f"vllm-batch-{uuid.uuid4().hex}"
    try:
        request = parse_line(number, line)
    except _LineError as exc:
        return result_line(exc.custom_id, request_id, 400, error=str(exc))
    response = await client.post(
        request.url,
        content=json.dumps(request.body),  # as the line wrote it: NaN is the gateway's to refuse
        headers={"Content-Type": "application/json", "X-Request-Id": request_id},
    )
    try:
        answered: object = response.json()
    except ValueError:
        answered = response.text
    if response.is_success:
        return result_line(request.custom_id, request_id, response.status_code, body=answered)
    return result_line(request.custom_id, request_id, response.status_code, error=answered)


async def answer_all(
    client: httpx.AsyncClient, lines: Sequence[tuple[int, str]], out: TextIO, max_in_flight: int
) -> int:
    """Answer ``lines`` with up to ``max_in_flight`` at once, writing each output line to ``out`` in input order
    as soon as those before it are written; returns the number of error lines."""
    from tqdm import tqdm

    slots = asyncio.Semaphore(max_in_flight)
    num_errors = 0
    with tqdm(total=len(lines), desc="Running batch", unit="req", mininterval=5, bar_format=_PROGRESS) as progress:

        async def one(number: int, line: str) -> dict[str, Any]:
            try:
                return await answer(client, number, line)
            finally:
                slots.release()
                progress.update()

        def write(result: dict[str, Any]) -> None:
            nonlocal num_errors
            num_errors += result["error"] is not None
            out.write(json.dumps(result, ensure_ascii=False, separators=(",", ":")) + "\n")

        pending: deque[asyncio.Task[dict[str, Any]]] = deque()
        for number, line in lines:
            await slots.acquire()
            pending.append(asyncio.create_task(one(number, line)))
            while pending and pending[0].done():
                write(pending.popleft().result())
        for task in pending:
            write(await task)
    return num_errors


def batch_app(server: EngineServer, options: GatewayOptions) -> FastAPI:
    """``raypaged serve``'s HTTP app in front of ``server``'s engines, with the gateway flags a batch takes;
    no API key (the lines are the operator's own requests)."""
    from raypaged.serving.gateway.drain import Drain
    from raypaged.serving.gateway.engines import EngineRoutes
    from raypaged.serving.gateway.tenants import Tenants
    from raypaged.serving.inprocess import InProcessStub
    from raypaged.serving.launch import gateway_app

    routes = EngineRoutes({name: _LOCAL for name in server.served_names}, {_LOCAL: InProcessStub(server.servicer)})
    return gateway_app(routes, Tenants([]), Drain(options.drain_timeout_s), options)


async def answer_file(
    job: BatchJob,
    lines: Sequence[tuple[int, str]],
    out: TextIO,
    configs: list[EngineConfig],
    options: GatewayOptions,
    lora_modules: dict[str, tuple[str, str]],
) -> int:
    """Start the engines, answer ``lines`` into ``out``, stop them; returns the number of error lines."""
    import httpx
    from prometheus_client import start_http_server

    from raypaged.serving.engine_server import EngineServer

    server = EngineServer(configs, lora_modules=lora_modules)
    metrics = None
    try:
        if job.metrics_address is not None:
            host, port = job.metrics_address
            try:
                metrics, _ = start_http_server(port, host, registry=server.metrics.registry)
            except OSError as exc:
                raise OSError(f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
            logger.info("run-batch: Prometheus metrics on http://%s:%d/metrics", host, port)
        transport = httpx.ASGITransport(batch_app(server, options), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=None) as client:
            max_in_flight = _IN_FLIGHT_PER_SEQ * sum(c.max_num_seqs for c in configs)
            return await answer_all(client, lines, out, max_in_flight)
    finally:
        if metrics is not None:
            metrics.shutdown()
        await server.stop()


def run_batch(
    job: BatchJob, configs: list[EngineConfig], options: GatewayOptions, lora_modules: dict[str, tuple[str, str]]
) -> None:
    """Answer ``job``'s input file into its output file (uploaded with PUT where it is an http(s) URL).

    The input is read, and the output opened, before any model loads: a bad path fails at once."""
    if options.log_config is not None:
        logging.config.dictConfig(options.log_config)
    lines = read_lines(job.input_file)
    path, out = _open_output(job)
    upload = is_url(job.output_file)
    logger.info("run-batch: %d requests from %s", len(lines), job.input_file)
    try:
        with out:
            num_errors = asyncio.run(answer_file(job, lines, out, configs, options, lora_modules))
    except BaseException:
        if upload:
            path.unlink(missing_ok=True)
        raise
    if upload:
        put_file(path, job.output_file)
        path.unlink()
    logger.info("run-batch: %d results (%d errors) written to %s", len(lines), num_errors, job.output_file)


def _open_output(job: BatchJob) -> tuple[Path, TextIO]:
    """The local output file, or for an http(s) one the temporary file the results wait in for the upload."""
    upload = is_url(job.output_file)
    try:
        if upload:
            fd, name = tempfile.mkstemp(suffix=".jsonl", prefix="raypaged_batch_", dir=job.output_tmp_dir)
            return Path(name), open(fd, "w", encoding="utf-8")
        return Path(job.output_file), open(job.output_file, "w", encoding="utf-8")
    except OSError as exc:
        folder = job.output_tmp_dir or tempfile.gettempdir()
        where = f"--output-tmp-dir {folder}" if upload else f"--output-file {job.output_file}"
        raise OSError(f"{where}: {exc.strerror}") from None
