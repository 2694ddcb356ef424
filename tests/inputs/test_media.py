"""raypaged.inputs.media: images from data, http(s) and file URLs, through the sync and the async loader, with a
real local HTTP server (no mocks) and real PNG/JPEG bytes made with PIL."""

from __future__ import annotations

import asyncio
import base64
import io
import queue
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from PIL import Image

import raypaged.inputs.media as media_module
from raypaged.inputs.media import (
    MAX_REDIRECTS,
    MediaError,
    MediaOptions,
    image_from_bytes,
    load_image,
    load_image_async,
)

Loader = Callable[..., Image.Image]
LOCAL = ("127.0.0.1",)  # the test server's host, named as the operator names a host it trusts
DEFAULTS = MediaOptions(allowed_media_domains=LOCAL)


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def pattern() -> Image.Image:
    """4x3 RGB, every pixel different: (x * 60, y * 80, 7)."""
    image = Image.new("RGB", (4, 3))
    for x in range(4):
        for y in range(3):
            image.putpixel((x, y), (x * 60, y * 80, 7))
    return image


def noise(size: tuple[int, int]) -> Image.Image:
    return Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3))


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds none (PIL reads the size lazily)."""

    def chunk(tag: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + tag + body + struct.pack(">I", zlib.crc32(tag + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = encode(pattern(), "PNG")
RGBA = Image.new("RGBA", (4, 1))
for _x, _pixel in enumerate([(0, 0, 0, 0), (0, 0, 0, 255), (0, 0, 0, 128), (200, 100, 50, 64)]):
    RGBA.putpixel((_x, 0), _pixel)
RGBA_PNG = encode(RGBA, "PNG")
# RGBA composited on white (vLLM's rgba_to_rgb): transparent -> white, opaque -> itself, half -> between
RGBA_ON_WHITE = [(255, 255, 255), (0, 0, 0), (127, 127, 127), (241, 216, 204)]


def pixels(image: Image.Image) -> list[tuple[int, ...]]:
    return [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]  # type: ignore[misc]


@pytest.fixture(params=["sync", "async"])
def load(request: pytest.FixtureRequest) -> Loader:
    if request.param == "sync":

        def sync(url: str, options: MediaOptions = DEFAULTS, param: str = "image_url") -> Image.Image:
            return load_image(url, options, param)

        return sync

    def run(url: str, options: MediaOptions = DEFAULTS, param: str = "image_url") -> Image.Image:
        return asyncio.run(load_image_async(url, options, param))

    return run


def refused(load: Loader, url: str, options: MediaOptions = DEFAULTS, param: str = "image_url") -> str:
    with pytest.raises(MediaError) as info:
        load(url, options, param)
    assert info.value.param == param
    assert isinstance(info.value, ValueError)
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# the local HTTP server

STOP = threading.Event()  # set at teardown: the slow handlers return
ENDLESS_SENT: queue.Queue[int] = queue.Queue()  # bytes /endless wrote before the client hung up


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def body(self, data: bytes, content_type: str = "image/png", status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        path = self.path
        if path == "/img.png":
            self.body(PNG)
        elif path == "/rgba.png":
            self.body(RGBA_PNG)
        elif path == "/text":
            self.body(b"hello, not an image", "text/plain")
        elif path == "/missing":
            self.body(b"no such image", "text/plain", status=404)
        elif path == "/slow":
            STOP.wait(5)
        elif path == "/drip":  # a byte every 50 ms: no single read waits long, the whole fetch does
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    if STOP.wait(0.05):
                        break
                    self.wfile.write(b"x")
                    self.wfile.flush()
            except OSError:
                pass
        elif path == "/big":
            self.body(b"\0" * 100_000)
        elif path == "/endless":  # no Content-Length: HTTP/1.0, the body runs until the connection closes
            self.send_response(200)
            self.end_headers()
            sent = 0
            chunk = b"\0" * 65536
            try:
                while sent < 256 * 1024 * 1024:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            finally:
                ENDLESS_SENT.put(sent)
        elif path == "/redirect":
            self.redirect("/img.png")
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            if left == 0:
                self.body(PNG)
            else:
                self.redirect(f"/chain/{left - 1}")
        elif path == "/to-localhost":
            self.redirect(f"http://localhost:{port}/img.png")
        elif path == "/to-file":
            self.redirect("file:///etc/passwd")
        elif path == "/host":  # what the client sent as its Host
            self.body(self.headers["Host"].encode(), "text/plain")
        else:
            self.body(b"unknown path", "text/plain", status=500)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        STOP.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


# ---------------------------------------------------------------------------------------------------------------
# data URLs


def test_a_png_data_url_gives_its_exact_pixels(load: Loader) -> None:
    image = load(data_url(PNG))
    assert (image.mode, image.size) == ("RGB", (4, 3))
    assert image.tobytes() == pattern().tobytes()
    assert image.getpixel((3, 2)) == (180, 160, 7)


def test_a_jpeg_data_url_gives_what_pil_decodes(load: Loader) -> None:
    jpeg = encode(Image.new("RGB", (16, 16), (200, 30, 40)), "JPEG")
    image = load(data_url(jpeg, "image/jpeg"))
    assert (image.mode, image.size) == ("RGB", (16, 16))
    assert image.tobytes() == Image.open(io.BytesIO(jpeg)).convert("RGB").tobytes()
    assert all(abs(a - b) <= 3 for a, b in zip(image.getpixel((8, 8)), (200, 30, 40)))  # type: ignore[arg-type]


def test_data_url_forms_vllm_accepts(load: Loader) -> None:
    encoded = base64.b64encode(PNG).decode()
    for url in (
        f"DATA:image/png;BASE64,{encoded}",  # scheme and encoding in any case
        f"data:image/png;name=pattern.png;base64,{encoded}",  # media type parameters
        f"data:;base64,{encoded}",  # no media type: the bytes say what the image is
        f"data:image/jpeg;base64,{encoded}",  # a wrong media type: the same
    ):
        assert load(url).tobytes() == pattern().tobytes(), url


def test_a_data_url_that_is_not_base64_is_refused(load: Loader) -> None:
    expected = "image_url: the data URL is not base64 (data:image/png;base64,...)"
    assert refused(load, "data:image/png,rawbytes") == expected
    assert refused(load, "data:image/png;utf8,rawbytes") == expected
    assert refused(load, "data:base64,rawbytes") == expected  # "base64" here is the media type


def test_a_data_url_without_a_comma_is_refused(load: Loader) -> None:
    assert refused(load, "data:image/png;base64") == (
        "image_url: the data URL has no ',' before its data (data:image/png;base64,...)"
    )


def test_invalid_base64_is_refused(load: Loader) -> None:
    expected = "image_url: the data URL's base64 data is invalid"
    assert refused(load, "data:image/png;base64,@@@@") == expected
    assert refused(load, "data:image/png;base64,iVBORw0KGgo") == expected  # unpadded
    assert refused(load, "data:image/png;base64,iVBO Rw0K") == expected  # whitespace


def test_bytes_that_are_no_image_are_refused(load: Loader) -> None:
    expected = "image_url: cannot read the image: not an image in a known format"
    assert refused(load, data_url(b"hello world")) == expected
    assert refused(load, "data:image/png;base64,") == expected


def test_a_truncated_image_fails_when_loaded(load: Loader) -> None:
    png = encode(noise((64, 64)), "PNG")
    assert refused(load, data_url(png[: len(png) // 2])) == "image_url: cannot read the image: image file is truncated"
    jpeg = encode(noise((64, 64)), "JPEG")
    message = refused(load, data_url(jpeg[: len(jpeg) // 2], "image/jpeg"))
    assert message.startswith("image_url: cannot read the image: image file is truncated (")


def test_a_data_url_counts_its_decoded_bytes(load: Loader) -> None:
    url = data_url(PNG)
    assert len(url) > len(PNG)  # the limit below passes only if the decoded size is what counts
    assert load(url, MediaOptions(max_image_bytes=len(PNG))).tobytes() == pattern().tobytes()
    message = refused(load, url, MediaOptions(max_image_bytes=len(PNG) - 1))
    assert message == f"image_url: the image is larger than {len(PNG) - 1} bytes"
    big = "data:image/png;base64," + "A" * 4_000_000  # refused before it is decoded
    assert refused(load, big, MediaOptions(max_image_bytes=1000)) == "image_url: the image is larger than 1000 bytes"


def test_the_field_name_leads_the_message(load: Loader) -> None:
    param = "messages[0].content[1].image_url"
    message = refused(load, data_url(b"nope"), param=param)
    assert message == f"{param}: cannot read the image: not an image in a known format"


# ---------------------------------------------------------------------------------------------------------------
# modes and limits


def test_rgba_is_composited_on_white(load: Loader) -> None:
    image = load(data_url(RGBA_PNG))
    assert image.mode == "RGB"
    assert pixels(image) == RGBA_ON_WHITE


def test_other_modes_convert_to_rgb(load: Loader) -> None:
    assert pixels(load(data_url(encode(Image.new("L", (2, 1), 77), "PNG")))) == [(77, 77, 77)] * 2
    palette = Image.new("P", (1, 1), 1)
    palette.putpalette([0, 0, 0, 10, 20, 30])
    assert pixels(load(data_url(encode(palette, "PNG")))) == [(10, 20, 30)]
    assert pixels(load(data_url(encode(Image.new("RGB", (1, 1), (9, 8, 7)), "BMP"), "image/bmp"))) == [(9, 8, 7)]


def test_the_pixel_count_limit(load: Loader) -> None:
    url = data_url(encode(Image.new("RGB", (11, 10), (1, 2, 3)), "PNG"))
    assert load(url, MediaOptions(max_image_pixels=110)).size == (11, 10)
    message = refused(load, url, MediaOptions(max_image_pixels=109))
    assert message == "image_url: the image has 11x10 pixels, more than the limit of 109 pixels"
    # a header that declares a huge image is refused before any pixel is allocated
    message = refused(load, data_url(png_header(9000, 9000)))
    assert message == "image_url: the image has 9000x9000 pixels, more than the limit of 67108864 pixels"


def test_a_decompression_bomb_stopped_by_pil_gets_the_same_refusal(load: Loader) -> None:
    assert Image.MAX_IMAGE_PIXELS is not None and 20000 * 20000 > 2 * Image.MAX_IMAGE_PIXELS
    message = refused(load, data_url(png_header(20000, 20000)))
    assert message == "image_url: the image has more than the limit of 67108864 pixels"


def test_pils_limit_is_raised_to_the_configured_one_never_lowered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # restored after the test
    image_from_bytes(PNG, MediaOptions(max_image_pixels=100))
    assert Image.MAX_IMAGE_PIXELS == 1000
    image_from_bytes(PNG, MediaOptions(max_image_pixels=5000))
    assert Image.MAX_IMAGE_PIXELS == 5000
    # an image PIL alone would refuse as a bomb (> 2 * 1000 pixels) loads within the configured limit
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    with pytest.raises(Image.DecompressionBombError):
        Image.open(io.BytesIO(encode(Image.new("RGB", (50, 50)), "PNG")))
    assert image_from_bytes(encode(Image.new("RGB", (50, 50)), "PNG"), MediaOptions(max_image_pixels=2500)).size == (
        50,
        50,
    )


def test_image_from_bytes() -> None:
    assert image_from_bytes(PNG).tobytes() == pattern().tobytes()
    with pytest.raises(MediaError, match=r"^image_url: the image is larger than 10 bytes$"):
        image_from_bytes(PNG, MediaOptions(max_image_bytes=10))
    with pytest.raises(MediaError, match=r"^prompt_image: cannot read the image: not an image in a known format$"):
        image_from_bytes(b"", param="prompt_image")


def test_eps_is_not_opened(load: Loader) -> None:
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 1 1\nshowpage\n%%EOF\n"
    assert Image.open(io.BytesIO(eps)).format == "EPS"  # PIL alone would take it (and run Ghostscript on load)
    assert (
        refused(load, data_url(eps, "image/eps")) == "image_url: cannot read the image: not an image in a known format"
    )


# ---------------------------------------------------------------------------------------------------------------
# schemes


def test_other_schemes_are_refused_by_name(load: Loader) -> None:
    assert refused(load, "ftp://example.com/a.png") == (
        "image_url: the URL scheme 'ftp' is not supported: use an http(s), data or file URL"
    )
    assert refused(load, "HTTPX://example.com/a.png") == (
        "image_url: the URL scheme 'httpx' is not supported: use an http(s), data or file URL"
    )
    for url in ("/tmp/a.png", base64.b64encode(PNG).decode(), ""):
        assert refused(load, url) == "image_url: the URL has no scheme: use an http(s), data or file URL"


# ---------------------------------------------------------------------------------------------------------------
# http(s)


def test_an_http_image(load: Loader, server: str) -> None:
    assert load(f"{server}/img.png").tobytes() == pattern().tobytes()
    assert pixels(load(f"{server}/rgba.png")) == RGBA_ON_WHITE


def test_a_non_2xx_status_is_refused_by_number(load: Loader, server: str) -> None:
    assert refused(load, f"{server}/missing") == f"image_url: cannot fetch {server}/missing: HTTP 404"


def test_a_body_that_is_no_image(load: Loader, server: str) -> None:
    assert refused(load, f"{server}/text") == "image_url: cannot read the image: not an image in a known format"


def test_a_slow_server_times_out(load: Loader, server: str) -> None:
    start = time.monotonic()
    message = refused(load, f"{server}/slow", MediaOptions(None, LOCAL, fetch_timeout_s=0.2))
    assert message == f"image_url: cannot fetch {server}/slow: timed out after 0.2 s"
    assert time.monotonic() - start < 2


def test_the_timeout_bounds_the_whole_fetch_not_each_read(load: Loader, server: str) -> None:
    start = time.monotonic()
    message = refused(load, f"{server}/drip", MediaOptions(None, LOCAL, fetch_timeout_s=0.3))
    assert message == f"image_url: cannot fetch {server}/drip: timed out after 0.3 s"
    assert time.monotonic() - start < 2


def test_a_large_body_is_refused_by_its_length(load: Loader, server: str) -> None:
    options = MediaOptions(None, LOCAL, max_image_bytes=1000)
    assert refused(load, f"{server}/big", options) == "image_url: the image is larger than 1000 bytes"
    assert load(f"{server}/img.png", MediaOptions(None, LOCAL, max_image_bytes=len(PNG))).size == (4, 3)


def test_a_large_download_stops_early(load: Loader, server: str) -> None:
    while not ENDLESS_SENT.empty():
        ENDLESS_SENT.get_nowait()
    start = time.monotonic()
    message = refused(load, f"{server}/endless", MediaOptions(None, LOCAL, max_image_bytes=1000))
    assert message == "image_url: the image is larger than 1000 bytes"
    assert time.monotonic() - start < 2
    assert ENDLESS_SENT.get(timeout=5) < 64 * 1024 * 1024  # the server was cut off, far from its 256 MiB


def test_redirects_are_followed_up_to_the_limit(load: Loader, server: str) -> None:
    assert load(f"{server}/redirect").tobytes() == pattern().tobytes()
    assert load(f"{server}/chain/{MAX_REDIRECTS}").tobytes() == pattern().tobytes()
    url = f"{server}/chain/{MAX_REDIRECTS + 1}"
    assert refused(load, url) == f"image_url: cannot fetch {url}: more than {MAX_REDIRECTS} redirects"


def test_a_redirect_to_a_file_url_is_refused(load: Loader, server: str) -> None:
    url = f"{server}/to-file"
    assert refused(load, url) == f"image_url: cannot fetch {url}: it redirects to a URL that is not http(s)"


def test_allowed_media_domains(load: Loader, server: str) -> None:
    assert load(f"{server}/img.png", MediaOptions(allowed_media_domains=("127.0.0.1",))).size == (4, 3)
    message = refused(load, f"{server}/img.png", MediaOptions(allowed_media_domains=("localhost",)))
    assert message == "image_url: the host '127.0.0.1' is not in --allowed-media-domains"
    message = refused(load, f"{server}/img.png", MediaOptions(allowed_media_domains=()))
    assert message == "image_url: the host '127.0.0.1' is not in --allowed-media-domains"
    # every redirect hop is checked
    url = f"{server}/to-localhost"
    message = refused(load, url, MediaOptions(allowed_media_domains=("127.0.0.1",)))
    assert message == f"image_url: cannot fetch {url}: it redirects to host 'localhost', which is not in " + (
        "--allowed-media-domains"
    )


def test_a_refused_connection(load: Loader) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/img.png"
    assert refused(load, url).startswith(f"image_url: cannot fetch {url}: cannot connect: ")


def test_an_http_url_without_a_host(load: Loader) -> None:
    assert refused(load, "http:///img.png") == "image_url: invalid URL http:///img.png: it has no host"


# ---------------------------------------------------------------------------------------------------------------
# file URLs


@pytest.fixture
def media(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    (folder / "sub").mkdir(parents=True)
    (folder / "img.png").write_bytes(PNG)
    (folder / "my image.png").write_bytes(PNG)
    (folder / "alias.png").symlink_to(folder / "img.png")
    (tmp_path / "secret.png").write_bytes(PNG)
    (folder / "link.png").symlink_to(tmp_path / "secret.png")
    return folder


def test_file_urls_are_refused_without_an_allowed_folder(load: Loader, media: Path) -> None:
    expected = "image_url: file URLs are refused: start the server with --allowed-local-media-path"
    assert refused(load, (media / "img.png").as_uri()) == expected
    assert refused(load, (media / "img.png").as_uri(), MediaOptions(allowed_local_media_path="")) == expected


def test_a_file_inside_the_allowed_folder(load: Loader, media: Path) -> None:
    options = MediaOptions(allowed_local_media_path=str(media))
    for url in (
        (media / "img.png").as_uri(),
        (media / "my image.png").as_uri(),  # percent-encoded: my%20image.png
        f"file://localhost{media}/img.png",
        (media / "alias.png").as_uri(),  # a link that stays inside
        f"file://{media}/sub/../img.png",  # ".." that stays inside
    ):
        assert load(url, options).tobytes() == pattern().tobytes(), url


def test_a_file_outside_the_allowed_folder_is_refused(load: Loader, media: Path) -> None:
    options = MediaOptions(allowed_local_media_path=str(media))
    for path in (f"{media}/../secret.png", f"{media}/link.png", f"{media}/../absent.png", "/etc/passwd"):
        assert refused(load, f"file://{path}", options) == (
            f"image_url: the file {path} is outside --allowed-local-media-path"
        )


def test_file_reading_errors(load: Loader, media: Path) -> None:
    options = MediaOptions(allowed_local_media_path=str(media))
    assert refused(load, f"file://{media}/none.png", options) == (
        f"image_url: cannot read the file {media}/none.png: no such file"
    )
    assert refused(load, f"file://{media}/sub", options) == (
        f"image_url: cannot read the file {media}/sub: not a regular file"
    )
    assert refused(load, f"file://example.com{media}/img.png", options) == (
        "image_url: the file URL's host 'example.com' is not this machine: use file:///path"
    )
    small = MediaOptions(allowed_local_media_path=str(media), max_image_bytes=len(PNG) - 1)
    message = refused(load, f"file://{media}/img.png", small)
    assert message == f"image_url: the image is larger than {len(PNG) - 1} bytes"


# ---------------------------------------------------------------------------------------------------------------
# options


def test_media_options_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fetch_timeout_s must be a number of seconds above 0, got 0"):
        MediaOptions(fetch_timeout_s=0)
    with pytest.raises(ValueError, match="max_image_bytes must be an integer of at least 1, got 0"):
        MediaOptions(max_image_bytes=0)
    with pytest.raises(ValueError, match="max_image_pixels must be an integer of at least 1, got -1"):
        MediaOptions(max_image_pixels=-1)
    with pytest.raises(ValueError, match="is not a directory"):
        MediaOptions(allowed_local_media_path=str(tmp_path / "absent"))
    assert MediaOptions(allowed_local_media_path="").allowed_local_media_path is None
    assert MediaOptions(allowed_media_domains=("Example.COM",)).allowed_media_domains == ("example.com",)


def test_hosts_at_non_public_addresses_are_refused_unless_named(load: Loader, server: str) -> None:
    """Loopback, private and link-local (cloud metadata) addresses are refused before any connection, by IP or by a
    name that resolves there; the host named in allowed_media_domains is fetched (the operator's to trust)."""
    port = server.rsplit(":", 1)[1]
    for url, host, address in (
        (f"{server}/img.png", "127.0.0.1", "127.0.0.1"),
        ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", "169.254.169.254"),
        ("http://10.1.2.3/a.png", "10.1.2.3", "10.1.2.3"),
        ("http://[::1]:1/a.png", "::1", "::1"),
    ):
        assert refused(load, url, MediaOptions()) == (
            f"image_url: the host {host!r} is at a non-public address ({address}): name it in --allowed-media-domains "
            "to fetch images from it"
        )
    message = refused(load, f"http://localhost:{port}/img.png", MediaOptions())
    assert message.startswith("image_url: the host 'localhost' is at a non-public address (")
    assert load(f"{server}/img.png", MediaOptions(allowed_media_domains=LOCAL)).size == (4, 3)


def test_a_checked_address_is_the_one_connected_to() -> None:
    """The request goes to the address that was checked, with the URL's host in Host (and in TLS's SNI): a DNS
    answer that changes after the check reaches nothing else."""
    fetch = media_module._Fetch("https://images.example:8443/a.png", MediaOptions(), "image_url")
    with httpx.Client() as client:
        request = media_module._pinned(fetch, client, "https://images.example:8443/a.png", "93.184.216.34")
        assert (str(request.url), request.headers["Host"]) == (
            "https://93.184.216.34:8443/a.png",
            "images.example:8443",
        )
        assert request.extensions["sni_hostname"] == "images.example"
        v6 = media_module._pinned(fetch, client, "http://images.example/a.png", "2606:2800::1")
        assert (str(v6.url), v6.headers["Host"]) == ("http://[2606:2800::1]/a.png", "images.example")


def test_a_pinned_request_reaches_its_address_with_the_hosts_name(server: str) -> None:
    port = int(server.rsplit(":", 1)[1])
    url = f"http://images.example:{port}/host"
    fetch = media_module._Fetch(url, MediaOptions(), "image_url")
    with httpx.Client() as client:
        response = client.send(media_module._pinned(fetch, client, url, "127.0.0.1"))
    assert response.text == f"images.example:{port}"
