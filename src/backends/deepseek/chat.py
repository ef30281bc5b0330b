"""DeepSeek V4.1 chat template for in-process engines (DeepInfer and the reference engine)."""

from __future__ import annotations

from backends.deepseek.encoding import encode_messages
from backends.errors import InvalidRequestError
from backends.interface import GenerateRequest


class DeepSeekV41ChatTemplate:
    """Chat mode for now; thinking, tools and response formats arrive with the DeepInfer work."""

    def render(self, request: GenerateRequest) -> str:
        assert request.messages is not None
        try:
            return encode_messages(request.messages, thinking=False)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
