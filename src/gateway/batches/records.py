"""The Files and Batches APIs' objects as OpenAI shapes them, and the statuses a batch goes through."""

from __future__ import annotations

import os
from typing import Any

VALIDATING = "validating"
IN_PROGRESS = "in_progress"
FINALIZING = "finalizing"
COMPLETED = "completed"
FAILED = "failed"
CANCELLING = "cancelling"
CANCELLED = "cancelled"
EXPIRED = "expired"
OPEN_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
"""A batch in one of these still needs a runner."""
ENDED_STATUSES = (COMPLETED, FAILED, CANCELLED, EXPIRED)
ALL_STATUSES = (*OPEN_STATUSES, *ENDED_STATUSES)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600.0}
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


def new_id(prefix: str) -> str:
    return f"{prefix}{os.urandom(12).hex()}"


def file_object(
    file_id: str, *, size: int, created_at: int, filename: str, purpose: str, expires_at: int | None
) -> dict[str, Any]:
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "expires_at": expires_at,
        "filename": filename,
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(
    batch_id: str,
    *,
    endpoint: str,
    input_file_id: str,
    completion_window: str,
    created_at: int,
    metadata: dict[str, str] | None,
) -> dict[str, Any]:
    return {
        "id": batch_id,
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": VALIDATING,
        "output_file_id": None,
        "error_file_id": None,
        "created_at": created_at,
        "in_progress_at": None,
        "expires_at": created_at + int(COMPLETION_WINDOWS[completion_window]),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


def output_line(custom_id: str, request_id: str, status: int, body: Any) -> dict[str, Any]:
    """A request that the API answered (200 into the output file, anything else into the error file)."""
    return {
        "id": f"batch_req_{request_id}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }


def unrun_line(custom_id: str, code: str, message: str) -> dict[str, Any]:
    """A request the batch never ran (cancelled, expired): in the error file, with no response."""
    return {
        "id": f"batch_req_{os.urandom(12).hex()}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
