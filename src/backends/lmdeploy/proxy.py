"""LMDeploy's proxy (``lmdeploy serve proxy``) as a node: its view of its own nodes, and its error answers.

The proxy has no ``/health`` and no ``/metrics``; ``GET /nodes/status`` (unauthenticated) lists its nodes as
``{url: {role, models, unfinished, latency, speed}}``, and only nodes it still lists get requests. It can serve a
model when a Hybrid node serves it or, under ``--serving-strategy DistServe``, when a Prefill and a Decode node
both do. The node URLs it lists are never fetched by the gateway: anyone who reaches ``/nodes/add`` can write them.

Its errors are not HTTP statuses: a node it cannot reach (refused, reset, ``AIOHTTP_TIMEOUT``) comes back as HTTP
200 with the one line ``{"error_code": 10402, "text": ...}`` instead of a stream, or appended to a stream already
under way; a model no node of the needed role serves is 10400, an unavailable service 10401. A model no node
serves at all is a 404 "does not exist", which from a proxy means that its last node for the model is gone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backends.errors import UnavailableError
from backends.lmdeploy.errors import UpstreamFailure, node_failure

HYBRID, PREFILL, DECODE = 1, 2, 3  # LMDeploy's EngineRole values in /nodes/status
MODEL_NOT_FOUND, SERVICE_UNAVAILABLE, API_TIMEOUT = 10400, 10401, 10402  # proxy/utils.py ErrorCodes


@dataclass(frozen=True, slots=True)
class ProxyView:
    """What a proxy's ``/nodes/status`` says about one model: how many nodes of each role serve it."""

    hybrid: int
    prefill: int
    decode: int
    models: tuple[str, ...]

    @property
    def serving(self) -> bool:
        return self.hybrid > 0 or (self.prefill > 0 and self.decode > 0)

    def describe(self, model: str | None) -> str:
        if self.serving:
            parts = [f"{self.hybrid} Hybrid"] if self.hybrid else []
            if self.prefill and self.decode:
                parts.append(f"{self.prefill} Prefill + {self.decode} Decode")
            return f"proxy with {' and '.join(parts)} node(s) serving {model}"
        if not self.models:
            return "proxy has no nodes (/nodes/status is empty)"
        return (
            f"proxy has no node able to serve {model} ({self.hybrid} Hybrid, {self.prefill} Prefill, "
            f"{self.decode} Decode; models listed: {', '.join(sorted(set(self.models)))})"
        )


def proxy_view(status: Any, model: str | None) -> ProxyView:
    """Reads ``/nodes/status``; nodes of a model other than ``model`` (or of no model, when None) do not count."""
    if not isinstance(status, dict):
        raise ValueError(f"/nodes/status is not an object: {str(status)[:100]}")
    counts = {HYBRID: 0, PREFILL: 0, DECODE: 0}
    models: list[str] = []
    for entry in status.values():
        if not isinstance(entry, dict):
            continue
        served = [m for m in entry.get("models") or () if isinstance(m, str)]
        models.extend(served)
        role = entry.get("role", HYBRID)
        if role in counts and (model in served if model is not None else bool(served)):
            counts[role] += 1
    return ProxyView(counts[HYBRID], counts[PREFILL], counts[DECODE], tuple(models))


def failure_from_proxy_code(code: Any, text: Any, proxy: str) -> UpstreamFailure:
    """The real failure behind a proxy's ``{"error_code": ..., "text": ...}`` answer (sent under HTTP 200)."""
    said = f"proxy error {code}: {text}" if isinstance(text, str) else f"proxy error {code}"
    if code in (MODEL_NOT_FOUND, SERVICE_UNAVAILABLE):
        return UpstreamFailure(
            UnavailableError(f"LMDeploy proxy {proxy} has no node to serve the request ({said})", retry_after=1.0),
            retryable=True,
            node_fault=True,
            kind="unavailable",
        )
    if code == API_TIMEOUT:
        return node_failure(f"LMDeploy proxy {proxy} got no answer from its node ({said})", kind="proxy_error")
    return node_failure(f"LMDeploy proxy {proxy} failed the request ({said})", kind="proxy_error")


def proxy_lost_model(message: str, proxy: str) -> UpstreamFailure:
    """A proxy's 404 "does not exist": it lists no node for the model any more, so the model is unavailable."""
    return UpstreamFailure(
        UnavailableError(f"LMDeploy proxy {proxy} has no node serving the model: {message}", retry_after=1.0),
        retryable=True,
        node_fault=True,
        kind="unavailable",
    )
