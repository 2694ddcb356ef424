"""Reliability suite: real servers (processes, HTTP, gRPC, Ray) under load, faults and bad input.

Sizes are bounded for CI; ``--soak`` (an option of tests/conftest.py) runs the larger ones.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings

from tests.serving.conftest import tiny_model_dir  # noqa: F401  (a session fixture of this folder too)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _limit_open_files(limit: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))


class ServerProcess:
    """``raypaged <command> ...`` as a child process, its log in ``log_path``; ``open_files``: its soft and hard
    limits on open files."""

    def __init__(self, command: str, args: list[str], log_path: Path, open_files: int | None = None) -> None:
        self.log_path = log_path
        self._log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raypaged.entrypoints.cli", command, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=None if open_files is None else lambda: _limit_open_files(open_files),
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_http_ready(
        self, url: str, headers: dict | None = None, within_s: float = 180, verify: ssl.SSLContext | bool = True
    ) -> None:
        """Until ``url``/health answers 200 (over HTTPS, checked with ``verify``)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited with {self.process.returncode}:\n{self.log()}"
            try:
                if httpx.get(f"{url}/health", headers=headers, timeout=5, verify=verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready within {within_s} s:\n{self.log()}")

    def wait_log(self, text: str, within_s: float = 180) -> None:
        deadline = time.monotonic() + within_s
        while text not in self.log():
            assert self.process.poll() is None, f"server exited with {self.process.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"{text!r} not logged within {within_s} s:\n{self.log()}"
            time.sleep(0.2)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.process.send_signal(sig)

    def wait(self, within_s: float = 60) -> int:
        return self.process.wait(timeout=within_s)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def stream_text_and_tail(events: list[str]) -> tuple[str, list[dict]]:
    """A completions stream's text, and its JSON events (the last ones tell how it ended)."""
    import json

    assert events and events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    return text, chunks


class GoodTraffic:
    """Greedy completions (``body``) sent one after another on a thread while others arrive; each must keep its
    text."""

    def __init__(self, url: str, body: dict) -> None:
        self.texts: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, body))
        self._thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            while not self._stop.is_set():
                response = client.post("/v1/completions", json=body)
                if response.status_code != 200:
                    self.errors.append(response.text)
                else:
                    self.texts.append(response.json()["choices"][0]["text"])

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=120)
        assert self.errors == []
        return self.texts


def assert_openai_error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def assert_anthropic_error(response: httpx.Response) -> dict:
    """The Messages API's routes answer errors in Anthropic's shape."""
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    return body["error"]


def fuzz_beside_good_traffic(
    url: str, good: dict, cases: Any, check: Callable[[Any], None], num_cases: int, soak: bool
) -> list[str]:
    """``check`` on ``num_cases`` examples of the hypothesis strategy ``cases`` (derandomized unless ``soak``) while
    ``GoodTraffic`` sends ``good`` beside them; the good request's texts, once every case ran."""
    ran: list[int] = []
    traffic = GoodTraffic(url, good)

    @settings(
        max_examples=num_cases,
        deadline=None,
        database=None,
        derandomize=not soak,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def fuzz(case: Any) -> None:
        check(case)
        ran.append(1)

    try:
        fuzz()
    finally:
        texts = traffic.stop()
    assert len(ran) >= num_cases
    return texts
