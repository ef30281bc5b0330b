"""Maps a public model name to the backend that serves a request."""

from __future__ import annotations

from collections.abc import Mapping

from backends.errors import ModelNotFoundError, UnavailableError
from backends.interface import Backend
from gateway.config import ModelConfig


class ModelRouter:
    """First ready backend in the model's configured order (richer policies plug in here)."""

    def __init__(self, models: list[ModelConfig], backends: Mapping[str, Backend]) -> None:
        self._targets = {m.name: [backends[name] for name in m.backends] for m in models}
        self.model_names = list(self._targets)

    def backends_of(self, model: str) -> list[Backend]:
        return self._targets.get(model, [])

    def route(self, model: str) -> Backend:
        targets = self._targets.get(model)
        if targets is None:
            raise ModelNotFoundError(f"The model '{model}' does not exist or you do not have access to it.")
        for backend in targets:
            if backend.readiness()[0]:
                return backend
        reasons = "; ".join(f"{b.name}: {b.readiness()[1]}" for b in targets)
        raise UnavailableError(f"no backend of model '{model}' is ready ({reasons})", retry_after=5)
