"""Image URL fetching through deepseek-recipe's real fetcher: off by default; when on, no connection to loopback in
any spelling nor through a redirect (a listener on 127.0.0.1 counts every connection it would have made); size and
time bounded, with the threads a hung host holds bounded too."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator

import pytest
from deepseek_recipe import (
    ImageError,
    ImageQuota,
    ImageResolver,
    OpenCvImagePreprocessor,
    UrlImageSource,
)
from pydantic import ValidationError

from backends.config import ImageUrlsConfig
from backends.deepseek.image_destinations import ImageDestinations
from backends.deepseek.image_fetch import ImageUrlFetcher, ImageUrlSettings, refusing_fetcher
from backends.errors import InvalidRequestError

from ...conftest import wait_until
from ...image_files import png

PART = "messages[0].content[1]"


class HoldingListener:
    """A TCP listener on 127.0.0.1 that counts the connections it accepts and never answers them (a hung host)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def accepted(self) -> int:
        return len(self.held)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def release(self) -> None:
        """Closes every held connection: a hung fetch's thread comes back."""
        for conn in self.held:
            conn.close()

    def close(self) -> None:
        self.release()
        self.sock.close()


class ImageHost(http.server.ThreadingHTTPServer):
    """An HTTP server on 127.0.0.1: ``/big`` is 5000 bytes, ``/redirect`` sends the client to ``redirect_to``."""

    def __init__(self, redirect_to: str = "") -> None:
        self.redirect_to = redirect_to
        super().__init__(("127.0.0.1", 0), _ImageHostHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


class _ImageHostHandler(http.server.BaseHTTPRequestHandler):
    server: ImageHost

    def do_GET(self) -> None:
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", self.server.redirect_to)
            self.end_headers()
            return
        body = png(16, 8) if self.path == "/png" else b"\x89PNG" + b"x" * 4996
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def listener() -> Iterator[HoldingListener]:
    running = HoldingListener()
    yield running
    running.close()


def refused(fetcher: ImageUrlFetcher, url: str) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        fetcher.fetch(url, PART)
    assert caught.value.param == PART
    return caught.value


def test_image_urls_are_off_by_default(listener: HoldingListener) -> None:
    error = refused(ImageUrlFetcher(ImageUrlSettings()), f"http://127.0.0.1:{listener.port}/a.png")
    assert error.code == "image_url_disabled" and "not enabled" in error.message
    assert listener.accepted == 0


LOOPBACK_SPELLINGS = ("localhost", "127.0.0.1", "2130706433", "0177.0.0.1", "0x7f.1", "127.1", "[::ffff:127.0.0.1]")


@pytest.mark.parametrize("host", LOOPBACK_SPELLINGS)
def test_allowlisted_hosts_that_are_loopback_are_never_connected(listener: HoldingListener, host: str) -> None:
    fetcher = ImageUrlFetcher(ImageUrlSettings(allowed_hosts=(host, host.strip("[]"))))
    error = refused(fetcher, f"http://{host}:{listener.port}/a.png")
    assert error.code == "image_url_refused"
    assert listener.accepted == 0


def test_localhost_is_refused_by_the_filter_at_connect_time(listener: HoldingListener) -> None:
    """``localhost`` is a name, so the allowlist lets it through: only the library's call of the filter for its
    resolved address stands between the fetch and the listener."""
    fetcher = ImageUrlFetcher(ImageUrlSettings(allowed_hosts=("localhost",)))
    fetcher.check(f"http://localhost:{listener.port}/a.png", PART)  # no refusal before the fetch
    assert refused(fetcher, f"http://localhost:{listener.port}/a.png").code == "image_url_refused"
    assert listener.accepted == 0


def test_hosts_off_the_allowlist_and_other_schemes_are_refused() -> None:
    fetcher = ImageUrlFetcher(ImageUrlSettings(allowed_hosts=("images.example.com",)))
    assert refused(fetcher, "http://evil.example.com/a.png").code == "image_url_refused"
    assert refused(fetcher, "file:///etc/passwd").code == "invalid_image_url"
    assert refused(fetcher, "ftp://images.example.com/a.png").code == "invalid_image_url"
    assert refused(fetcher, "http://[::1/a.png").code == "invalid_image_url"  # urlsplit's ValueError, not a 500


def redirecting_fetcher(rule: ImageDestinations | None, calls: list[tuple[str, str]]) -> ImageUrlFetcher:
    """A fetcher whose first hop may reach ``host`` on 127.0.0.1 (test-only hook); every other destination, and so
    every redirect target, is judged by ``rule`` (None: allowed)."""
    fetcher = ImageUrlFetcher(ImageUrlSettings(allowed_hosts=("localhost",), timeout=0.5))

    def destinations(name: str, address: str) -> bool:
        calls.append((name, address))
        if name == "127.0.0.1":
            return True
        return True if rule is None else rule(name, address)

    fetcher.allow_destinations_for_tests(destinations)
    return fetcher


def test_a_redirect_to_loopback_is_refused_by_the_filter(listener: HoldingListener) -> None:
    host = ImageHost(redirect_to=f"http://localhost:{listener.port}/a.png")
    calls: list[tuple[str, str]] = []
    fetcher = redirecting_fetcher(ImageDestinations(["localhost"]), calls)
    try:
        assert refused(fetcher, f"http://127.0.0.1:{host.server_port}/redirect").code == "image_url_refused"
    finally:
        host.shutdown()
    assert ("localhost", "127.0.0.1") in calls  # the library asked about the redirect target's address
    assert listener.accepted == 0


def test_the_redirect_case_would_connect_without_the_rule(listener: HoldingListener) -> None:
    """The control for the test above: the same redirect, with every destination allowed, reaches the listener."""
    host = ImageHost(redirect_to=f"http://localhost:{listener.port}/a.png")
    fetcher = redirecting_fetcher(None, [])
    try:
        refused(fetcher, f"http://127.0.0.1:{host.server_port}/redirect")
    finally:
        host.shutdown()
        listener.release()
    assert listener.accepted == 1


def loopback_fetcher(**settings: object) -> ImageUrlFetcher:
    """A fetcher the test lets reach 127.0.0.1 through the test-only hook (the real rule never does)."""
    fetcher = ImageUrlFetcher(ImageUrlSettings(allowed_hosts=("127.0.0.1",), **settings))  # type: ignore[arg-type]
    fetcher.allow_destinations_for_tests(lambda host, address: address == "127.0.0.1")
    return fetcher


def test_an_image_over_the_byte_limit_is_refused() -> None:
    host = ImageHost()
    try:
        error = refused(loopback_fetcher(max_bytes=1000), f"http://127.0.0.1:{host.server_port}/big")
        assert (
            loopback_fetcher(max_bytes=5000).fetch(f"http://127.0.0.1:{host.server_port}/big", PART)[:4] == b"\x89PNG"
        )
    finally:
        host.shutdown()
    assert error.code == "image_too_large"


def test_a_hung_fetch_is_bounded_and_its_threads_too(listener: HoldingListener) -> None:
    fetcher = loopback_fetcher(timeout=0.3, threads=1)
    url = f"http://127.0.0.1:{listener.port}/a.png"
    first = refused(fetcher, url)
    assert first.code == "image_url_timeout" and "did not deliver" in first.message
    assert fetcher.abandoned == 1  # its thread is still inside the library's fetch
    # The one fetch thread is held: the next fetch waits for it, fails at its own time and never starts.
    assert refused(fetcher, url).code == "image_url_timeout"
    assert listener.accepted == 1 and fetcher.abandoned == 1
    listener.release()  # the host lets go: the held thread comes back
    assert wait_until(lambda: fetcher.abandoned == 0)
    fetcher.close()


def test_a_hung_fetch_from_the_event_loop_is_bounded(listener: HoldingListener) -> None:
    fetcher = loopback_fetcher(timeout=0.3)
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(fetcher.fetch_async(f"http://127.0.0.1:{listener.port}/a.png", PART))
    assert caught.value.code == "image_url_timeout" and caught.value.param == PART
    listener.release()
    assert wait_until(lambda: fetcher.abandoned == 0)
    fetcher.close()


def test_url_sources_are_fetched_before_the_resolver_which_fetches_nothing(listener: HoldingListener) -> None:
    host = ImageHost()
    fetcher = loopback_fetcher()
    resolver = ImageResolver(refusing_fetcher(1 << 20), OpenCvImagePreprocessor())
    source = UrlImageSource(f"http://127.0.0.1:{host.server_port}/png", "low", path=PART)
    try:
        (fetched,) = fetcher.fetched_sources([source])
    finally:
        host.shutdown()
    assert (fetched.kind, fetched.detail, fetched.path) == ("bytes", "low", PART)
    (image,) = resolver.resolve([fetched], ImageQuota()).images
    assert image.width > 0 and image.height > 0
    # A URL that reached the resolver itself is refused, not fetched.
    with pytest.raises(ImageError) as caught:
        resolver.resolve([UrlImageSource(f"http://127.0.0.1:{listener.port}/a.png")], ImageQuota())
    assert caught.value.kind == "DestinationRejected" and listener.accepted == 0


def test_the_configuration_turns_urls_on_only_with_hosts() -> None:
    assert not ImageUrlSettings.of(ImageUrlsConfig()).enabled
    on = ImageUrlSettings.of(ImageUrlsConfig(allowed_hosts=["images.example.com", "*.cdn.example.org"]))
    assert on.enabled and on.allowed_hosts == ("images.example.com", "*.cdn.example.org")
    for entry in ("https://images.example.com", "images.example.com:443", "images.example.com/x", "a.*.b", ""):
        with pytest.raises(ValidationError):
            ImageUrlsConfig(allowed_hosts=[entry])


def test_a_requests_urls_are_fetched_at_once_and_wait_together(listener: HoldingListener) -> None:
    """Two hung URLs of one request: both fetches start (a fetch after fetch would never start the second), and
    the request fails at one timeout with both threads accounted for."""
    fetcher = loopback_fetcher(timeout=0.3, threads=2)
    url = f"http://127.0.0.1:{listener.port}/a.png"
    sources = [UrlImageSource(url, path="messages[0].content[0]"), UrlImageSource(url, path=PART)]
    with pytest.raises(InvalidRequestError) as caught:
        fetcher.fetched_sources(sources)
    assert caught.value.code == "image_url_timeout" and caught.value.param == "messages[0].content[0]"
    assert wait_until(lambda: listener.accepted == 2)
    assert fetcher.abandoned == 2
    listener.release()
    assert wait_until(lambda: fetcher.abandoned == 0)
    fetcher.close()
