"""Validation against OpenAI's official JSON schemas, shipped in ../shared/conformance."""

from __future__ import annotations

import copy
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = Path(os.environ.get("GATEWAY_SHARED_DIR", ROOT.parent / "shared")) / "conformance" / "openai-schemas.json"


class OpenAISchemas:
    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document

    @classmethod
    def load(cls) -> OpenAISchemas:
        return cls(json.loads(SCHEMA_FILE.read_text()))

    def _validator(self, name: str, schemas: dict[str, Any] | None = None) -> Draft202012Validator:
        components = {"schemas": schemas or self.document["components"]["schemas"]}
        return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})

    @cached_property
    def _streamed_completion_schemas(self) -> dict[str, Any]:
        """The spec has no schema for streamed completions; OpenAI sends CreateCompletionResponse chunks
        whose finish_reason is null until the last one."""
        schemas = copy.deepcopy(self.document["components"]["schemas"])
        reason = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["finish_reason"]
        reason["enum"] = [*reason["enum"], None]
        reason["type"] = ["string", "null"]
        return schemas

    def check(self, name: str, instance: Any) -> None:
        """Raises ``jsonschema.ValidationError`` with the path of the first mismatch."""
        self._validator(name).validate(instance)

    def check_completion_chunk(self, instance: Any) -> None:
        self._validator("CreateCompletionResponse", self._streamed_completion_schemas).validate(instance)
