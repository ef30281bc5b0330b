"""Fetching the http(s) image URLs clients send: off unless the operator allowlists hosts, bounded when on.

deepseek-recipe's ``ReqwestImageFetcher`` connects anywhere unless given a destination filter, and has a size limit
(``with_max_bytes``) but no time limit: a host that accepts a connection and never answers holds the calling thread
for as long as it keeps the connection open. So every URL fetch of a request goes through ``ImageUrlFetcher``:

- with no allowed hosts (the default) a URL is refused at once, a 400 naming the part: only data URLs and base64
  images are taken;
- otherwise the fetcher is the library's, with ``ImageDestinations`` installed (the library consults it for the URL's
  host and every redirect target, for every resolved address) and the byte limit;
- the fetch runs on a small pool of threads of its own and the caller waits at most ``timeout`` seconds (queueing
  for a thread included); a request's URLs are fetched at once and share that wait, so a request holds its
  preparation thread no longer than one fetch would. A fetch past its time is abandoned, not stopped: the library
  cannot be interrupted, so its thread stays in the fetch until the remote host answers or closes the connection.
  The pool bounds how many threads that can hold (``threads``); while all are held, further fetches wait for one
  and fail at their own time. A hostile allowlisted host can therefore use up URL fetching, never the process's
  threads.

Every failure is a 400 naming the part (the ``param`` the caller gives): the URL is the client's choice and the
model's backend is healthy, so it must neither count against the backend's circuit breaker nor invite an SDK's
automatic retries (which a 5xx would); the ``code`` says which failure it was.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from urllib.parse import urlsplit

from deepseek_recipe import BytesImageSource, ImageError, ImageSource, ReqwestImageFetcher

from backends.config import ImageUrlsConfig
from backends.deepseek.image_destinations import ImageDestinations
from backends.errors import InvalidRequestError

logger = logging.getLogger(__name__)

DestinationFilter = Callable[[str, str], bool]
"""``fn(host, address) -> bool``: whether the fetcher may connect to ``address`` for ``host``."""

URL_SCHEMES = frozenset({"http", "https"})

ERROR_CODES = {
    "DestinationRejected": "image_url_refused",
    "ImageTooLarge": "image_too_large",
    "FetchStatus": "image_url_status",
}
"""deepseek-recipe's ``ImageError.kind`` of a failed fetch as the client's error code (else ``image_url_fetch``)."""


@dataclass(frozen=True, slots=True)
class ImageUrlSettings:
    """What the operator allows: hosts (empty: URLs off), bytes per image, seconds per fetch, fetch threads."""

    allowed_hosts: tuple[str, ...] = ()
    max_bytes: int = 20 * 1024 * 1024
    timeout: float = 10.0
    threads: int = 4

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_hosts)

    @classmethod
    def of(cls, config: ImageUrlsConfig) -> ImageUrlSettings:
        return cls(tuple(config.allowed_hosts), config.max_bytes, config.fetch_timeout, config.fetch_threads)


class ImageUrlFetcher:
    """Fetches one image URL for a request part, or refuses it (see the module docstring)."""

    def __init__(self, settings: ImageUrlSettings) -> None:
        self.settings = settings
        self._allowlist = ImageDestinations(settings.allowed_hosts)
        self._test_destinations: DestinationFilter | None = None
        self._fetcher = self._library_fetcher()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._held: set[Future[bytes]] = set()  # abandoned fetches whose thread has not come back yet

    def _library_fetcher(self) -> ReqwestImageFetcher:
        def destinations(host: str, address: str) -> bool:
            rule = self._test_destinations or self._allowlist
            return rule(host, address)

        return ReqwestImageFetcher.with_max_bytes(self.settings.max_bytes).with_destination_filter(destinations)

    def allow_destinations_for_tests(self, destinations: DestinationFilter) -> None:
        """Test-only hook: replaces the destination rule, so a test can let a fetch reach a listener on 127.0.0.1
        (which the real rule never allows). Production code never calls it."""
        self._test_destinations = destinations

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def check(self, url: str, param: str) -> None:
        """Refuses a URL this server will not fetch, before any work: a scheme other than http(s), URLs off, or a
        host off the allowlist (the destination filter repeats the host check at every redirect)."""
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:  # e.g. an unclosed IPv6 bracket
            host = None
        if host is None or parts.scheme.lower() not in URL_SCHEMES:
            raise refusal(param, "an image URL must be an http(s) URL with a host, or a data URL", "invalid_image_url")
        if not self.enabled:
            raise refusal(
                param,
                "image URLs are not enabled on this server; send the image as a data URL (data:image/png;base64,...) "
                "or as base64",
                "image_url_disabled",
            )
        if self._test_destinations is not None or self._allowlist.allows_host(host):
            return  # a test's rule decides at connect time
        raise refusal(param, f"image URLs from host {host!r} are not allowed on this server", "image_url_refused")

    def fetch(self, url: str, param: str) -> bytes:
        """The image's bytes; blocks its caller (a preparation thread) for at most ``timeout`` seconds."""
        self.check(url, param)
        return self._wait(self._submit(url), url, param, time.monotonic() + self.settings.timeout)

    def _wait(self, future: Future[bytes], url: str, param: str, deadline: float) -> bytes:
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self._abandon(future, url)
            raise self._timed_out(param) from None
        except ImageError as exc:
            raise fetch_error(exc, param) from None

    async def fetch_async(self, url: str, param: str) -> bytes:
        """``fetch`` for a caller on the event loop: the loop never blocks, the same pool and bound apply."""
        self.check(url, param)
        future = self._submit(url)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.settings.timeout)
        except TimeoutError:
            self._abandon(future, url)
            raise self._timed_out(param) from None
        except asyncio.CancelledError:  # the client left: the fetch's thread is held all the same
            self._abandon(future, url)
            raise
        except ImageError as exc:
            raise fetch_error(exc, param) from None

    def fetched_sources(self, sources: Sequence[ImageSource]) -> list[ImageSource]:
        """The sources with each URL fetched into a ``BytesImageSource`` (same detail and path), for an
        ``ImageResolver`` built on ``refusing_fetcher``; data URLs and bytes pass as they are. Blocking: call it
        on a preparation thread. A request's URLs are fetched at once and wait ``timeout`` together, so a request
        holds its caller no longer than one fetch would. A failure names the source's path."""
        urls = [(i, source, source.url) for i, source in enumerate(sources) if source.kind == "url" and source.url]
        for _, source, url in urls:
            self.check(url, source.path)
        deadline = time.monotonic() + self.settings.timeout
        started = [(i, source, url, self._submit(url)) for i, source, url in urls]
        resolved = list(sources)
        try:
            for i, source, url, future in started:
                data = self._wait(future, url, source.path, deadline)
                resolved[i] = BytesImageSource(data, source.detail, path=source.path)
        except BaseException:
            for _, _, url, future in started:
                if not future.done():
                    self._abandon(future, url)
            raise
        return resolved

    def _submit(self, url: str) -> Future[bytes]:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.settings.threads, thread_name_prefix="image-url-fetch")
            return self._pool.submit(self._fetcher.fetch, url)

    def _abandon(self, future: Future[bytes], url: str) -> None:
        if future.cancel():  # still queued for a thread: it never starts
            return
        with self._lock:
            if future in self._held or future.done():
                return
            self._held.add(future)
            held = len(self._held)
        future.add_done_callback(self._returned)
        logger.warning(
            "image URL fetch abandoned (its time is up, or its client left); its thread stays until the host lets "
            "go (%d of %d held): %s",
            held,
            self.settings.threads,
            url,
        )

    def _returned(self, future: Future[bytes]) -> None:
        with self._lock:
            self._held.discard(future)

    @property
    def abandoned(self) -> int:
        """Fetches given up (past their time, or their client gone) whose thread has not come back yet."""
        return len(self._held)

    def _timed_out(self, param: str) -> InvalidRequestError:
        message = f"the image URL did not deliver the image within {self.settings.timeout:g} s"
        return refusal(param, message, "image_url_timeout")

    def close(self) -> None:
        """Stops taking fetches; abandoned threads end on their own (they are not waited for)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def refusing_fetcher(max_bytes: int) -> ReqwestImageFetcher:
    """The fetcher to build an ``ImageResolver`` with: it connects nowhere. URL sources are fetched before resolution,
    by ``ImageUrlFetcher.fetched_sources`` (time-bounded, which the resolver's own fetch is not); one that reached
    the resolver anyway would be refused, never fetched."""
    return ReqwestImageFetcher.with_max_bytes(max_bytes).with_destination_filter(_nowhere)


def _nowhere(host: str, address: str) -> bool:
    return False


def fetch_error(exc: ImageError, param: str) -> InvalidRequestError:
    """A library fetch failure as the client's 400 naming the part."""
    code = ERROR_CODES.get(exc.kind, "image_url_fetch")
    reasons = {
        "image_url_refused": "the image URL, or a redirect it led to, points to an address this server does not fetch",
        "image_too_large": "the image at the URL is larger than this server takes",
        "image_url_status": "the image host answered with an error status",
    }
    return refusal(param, reasons.get(code, "the image could not be downloaded from its URL"), code)


def refusal(param: str, message: str, code: str) -> InvalidRequestError:
    """A 400 naming the part, in its message too (Anthropic's error bodies carry no ``param``)."""
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param, code=code)
