"""The gateway's wrappers (admission, tracing) are backends of their own: they do not pass for their backend's
optional capabilities, and ``capability`` finds those on the backend they wrap."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from backends.interface import (
    Backend,
    DrivenBackend,
    Event,
    FingerprintedBackend,
    GenerateRequest,
    TokenizerInfo,
    TokenizingBackend,
    Usage,
)
from gateway.admission import AdmittedBackend
from gateway.capabilities import GatedBackend, capability, system_fingerprint, unwrapped
from gateway.flow_control import FlowController, tier_bounds


class PlainBackend:
    """Generates, and can do nothing else."""

    name = "plain"
    kind = "plain-kind"

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def readiness(self) -> tuple[bool, str]:
        return True, "ready"

    def max_model_len(self) -> int | None:
        return 64

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        yield Usage(1, 0)


class TokenizingFingerprintedBackend(PlainBackend):
    """Also exposes its tokenizer and a fingerprint of its own."""

    name = "tokenizing"
    fingerprint = "fp_tokenizing-1"

    def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo("Toy", None, None, None, 3, 64)

    async def tokenize(self, request: GenerateRequest, *, add_special_tokens: bool | None = None) -> list[int]:
        return [1, 2]

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return "ab"

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return ["a", "b"]


def _admitted(backend: Backend) -> AdmittedBackend:
    return AdmittedBackend(backend, FlowController(backend.name, 1, tier_bounds(None)))


def test_an_admitted_backend_does_not_pass_for_its_backends_tokenizer() -> None:
    wrapped = _admitted(TokenizingFingerprintedBackend())
    assert not isinstance(wrapped, TokenizingBackend) and not isinstance(wrapped, FingerprintedBackend)
    assert capability(wrapped, TokenizingBackend) is wrapped.inner


def test_capability_is_none_when_the_wrapped_backend_lacks_it() -> None:
    wrapped = _admitted(PlainBackend())
    assert capability(wrapped, TokenizingBackend) is None
    assert capability(wrapped, DrivenBackend) is None


def test_the_fingerprint_is_the_backends_own_through_wrappers_else_its_kinds() -> None:
    assert system_fingerprint(_admitted(_admitted(TokenizingFingerprintedBackend()))) == "fp_tokenizing-1"
    assert system_fingerprint(_admitted(PlainBackend())) == "fp_plain-kind"


def test_the_admission_gate_is_the_wrappers_and_the_wrapper_shows_its_backend() -> None:
    backend = PlainBackend()
    wrapped = _admitted(backend)
    assert isinstance(wrapped, GatedBackend) and not isinstance(backend, GatedBackend)
    assert unwrapped(wrapped) is backend
    assert (wrapped.name, wrapped.kind, wrapped.readiness(), wrapped.max_model_len()) == (
        "plain",
        "plain-kind",
        (True, "ready"),
        64,
    )
