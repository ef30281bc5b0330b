"""``/v1/files`` and ``/v1/batches``: OpenAI's Files and Batches APIs. Files and batches belong to the key that made
them; another key's id gets the 404 an unknown id gets."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import RedisError
from starlette.datastructures import QueryParams, UploadFile
from starlette.responses import Response

from gateway.auth import request_label, request_owner
from gateway.batches.records import INPUT_PURPOSE, OUTPUT_PURPOSE, batch_object, file_object, new_id
from gateway.batches.runner import BatchRunner
from gateway.batches.store import StoreLimitError
from gateway.errors import APIError
from gateway.gateway_state import gateway_state

logger = logging.getLogger(__name__)
T = TypeVar("T")
router = APIRouter(tags=["batches"])
UPLOAD_PATH = "/v1/files"
MULTIPART_OVERHEAD = 64 * 1024
MAX_ID_LENGTH = 128
OFF_LOOP_BYTES = 1024 * 1024
"""Uploads larger than this are scanned on a thread (a 100 MiB file takes tens of milliseconds)."""


def _line_count(content: bytes) -> int:
    return content.count(b"\n") + (0 if content.endswith(b"\n") or not content else 1)


"""Bytes a multipart upload may carry beyond its file (boundaries, headers, the purpose field)."""


class CreateBatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    completion_window: Literal["24h"]
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)


async def _stored(work: Awaitable[T]) -> T:
    """A store call; a store that fails (its file, its server) is a 503 the client may retry, never a 500."""
    try:
        return await work
    except (sqlite3.Error, OSError, RedisError) as exc:
        logger.exception("the batch store failed")
        raise APIError(
            503,
            f"The batch store is unavailable ({type(exc).__name__}); retry shortly.",
            type="server_error",
            code="batch_store_unavailable",
            headers={"Retry-After": "1"},
        ) from None


def _runner(request: Request) -> BatchRunner:
    runner = gateway_state(request).batches
    if runner is None:
        raise APIError(404, "The Batch API is off on this gateway (server.batches.enabled).", code="not_found")
    return runner


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No file found with id '{file_id}'.", param="file_id", code="not_found")


def _no_batch(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="not_found")


def _page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(data) > limit,
    }


def _limit(query: QueryParams, *, default: int, most: int) -> int:
    raw = query.get("limit")
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= most:
        raise APIError(
            400,
            f"Invalid 'limit': expected an integer from 1 to {most}, but got {raw[:40]!r}.",
            param="limit",
            code="invalid_value",
        )
    return int(raw)


def _after(query: QueryParams) -> str | None:
    after = query.get("after")
    if after is not None and len(after) > MAX_ID_LENGTH:
        raise APIError(400, "Invalid 'after': not an id.", param="after", code="invalid_value")
    return after


def _choice(query: QueryParams, name: str, allowed: tuple[str | None, ...]) -> Any:
    """The query parameter's value, which must be one of ``allowed`` (the first when it is absent)."""
    value = query.get(name, allowed[0])
    if value not in allowed:
        supported = [choice for choice in allowed if choice is not None]
        raise APIError(
            400,
            f"Invalid value for '{name}': {str(value)[:40]!r}. Supported values are: {supported}.",
            param=name,
            code="invalid_value",
        )
    return value


@router.post("/v1/files")
async def create_file(request: Request) -> dict[str, Any]:
    runner = _runner(request)
    config = runner.config
    async with request.form(max_files=1, max_fields=4) as form:
        purpose = form.get("purpose")
        upload = form.get("file")
        if purpose is None:
            raise APIError(
                400, "Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter"
            )
        if purpose != INPUT_PURPOSE:
            raise APIError(
                400, f"purpose must be '{INPUT_PURPOSE}' on this gateway.", param="purpose", code="invalid_value"
            )
        if not isinstance(upload, UploadFile):
            raise APIError(400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter")
        content = await upload.read(config.max_file_bytes + 1)
        filename = (upload.filename or "upload.jsonl")[:255]
    if len(content) > config.max_file_bytes:
        raise APIError(
            413,
            f"The file is larger than the limit of {config.max_file_bytes} bytes.",
            param="file",
            code="file_too_large",
        )
    lines = await asyncio.to_thread(_line_count, content) if len(content) > OFF_LOOP_BYTES else _line_count(content)
    if lines > config.max_lines:
        raise APIError(
            400,
            f"The file has {lines} lines; a batch holds at most {config.max_lines}.",
            param="file",
            code="too_many_lines",
        )
    now = runner.now()
    retention = config.file_retention_seconds
    file = file_object(
        new_id("file-"),
        size=len(content),
        created_at=int(now),
        filename=filename,
        purpose=INPUT_PURPOSE,
        expires_at=int(now + retention) if retention is not None else None,
    )
    try:
        await _stored(runner.store.add_file(file, request_owner(request), content))
    except StoreLimitError as exc:
        raise APIError(400, exc.message, param="file", code=exc.code) from None
    return file


@router.get("/v1/files")
async def list_files(request: Request) -> dict[str, Any]:
    runner = _runner(request)
    query = request.query_params
    purpose = _choice(query, "purpose", (INPUT_PURPOSE, OUTPUT_PURPOSE, None))
    order = _choice(query, "order", ("desc", "asc"))
    limit = _limit(query, default=10_000, most=10_000)
    files = await _stored(
        runner.store.list_files(
            request_owner(request),
            runner.now(),
            purpose=purpose,
            after=_after(query),
            limit=limit + 1,
            descending=order == "desc",
        )
    )
    return _page(files, limit)


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict[str, Any]:
    runner = _runner(request)
    file = await _stored(runner.store.get_file(file_id, request_owner(request), runner.now()))
    if file is None:
        raise _no_file(file_id)
    return file


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    runner = _runner(request)
    content = await _stored(runner.store.file_content(file_id, request_owner(request), runner.now()))
    if content is None:
        raise _no_file(file_id)
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict[str, Any]:
    runner = _runner(request)
    if not await _stored(runner.store.delete_file(file_id, request_owner(request))):
        raise _no_file(file_id)
    return {"id": file_id, "object": "file", "deleted": True}


@router.post("/v1/batches")
async def create_batch(body: CreateBatchRequest, request: Request) -> dict[str, Any]:
    runner = _runner(request)
    owner = request_owner(request)
    file = await _stored(runner.store.get_file(body.input_file_id, owner, runner.now()))
    if file is None:
        raise APIError(404, f"No file found with id '{body.input_file_id}'.", param="input_file_id", code="not_found")
    if file["purpose"] != INPUT_PURPOSE:
        raise APIError(
            400,
            f"The input file's purpose is '{file['purpose']}'; a batch reads files of purpose '{INPUT_PURPOSE}'.",
            param="input_file_id",
            code="invalid_value",
        )
    batch = batch_object(
        new_id("batch_"),
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        created_at=int(runner.now()),
        metadata=body.metadata,
    )
    try:
        await _stored(
            runner.store.add_batch(batch, owner, request_label(request), runner.config.max_open_batches_per_key)
        )
    except StoreLimitError as exc:
        raise APIError(400, exc.message, code=exc.code) from None
    runner.created(batch, request_label(request))
    return batch


@router.get("/v1/batches")
async def list_batches(request: Request) -> dict[str, Any]:
    runner = _runner(request)
    limit = _limit(request.query_params, default=20, most=100)
    batches = await _stored(
        runner.store.list_batches(request_owner(request), after=_after(request.query_params), limit=limit + 1)
    )
    return _page(batches, limit)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request) -> dict[str, Any]:
    runner = _runner(request)
    batch = await _stored(runner.store.get_batch(batch_id, request_owner(request)))
    if batch is None:
        raise _no_batch(batch_id)
    return batch


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request) -> dict[str, Any]:
    runner = _runner(request)
    batch = await _stored(runner.store.cancel(batch_id, request_owner(request), int(runner.now())))
    if batch is None:
        raise _no_batch(batch_id)
    if batch["status"] not in ("cancelling", "cancelled"):
        raise APIError(
            409,
            f"A batch with status '{batch['status']}' cannot be cancelled.",
            param="batch_id",
            code="invalid_status",
        )
    runner.cancel(batch, request_label(request))
    return batch
