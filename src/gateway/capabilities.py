"""A backend's optional capabilities (tokenizer, fingerprint, statistics), seen through the gateway's own wrappers.

The gateway wraps backends (admission, tracing); a wrapper is not its backend, so it does not claim the backend's
capabilities by forwarding attributes. It names what it wraps (``inner``), and ``capability`` looks there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar, cast, runtime_checkable

from backends.interface import Backend, FingerprintedBackend, conforms

if TYPE_CHECKING:
    from typing_extensions import TypeForm  # PEP 747: lets a Protocol class be the argument (type[C] refuses one)

C = TypeVar("C")


@runtime_checkable
class BackendWrapper(Protocol):
    """A gateway-side wrapper around a backend: its requests reach ``inner``, its capabilities are ``inner``'s."""

    @property
    def inner(self) -> Backend: ...


class WrappedBackend:
    """What the gateway's wrappers (admission, tracing) share: name, kind, life cycle and health are the wrapped
    backend's, so routing and health see the backend itself; a subclass says what ``generate`` adds."""

    __slots__ = ("inner",)

    def __init__(self, backend: Backend) -> None:
        self.inner = backend

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def kind(self) -> str:
        return self.inner.kind

    async def start(self) -> None:
        await self.inner.start()

    async def stop(self) -> None:
        await self.inner.stop()

    def readiness(self) -> tuple[bool, str]:
        return self.inner.readiness()

    def max_model_len(self) -> int | None:
        return self.inner.max_model_len()


class AdmissionCounters(Protocol):
    """What ``/metrics`` reads of an admission gate."""

    @property
    def in_flight(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def rejected(self) -> int: ...

    def depths(self) -> Iterator[tuple[str, str, int]]:
        """(service tier, key label, waiting requests) for every pair with waiters."""
        ...


@runtime_checkable
class GatedBackend(Protocol):
    """A backend behind the gateway's admission gate (``gateway.admission``): the gate is the wrapper's own."""

    @property
    def gate(self) -> AdmissionCounters: ...


def unwrapped(backend: Backend) -> Backend:
    """The backend itself, under any number of the gateway's wrappers."""
    while conforms(backend, BackendWrapper):
        backend = cast("BackendWrapper", backend).inner
    return backend


def capability(backend: Backend, protocol: TypeForm[C]) -> C | None:
    """The backend as ``protocol`` (a runtime-checkable capability of ``backends.interface``), or None when the
    backend under the gateway's wrappers lacks it."""
    inner = unwrapped(backend)
    # Every capability is a runtime-checkable Protocol class of methods and properties: one answer per class
    # (``conforms``; the fingerprint is looked up on every request).
    return cast("C", inner) if conforms(inner, protocol) else None


def system_fingerprint(backend: Backend) -> str:
    """The ``system_fingerprint`` of the backend's responses: its own, else one naming its kind."""
    fingerprinted = capability(backend, FingerprintedBackend)
    own = fingerprinted.fingerprint if fingerprinted is not None else None
    return own or f"fp_{backend.kind}"
