"""A V4.1 chat's images, resolved by deepseek-recipe into what the engine takes, within the operator's limits.

``build_resolver`` is the one place the library's ``ImageResolver`` (fetcher plus OpenCV preprocessor) is made from
``ImageSettings``. Its fetcher connects nowhere: an ``http(s)`` URL source is fetched before, by the backend's
``ImageUrlFetcher`` (``image_fetch.py``: off unless the operator allowlists hosts, then filtered at every redirect
and bounded in bytes and time), and reaches the resolver as bytes, under the same limits as any other image.

``ImageResolution`` runs on the preparation threads (decoding and resizing take milliseconds to seconds of CPU,
never for the event loop): it checks each image against the request's limits as early as it can (the count first,
then each image's declared bytes and, from its header, its pixels, all before decoding), decodes one image at a
time under a per-process permit (``max_concurrent_decodes``), and returns the images in placeholder order with the
tokens they add beyond their placeholders. Every refusal names the request part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import deepseek_recipe as recipe

from backends.config import ImageSettings, ImageUrlsConfig
from backends.deepseek.image_fetch import ImageUrlFetcher, ImageUrlSettings, refusing_fetcher
from backends.deepseek.image_headers import HEADER_BYTES, pixel_size
from backends.errors import InvalidRequestError, PayloadTooLargeError


class ResolvedImages(NamedTuple):
    """A request's images as the engine takes them: one per placeholder, in prompt order."""

    image_bytes: list[bytes]
    image_sizes: list[tuple[int, int]]  # (width, height) after preprocessing
    extra_tokens: int  # prompt tokens the images add beyond one placeholder each (image_token_adjustment)

    def multi_modal_data(self) -> dict[str, Any]:
        """DeepInfer's ``add_request(multi_modal_data=...)``."""
        return {"image_bytes": self.image_bytes, "image_sizes": self.image_sizes}


def build_fetcher(settings: ImageSettings) -> recipe.ReqwestImageFetcher:
    """The resolver's own fetcher: it connects nowhere (URL sources arrive as bytes, see the module docstring)."""
    return refusing_fetcher(settings.max_image_bytes)


def build_url_fetcher(settings: ImageSettings, urls: ImageUrlsConfig | None) -> ImageUrlFetcher:
    """The fetcher of a backend's ``http(s)`` image URLs (none allowed without ``urls``), no image over the
    per-image byte limit."""
    allowed = ImageUrlSettings.of(urls) if urls is not None else ImageUrlSettings()
    return ImageUrlFetcher(
        ImageUrlSettings(
            allowed.allowed_hosts, min(allowed.max_bytes, settings.max_image_bytes), allowed.timeout, allowed.threads
        )
    )


def build_resolver(settings: ImageSettings) -> recipe.ImageResolver:
    """deepseek-recipe's resolver for a backend's image settings."""
    return recipe.ImageResolver(build_fetcher(settings), recipe.OpenCvImagePreprocessor())


class ImageResolution:
    """Resolves one backend's requests' images; thread-safe (the preparation pool calls it)."""

    def __init__(
        self,
        settings: ImageSettings,
        urls: ImageUrlsConfig | None = None,
        *,
        resolver: recipe.ImageResolver | None = None,
        before_decode: Callable[[recipe.ImageSource], None] | None = None,
    ) -> None:
        """``urls``: the hosts image URLs may come from (none without it); ``before_decode`` (tests) runs on the
        pool thread holding a decode permit, before each image decodes."""
        self.settings = settings
        self.urls = build_url_fetcher(settings, urls)
        self._resolver = resolver if resolver is not None else build_resolver(settings)
        self._permits = threading.BoundedSemaphore(settings.max_concurrent_decodes)
        self._before_decode = before_decode
        self._lock = threading.Lock()
        self.decoding = 0  # images being decoded now, for /metrics and tests

    def resolve(self, sources: Sequence[recipe.ImageSource]) -> ResolvedImages:
        """The images of ``sources`` (one request's, in placeholder order), or the first limit one breaks."""
        self._check_count(sources)
        sources = self.urls.fetched_sources(sources)  # URLs as bytes, or the 400 naming the part
        declared = 0
        for source in sources:
            declared += self._check_before_decoding(source)
            if declared > self.settings.max_total_bytes:
                raise _too_many_bytes(source, self.settings.max_total_bytes)
        quota = recipe.ImageQuota()
        infos = [self._decode(source, quota) for source in sources]
        data = recipe.MultiModalData(infos)
        return ResolvedImages(
            [info.data for info in infos], [(info.width, info.height) for info in infos], data.image_token_adjustment()
        )

    def _check_count(self, sources: Sequence[recipe.ImageSource]) -> None:
        limit = self.settings.max_images
        if len(sources) > limit:
            raise InvalidRequestError(
                f"{sources[limit].path}: this request has {len(sources)} images; at most {limit} are allowed in one "
                "request",
                param=sources[limit].path,
                code="too_many_images",
            )

    def _check_before_decoding(self, source: recipe.ImageSource) -> int:
        """The image's declared encoded bytes, once its kind, bytes and pixels are within the limits."""
        size, head = _declared(source)
        if size > self.settings.max_image_bytes:
            raise PayloadTooLargeError(
                f"{source.path}: the image is about {size} bytes; at most {self.settings.max_image_bytes} are "
                "allowed per image",
                param=source.path,
                code="image_too_large",
            )
        dimensions = pixel_size(head) if head else None
        if dimensions is not None and dimensions[0] * dimensions[1] > self.settings.max_pixels:
            width, height = dimensions
            raise InvalidRequestError(
                f"{source.path}: the image is {width}x{height} pixels; at most {self.settings.max_pixels} pixels "
                "are allowed",
                param=source.path,
                code="image_too_large",
            )
        return size

    def _decode(self, source: recipe.ImageSource, quota: recipe.ImageQuota) -> recipe.ImageInfo:
        with self._permits:
            with self._lock:
                self.decoding += 1
            try:
                if self._before_decode is not None:
                    self._before_decode(source)
                images = self._resolver.resolve([source], quota).images
            except recipe.ImageError as exc:
                raise _image_error(source, exc) from None
            finally:
                with self._lock:
                    self.decoding -= 1
        if quota.byte_size() > self.settings.max_total_bytes:
            raise _too_many_bytes(source, self.settings.max_total_bytes)
        return images[0]


def _declared(source: recipe.ImageSource) -> tuple[int, bytes]:
    """(encoded bytes the source declares, its first bytes for the header) without decoding the whole body."""
    if source.data is not None:
        return len(source.data), source.data[:HEADER_BYTES]
    url = source.data_url
    if url is None:
        return 0, b""
    meta, _, payload = url.partition(",")
    if meta.endswith(";base64"):
        payload = payload.strip()
        size = len(payload) * 3 // 4 - payload[-2:].count("=")
        chunk = payload[: (HEADER_BYTES // 3) * 4]
        try:
            return size, base64.b64decode(chunk, validate=False)
        except ValueError:
            return size, b""
    size = len(payload) - 2 * payload.count("%")  # each %XX escape is one byte
    return size, urllib.parse.unquote_to_bytes(payload[: HEADER_BYTES * 3])[:HEADER_BYTES]


def _too_many_bytes(source: recipe.ImageSource, limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"{source.path}: the images of this request exceed {limit} bytes together",
        param=source.path,
        code="images_too_large",
    )


def _image_error(source: recipe.ImageSource, exc: recipe.ImageError) -> InvalidRequestError:
    """The library's error as a 400 naming the part: its message with the part's location in place of the
    library's (``messages[0].content[1].image[0]: ...``)."""
    message = str(exc)
    prefix, sep, rest = message.partition(": ")
    if sep and prefix.startswith(source.path):
        message = rest
    message = f"{source.path}: {message}"
    return InvalidRequestError(message, param=source.path, code=_ERROR_CODES.get(exc.kind, "invalid_image"))


_ERROR_CODES = {"ImageDimensionsTooLarge": "image_too_large", "UnsupportedMediaType": "invalid_image_format"}
