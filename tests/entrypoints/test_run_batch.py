"""``raypaged run-batch``: each line answered as ``raypaged serve`` answers its body, in input order, with vLLM's
output lines; lines that cannot be sent get their own error line; flags a batch cannot honour are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from raypaged.entrypoints.cli import build_parser, main
from raypaged.entrypoints.run_batch import BatchJob, put_file, read_lines
from tests.entrypoints.test_cli import free_port
from tests.serving.conftest import Stack, tiny_config, tiny_model_dir  # noqa: F401  (session fixture)

CHAT_URL, COMPLETION_URL = "/v1/chat/completions", "/v1/completions"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6, "temperature": 0}
COMPLETION = {"model": "tiny", "prompt": "The sky is", "max_tokens": 6, "temperature": 0}
BAD_BODY = {**COMPLETION, "max_tokens": -1}
NO_MODEL = {**CHAT, "model": "nope"}
BROKEN = '{"custom_id": "broken", "method": "POST"'
EMBED = {"model": "tiny", "input": "x"}


def line(custom_id: str, url: str, body: dict, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def json_error(text: str) -> str:
    with pytest.raises(ValueError) as error:
        json.loads(text)
    return str(error.value)


# the input lines in order ("": a blank one), each with the request it sends (url, body) or, for a line not
# sent, its error line's message
LINES: list[tuple[str, tuple[str, dict] | str | None]] = [
    (line("chat", CHAT_URL, CHAT), (CHAT_URL, CHAT)),
    (line("completion", COMPLETION_URL, COMPLETION), (COMPLETION_URL, COMPLETION)),
    ("", None),
    (line("bad-body", COMPLETION_URL, BAD_BODY), (COMPLETION_URL, BAD_BODY)),
    (line("no-model", CHAT_URL, NO_MODEL), (CHAT_URL, NO_MODEL)),
    (BROKEN, f"line 6 is not JSON: {json_error(BROKEN)}"),
    # sent as the server takes it: this generative model refuses embeddings with a 400 naming model
    (line("embed", "/v1/embeddings", EMBED), ("/v1/embeddings", EMBED)),
    (
        line("transcribe", "/v1/audio/transcriptions", {"model": "tiny", "file": "a.wav"}),
        "url '/v1/audio/transcriptions' is not supported by raypaged run-batch: use /v1/chat/completions or "
        "/v1/completions or /v1/embeddings or /v1/score or /v1/rerank",
    ),
    (
        line("streamed", CHAT_URL, {**CHAT, "stream": True}),
        '"stream": true is not supported in a batch: each request gets one JSON answer',
    ),
    (json.dumps({"method": "POST", "url": COMPLETION_URL, "body": COMPLETION}), "line 10 has no custom_id"),
    (line("get", COMPLETION_URL, COMPLETION, method="GET"), "method 'GET' is not supported: batch requests are POST"),
]


def without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


def test_lines_are_answered_as_the_server_answers_them(tmp_path, tiny_model_dir):  # noqa: F811
    source, results_path = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(text for text, _ in LINES) + "\n")
    flags = ["--num-gpu-blocks-override", "64", "--max-model-len", "256", "--response-role", "bot"]
    batch = subprocess.Popen(
        [sys.executable, "-m", "raypaged.entrypoints.cli", "run-batch", "-i", str(source), "-o", str(results_path)]
        + ["--model", str(tiny_model_dir), "--served-model-name", "tiny", *flags]
        + ["--enable-metrics", "--port", str(free_port())],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    kept = [(text, outcome) for text, outcome in LINES if text]
    stack = Stack([tiny_config(tiny_model_dir, "tiny")], response_role="bot")  # while the batch runs
    try:
        with stack.client() as client:  # the server's answers to the lines sent
            expected = [client.post(o[0], json=o[1]) if isinstance(o, tuple) else None for _, o in kept]
    finally:
        stack.close()
    _, stderr = batch.communicate(timeout=300)
    assert batch.returncode == 0, stderr
    assert "Running batch: 10/10 requests" in stderr

    results = [json.loads(text) for text in results_path.read_text().splitlines()]
    custom_ids = [None if text == BROKEN else json.loads(text).get("custom_id") for text, _ in kept]
    assert [r["custom_id"] for r in results] == custom_ids
    for result, (_, outcome), answer in zip(results, kept, expected):
        request_id = result["response"]["request_id"]
        assert result["id"].startswith("vllm-") and request_id.startswith("vllm-batch-")
        if answer is None:
            assert result["response"] == {"status_code": 400, "request_id": request_id, "body": None}
            assert result["error"] == outcome
        elif answer.status_code == 200:
            assert result["response"]["status_code"] == 200 and result["error"] is None
            body = result["response"]["body"]
            assert without_ids(body) == without_ids(answer.json())
            kind = "chatcmpl" if outcome[0] == CHAT_URL else "cmpl"
            assert body["id"] == f"{kind}-{request_id}"  # the request id names the answer
        else:
            assert result["response"] == {"status_code": answer.status_code, "request_id": request_id, "body": None}
            assert result["error"] == answer.json()
    by_id = {r["custom_id"]: r for r in results}
    assert by_id["chat"]["response"]["body"]["choices"][0]["message"]["role"] == "bot"
    assert by_id["bad-body"]["response"]["status_code"] == 400
    assert by_id["no-model"]["error"]["error"]["message"] == "The model `nope` does not exist."
    assert by_id["embed"]["response"]["status_code"] == 400
    assert by_id["embed"]["error"]["error"]["message"].startswith(
        "The model `tiny` does not support the Embeddings API"
    )
    assert len({r["id"] for r in results}) == len({r["response"]["request_id"] for r in results}) == len(results)


class _Files(BaseHTTPRequestHandler):
    """GET /NAME serves a stored file; PUT /NAME stores one (PUT /refused: 403)."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        data = self.rfile.read(int(self.headers["Content-Length"]))
        refused = self.path == "/refused"
        if not refused:
            self.files[self.path] = data
        self.send_response(403 if refused else 200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def file_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def test_input_read_from_a_url_and_results_put_to_one(tmp_path: Path, file_server: str) -> None:
    _Files.files["/in.jsonl"] = 'first\n\n  \r\nsecond "\u2028" line\r\n'.encode()
    assert read_lines(f"{file_server}/in.jsonl") == [(1, "first"), (4, 'second "\u2028" line\r')]
    with pytest.raises(OSError, match=rf"--input-file {file_server}/missing.jsonl: Client error '404 Not Found'"):
        read_lines(f"{file_server}/missing.jsonl")
    results = tmp_path / "results.jsonl"
    results.write_text('{"custom_id": "a"}\n')
    put_file(results, f"{file_server}/out.jsonl")
    assert _Files.files["/out.jsonl"] == b'{"custom_id": "a"}\n'
    with pytest.raises(OSError, match=rf"upload failed \(HTTP 403 ''\); the results are in {results}$"):
        put_file(results, f"{file_server}/refused")  # a 4xx is not retried


def test_vllm_run_batch_command_lines_parse() -> None:
    args = build_parser().parse_args(
        ["run-batch", "-i", "in.jsonl", "-o", "https://bucket.example/out.jsonl", "--output-tmp-dir", "/scratch"]
        + ["--model", "m", "--response-role", "bot", "--max-log-len", "100", "--enable-prompt-tokens-details"]
        + ["--enable-force-include-usage", "--enable-metrics", "--url", "0.0.0.0", "--port", "9100"]
    )
    assert BatchJob.from_args(args) == BatchJob(
        "in.jsonl", "https://bucket.example/out.jsonl", "/scratch", ("0.0.0.0", 9100)
    )
    assert (args.response_role, args.max_log_len, args.enable_prompt_tokens_details) == ("bot", 100, True)
    assert BatchJob.from_args(build_parser().parse_args(["run-batch", "-i", "a", "-o", "b"])).metrics_address is None


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--port", "9100"], "--port needs --enable-metrics: it places the Prometheus metrics server"),
        (["--url", "0.0.0.0"], "--url needs --enable-metrics: it places the Prometheus metrics server"),
        (["--enable-metrics", "--host", "::1", "--url", "0.0.0.0"], "--url is vLLM's older spelling of --host"),
        (["--output-tmp-dir", "/tmp"], "--output-tmp-dir needs an http(s) --output-file"),
        (["--ssl-certfile", "cert.pem"], "--ssl-certfile is not taken by raypaged run-batch: it sets the HTTP server"),
        (["--api-key", "sk-1"], "--api-key is not taken by raypaged run-batch"),
        (["--sse-keep-alive-interval", "5"], "--sse-keep-alive-interval is not taken by raypaged run-batch"),
        (["--enable-log-outputs"], "--enable-log-outputs needs --enable-log-requests"),
        (["--data-parallel-size", "2"], "--data-parallel-size 2 is not supported: this runs one engine"),
    ],
)
def test_flags_a_batch_cannot_honour_are_refused_by_name(flags, message, tmp_path, capsys) -> None:
    assert main(["run-batch", "-i", "in.jsonl", "-o", str(tmp_path / "out.jsonl"), "--model", "m", *flags]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_input_fails_before_any_model_loads(tmp_path, capsys, tiny_model_dir) -> None:  # noqa: F811
    missing = tmp_path / "missing.jsonl"
    output = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(missing), "-o", str(output), "--model", str(tiny_model_dir)]) == 2
    assert capsys.readouterr().err == f"error: --input-file {missing}: No such file or directory\n"
