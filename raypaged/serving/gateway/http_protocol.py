"""The gateway's HTTP/1.1 protocol: uvicorn's httptools parser with bounds on each request's head.

httptools (llhttp, in C) parses and writes faster than h11 (pure Python); what a streamed
token costs the event loop is mostly this layer's send. h11 bounds a request's head (its
request line and headers) with ``h11_max_incomplete_event_size`` and httptools has no such
bound, so this protocol keeps one: the same option, the same default (h11's 16 KiB), the
same answer past it (uvicorn's 400 "Invalid HTTP request received.", then the connection
closes). The number of headers is bounded too (vLLM's ``--h11-max-header-count``, 256 by default).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_MAX_HEAD_BYTES = 16 * 1024  # h11's DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, what uvicorn's h11 protocol bounds
DEFAULT_MAX_HEADER_COUNT = 256  # vLLM's --h11-max-header-count


class HeadTooLargeError(Exception):
    """Raised in a parser callback: httptools raises it on as ``HttpParserCallbackError``, which uvicorn answers."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` that refuses a request whose head (request line and headers, counted as sent)
    holds more than ``config.h11_max_incomplete_event_size`` bytes. A head is also refused while still
    incomplete once that many bytes are read for it, so no more than the bound and one read (uvicorn reads
    64 KiB at a time) is ever buffered for a head."""

    max_header_count = DEFAULT_MAX_HEADER_COUNT  # headers a request may have (``with_header_count``)
    _in_head = True  # the bytes read now belong to a request head not yet complete
    _read_for_head = 0  # bytes read since this head began (a read may carry body bytes too)
    _head_bytes = 0  # the head's bytes as parsed so far

    @property
    def _limit(self) -> int:
        return self.config.h11_max_incomplete_event_size or DEFAULT_MAX_HEAD_BYTES

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            self._read_for_head += len(data)
        super().data_received(data)
        if self._in_head and self._read_for_head > self._limit and not self.transport.is_closing():
            self._refuse()

    def _refuse(self) -> None:
        self.logger.warning("Invalid HTTP request received: its head is over %d bytes", self._limit)
        self.send_400_response("Invalid HTTP request received.")

    def _count(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self._limit:
            raise HeadTooLargeError(f"request head over {self._limit} bytes")

    def on_message_begin(self) -> None:
        self._head_bytes = 16  # the request line's method, version, spaces and end (at most)
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))  # httptools may give the URL in pieces
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)  # "name: value\r\n"
        if len(self.headers) >= self.max_header_count:
            raise HeadTooLargeError(f"request has more than {self.max_header_count} headers")
        super().on_header(name, value)

    @classmethod
    def with_header_count(cls, max_header_count: int) -> type[BoundedHttpToolsProtocol]:
        """This protocol allowing ``max_header_count`` headers a request (vLLM's ``--h11-max-header-count``)."""
        return type(cls.__name__, (cls,), {"max_header_count": max_header_count})

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head, self._read_for_head = True, 0  # what comes next is the next request's head
