"""The images that requests carry: an ``image_url`` turned into a PIL RGB image, as vLLM's OpenAI server does.

Accepted URLs (vLLM's forms):

* ``data:<media type>[;<param>=<value>]*;base64,<data>``: strict base64 (no whitespace, padded). The media
  type is not checked (the bytes say what the image is); data URLs that are not base64 are refused.
* ``http://`` and ``https://``: fetched with httpx, streamed so that ``max_image_bytes`` stops a large body
  early, following at most :data:`MAX_REDIRECTS` redirects; ``allowed_media_domains`` applies to every hop.
  ``fetch_timeout_s`` bounds each network operation and the whole fetch. A host that ``allowed_media_domains``
  does not name must resolve to public (globally routable) addresses only: loopback, private, link-local (cloud
  metadata, 169.254.169.254), shared, reserved and multicast ones are refused, on every hop, and the address
  checked is the one connected to (the request goes to that IP, with the host's name in ``Host`` and TLS's SNI),
  so a DNS answer that changes between the check and the connection reaches nothing else. A host named in
  ``allowed_media_domains`` is the operator's to trust, private or not.
* ``file:///path`` (or ``file://localhost/path``): only with ``allowed_local_media_path``, and only for a
  regular file whose resolved path (``..`` and symbolic links followed) lies inside that folder.

Any other scheme is refused by name. The bytes are opened with PIL (every format it reads except EPS, which it
would hand to Ghostscript), fully decoded (``load()``: truncated or corrupt data fails here) and converted to
RGB; RGBA is composited on white as vLLM does, other modes go through ``convert("RGB")``.

Every refusal is a :class:`MediaError` (a ``ValueError``) whose message starts with the request field
(``param``) and names what is wrong; the servers answer it as HTTP 400 with that ``param``.

PIL's own decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``) stays on: it is raised, never lowered nor
disabled, to ``max_image_pixels`` where that is larger, so it refuses nothing that the limit here allows.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import os
import re
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

import httpx
from PIL import Image, UnidentifiedImageError

MAX_REDIRECTS = 10  # redirects followed for one http(s) image (aiohttp's default, which vLLM's async fetch uses)
_URL_CHARS_SHOWN = 256  # a URL longer than this is cut in error messages
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,31}")
_REFUSED_FORMATS = frozenset({"EPS"})  # PIL decodes EPS by running Ghostscript, an external program
_DATA_URL_FORM = "(data:image/png;base64,...)"


@dataclass(frozen=True)
class MediaOptions:
    """Where images may come from and how large they may be (vLLM's flags of the same meaning)."""

    # file:// URLs only under this folder (vLLM's --allowed-local-media-path); None (or ""): file URLs refused
    allowed_local_media_path: str | None = None
    # http(s) URLs only to these host names, every redirect hop included (vLLM's --allowed-media-domains);
    # None: any host; an empty tuple: no host
    allowed_media_domains: tuple[str, ...] | None = None
    fetch_timeout_s: float = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT default
    # an encoded image larger than this is refused (a data URL's counted decoded)
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 8192 * 8192  # width * height above this is refused (decompression bombs)

    def __post_init__(self) -> None:
        timeout = self.fetch_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"fetch_timeout_s must be a number of seconds above 0, got {timeout!r}")
        for name in ("max_image_bytes", "max_image_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer of at least 1, got {value!r}")
        if self.allowed_media_domains is not None:
            domains = tuple(self.allowed_media_domains)
            if not all(isinstance(domain, str) for domain in domains):
                raise ValueError(f"allowed_media_domains must be host names, got {self.allowed_media_domains!r}")
            object.__setattr__(self, "allowed_media_domains", tuple(domain.lower() for domain in domains))
        if not self.allowed_local_media_path:
            # "" would resolve to the working directory: it means "not set", as in vLLM
            object.__setattr__(self, "allowed_local_media_path", None)
        elif not Path(self.allowed_local_media_path).is_dir():
            raise ValueError(f"--allowed-local-media-path {self.allowed_local_media_path} is not a directory")


class MediaError(ValueError):
    """A request's image that cannot be loaded; ``param`` names the request field (for the error JSON)."""

    def __init__(self, message: str, param: str = "image_url") -> None:
        super().__init__(message)
        self.param = param


def load_image(url: str, options: MediaOptions = MediaOptions(), param: str = "image_url") -> Image.Image:
    """The RGB image at ``url`` (a data, http(s) or file URL); :class:`MediaError` when it cannot be loaded."""
    if _scheme(url, param) in ("http", "https"):
        return image_from_bytes(_fetch(url, options, param), options, param)
    return image_from_bytes(_local_bytes(url, options, param), options, param)


async def load_image_async(url: str, options: MediaOptions = MediaOptions(), param: str = "image_url") -> Image.Image:
    """:func:`load_image` with an async fetch; reading files and decoding run in a worker thread."""
    if _scheme(url, param) in ("http", "https"):
        data = await _fetch_async(url, options, param)
        return await asyncio.to_thread(image_from_bytes, data, options, param)
    return await asyncio.to_thread(load_image, url, options, param)


def image_from_bytes(data: bytes, options: MediaOptions = MediaOptions(), param: str = "image_url") -> Image.Image:
    """The RGB image encoded in ``data``, fully decoded; :class:`MediaError` when it is not a readable image."""
    if len(data) > options.max_image_bytes:
        raise _too_large(options, param)
    limit = options.max_image_pixels
    if Image.MAX_IMAGE_PIXELS is not None and Image.MAX_IMAGE_PIXELS < limit:
        Image.MAX_IMAGE_PIXELS = limit  # PIL warns above this and refuses above twice this
    try:
        with Image.open(io.BytesIO(data), formats=_formats()) as image:
            _check_pixels(image.size, options, param)
            image.load()
            _check_pixels(image.size, options, param)
            if image.mode == "RGBA":
                rgb = Image.new("RGB", image.size, (255, 255, 255))
                rgb.paste(image, mask=image.getchannel("A"))
                return rgb
            return image.convert("RGB")
    except (MediaError, MemoryError):
        raise
    except Image.DecompressionBombError:
        raise MediaError(f"{param}: the image has more than the limit of {limit} pixels", param) from None
    except UnidentifiedImageError:
        # PIL's message names the BytesIO object (an address): not a stable reason
        raise MediaError(f"{param}: cannot read the image: not an image in a known format", param) from None
    except Exception as exc:
        raise MediaError(f"{param}: cannot read the image: {_reason(exc)}", param) from None


def _formats() -> tuple[str, ...]:
    Image.init()  # registers every plugin once; later calls return at once
    return tuple(name for name in Image.ID if name not in _REFUSED_FORMATS)


def _check_pixels(size: tuple[int, int], options: MediaOptions, param: str) -> None:
    width, height = size
    if width * height > options.max_image_pixels:
        raise MediaError(
            f"{param}: the image has {width}x{height} pixels, more than the limit of {options.max_image_pixels} pixels",
            param,
        )


def _too_large(options: MediaOptions, param: str) -> MediaError:
    return MediaError(f"{param}: the image is larger than {options.max_image_bytes} bytes", param)


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _shown(url: str) -> str:
    return url if len(url) <= _URL_CHARS_SHOWN else url[:_URL_CHARS_SHOWN] + "..."


def _scheme(url: str, param: str) -> str:
    """The URL's scheme in lower case; refused unless it is data, http, https or file."""
    head, colon, _ = url[:40].partition(":")
    if not colon or not _SCHEME.fullmatch(head):
        raise MediaError(f"{param}: the URL has no scheme: use an http(s), data or file URL", param)
    scheme = head.lower()
    if scheme not in ("data", "http", "https", "file"):
        message = f"{param}: the URL scheme {scheme!r} is not supported: use an http(s), data or file URL"
        raise MediaError(message, param)
    return scheme


def _local_bytes(url: str, options: MediaOptions, param: str) -> bytes:
    """The bytes of a data or file URL (any other scheme is refused)."""
    scheme = _scheme(url, param)
    if scheme == "data":
        return _data_url_bytes(url, options, param)
    if scheme == "file":
        return _file_url_bytes(url, options, param)
    raise MediaError(f"{param}: the URL scheme {scheme!r} is not read locally", param)  # http(s): _fetch


def _data_url_bytes(url: str, options: MediaOptions, param: str) -> bytes:
    # RFC 2397: data:[<media type>][;<param>=<value>]*[;base64],<data>
    spec, comma, payload = url[5:].partition(",")
    if not comma:
        raise MediaError(f"{param}: the data URL has no ',' before its data {_DATA_URL_FORM}", param)
    _, semicolon, encoding = spec.rpartition(";")
    if not semicolon or encoding.lower() != "base64":
        raise MediaError(f"{param}: the data URL is not base64 {_DATA_URL_FORM}", param)
    # valid base64 decodes to len * 3 / 4 bytes, less up to 2 of padding: refused before decoding
    if len(payload) // 4 * 3 - 2 > options.max_image_bytes:
        raise _too_large(options, param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{param}: the data URL's base64 data is invalid", param) from None
    if len(data) > options.max_image_bytes:
        raise _too_large(options, param)
    return data


def _file_url_bytes(url: str, options: MediaOptions, param: str) -> bytes:
    if options.allowed_local_media_path is None:
        raise MediaError(f"{param}: file URLs are refused: start the server with --allowed-local-media-path", param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{param}: the file URL's host {parts.netloc!r} is not this machine: use file:///path", param)
    path = url2pathname(parts.path)
    if not path.startswith("/"):
        raise MediaError(f"{param}: the file URL's path must be absolute: use file:///path", param)
    if "\x00" in path:
        raise MediaError(f"{param}: the file URL's path holds a NUL character", param)
    root = Path(options.allowed_local_media_path).resolve()
    target = Path(path).resolve()  # ".." and symbolic links followed: the file that open() would read
    if target != root and root not in target.parents:
        raise MediaError(f"{param}: the file {path} is outside --allowed-local-media-path", param)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)  # no link followed after the check; a FIFO does not block the open
    except FileNotFoundError:
        raise MediaError(f"{param}: cannot read the file {path}: no such file", param) from None
    except OSError as exc:
        raise MediaError(f"{param}: cannot read the file {path}: {exc.strerror or _reason(exc)}", param) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{param}: cannot read the file {path}: not a regular file", param)
        if info.st_size > options.max_image_bytes:
            raise _too_large(options, param)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as file:
        try:
            data = file.read(options.max_image_bytes + 1)
        except OSError as exc:
            raise MediaError(f"{param}: cannot read the file {path}: {exc.strerror or _reason(exc)}", param) from None
    if len(data) > options.max_image_bytes:
        raise _too_large(options, param)
    return data


def _public_address(fetch: _Fetch, host: str, infos: list[Any]) -> str:
    """The first of ``host``'s resolved addresses, all of which must be public (``fetch``'s error otherwise)."""
    addresses = [str(info[4][0]).split("%", 1)[0] for info in infos]
    if not addresses:
        raise fetch.fetch_error(f"the host {host!r} has no address")
    for address in addresses:
        if not ipaddress.ip_address(address).is_global:
            raise fetch.error(
                f"the host {host!r} is at a non-public address ({address}): name it in --allowed-media-domains to "
                "fetch images from it"
            )
    return addresses[0]


def _pinned(fetch: _Fetch, client: httpx.Client | httpx.AsyncClient, url: str, address: str | None) -> httpx.Request:
    """The GET of ``url``, sent to ``address`` (the checked IP; None: to the URL's host, a trusted one) with the
    host's name in ``Host`` and, for https, in TLS's SNI and certificate check."""
    if address is None:
        return client.build_request("GET", url, timeout=fetch.timeout())
    target = httpx.URL(url)
    request = client.build_request(
        "GET", target.copy_with(host=address), headers={"Host": target.netloc.decode()}, timeout=fetch.timeout()
    )
    if target.scheme == "https":
        request.extensions["sni_hostname"] = target.host
    return request


class _Fetch:
    """One http(s) image fetch: the checks on each hop, the body's size and the deadline, and the messages."""

    def __init__(self, url: str, options: MediaOptions, param: str) -> None:
        self.url = url
        self.options = options
        self.param = param
        self.deadline = time.monotonic() + options.fetch_timeout_s
        self.current = url  # the URL of the hop in progress (a redirect's Location is read against it)
        self.hops = 0
        self.body = bytearray()
        try:
            host = urlsplit(url).hostname
        except ValueError as exc:  # a malformed IPv6 host, for one
            raise self.error(f"invalid URL {_shown(url)}: {_reason(exc)}") from None
        if not host:
            raise self.error(f"invalid URL {_shown(url)}: it has no host")
        if not self.host_allowed(host):
            raise MediaError(f"{param}: the host {host!r} is not in --allowed-media-domains", param)

    def error(self, message: str) -> MediaError:
        return MediaError(f"{self.param}: {message}", self.param)

    def fetch_error(self, reason: str) -> MediaError:
        return self.error(f"cannot fetch {_shown(self.url)}: {reason}")

    def host_allowed(self, host: str) -> bool:
        domains = self.options.allowed_media_domains
        return domains is None or host.lower() in domains

    def trusted(self, host: str) -> bool:
        """A host the operator named in ``allowed_media_domains``: fetched from wherever it is."""
        domains = self.options.allowed_media_domains
        return domains is not None and host.lower() in domains

    def address(self, url: str) -> str | None:
        """The checked address to send ``url``'s GET to (None: a trusted host, reached by its name)."""
        target = httpx.URL(url)
        if self.trusted(target.host):
            return None
        try:
            infos = socket.getaddrinfo(target.host, target.port or (443 if target.scheme == "https" else 80))
        except OSError as exc:
            raise self.fetch_error(f"cannot resolve {target.host!r}: {_reason(exc)}") from None
        return _public_address(self, target.host, infos)

    async def address_async(self, url: str) -> str | None:
        target = httpx.URL(url)
        if self.trusted(target.host):
            return None
        port = target.port or (443 if target.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(target.host, port)
        except OSError as exc:
            raise self.fetch_error(f"cannot resolve {target.host!r}: {_reason(exc)}") from None
        return _public_address(self, target.host, infos)

    def timeout(self) -> httpx.Timeout:
        """Each network operation gets the time left of the whole fetch."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return httpx.Timeout(left)

    def timed_out(self) -> MediaError:
        return self.fetch_error(f"timed out after {self.options.fetch_timeout_s:g} s")

    def next_url(self, response: httpx.Response) -> str | None:
        """The URL to fetch next when ``response`` redirects, after checking it; None when it is the answer."""
        if not response.has_redirect_location or response.next_request is None:
            if not response.is_success:
                raise self.fetch_error(f"HTTP {response.status_code}")
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > self.options.max_image_bytes:
                raise _too_large(self.options, self.param)
            return None
        self.hops += 1
        if self.hops > MAX_REDIRECTS:
            raise self.fetch_error(f"more than {MAX_REDIRECTS} redirects")
        # against the URL asked for, not the address it was sent to: a relative Location stays on its host
        target = httpx.URL(self.current).join(response.headers["location"])
        if target.scheme not in ("http", "https"):
            raise self.fetch_error("it redirects to a URL that is not http(s)")
        if not self.host_allowed(target.host):
            raise self.fetch_error(f"it redirects to host {target.host!r}, which is not in --allowed-media-domains")
        self.current = str(target)
        return self.current

    def add(self, chunk: bytes) -> None:
        self.body += chunk
        if len(self.body) > self.options.max_image_bytes:
            raise _too_large(self.options, self.param)
        if time.monotonic() > self.deadline:
            raise self.timed_out()

    def failed(self, exc: Exception) -> MediaError:
        if isinstance(exc, httpx.TimeoutException):
            return self.timed_out()
        if isinstance(exc, httpx.ConnectError):
            return self.fetch_error(f"cannot connect: {_reason(exc)}")
        if isinstance(exc, httpx.InvalidURL):
            return self.error(f"invalid URL {_shown(self.url)}: {_reason(exc)}")
        return self.fetch_error(_reason(exc))


def _fetch(url: str, options: MediaOptions, param: str) -> bytes:
    fetch = _Fetch(url, options, param)
    try:
        with httpx.Client(follow_redirects=False) as client:
            next_url: str | None = url
            while next_url is not None:
                request = _pinned(fetch, client, next_url, fetch.address(next_url))
                response = client.send(request, stream=True)
                try:
                    next_url = fetch.next_url(response)
                    if next_url is None:
                        for chunk in response.iter_bytes():
                            fetch.add(chunk)
                finally:
                    response.close()
    except MediaError:
        raise
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise fetch.failed(exc) from None
    return bytes(fetch.body)


async def _fetch_async(url: str, options: MediaOptions, param: str) -> bytes:
    fetch = _Fetch(url, options, param)
    try:
        async with httpx.AsyncClient(follow_redirects=False) as client:
            next_url: str | None = url
            while next_url is not None:
                request = _pinned(fetch, client, next_url, await fetch.address_async(next_url))
                response = await client.send(request, stream=True)
                try:
                    next_url = fetch.next_url(response)
                    if next_url is None:
                        async for chunk in response.aiter_bytes():
                            fetch.add(chunk)
                finally:
                    await response.aclose()
    except MediaError:
        raise
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise fetch.failed(exc) from None
    return bytes(fetch.body)
