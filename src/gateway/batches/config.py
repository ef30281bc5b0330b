"""``server.batches``: where batch files and state live, how much a key may store and run, how long things stay."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class BatchesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="serve /v1/files and /v1/batches and run batches on this process")
    store: str = Field(
        "sqlite",
        pattern=r"^(sqlite|sqlite://.+|state_store)$",
        description="where files and batch state live: sqlite (batches.sqlite3 in $DEEPINFER_GATEWAY_CACHE or "
        "~/.cache/deepinfer-gateway, beside the stored responses) or sqlite://PATH, shared by the processes that "
        "open the same file; or state_store: the Redis/Valkey of server.stores.state_store, shared by every replica, "
        "with "
        "file contents in files_dir",
    )
    files_dir: str | None = Field(
        None,
        description="with store: state_store, the folder file contents go to: a volume every replica mounts "
        "(Redis holds only their metadata)",
    )
    max_file_bytes: int = Field(100 * 1024 * 1024, ge=1024, description="largest file POST /v1/files accepts")
    max_lines: int = Field(50_000, ge=1, description="most requests (lines) a batch input file may hold")
    max_stored_bytes: int = Field(
        10 * 1024 * 1024 * 1024, ge=1024, description="bytes of files (inputs and results) the store keeps at most"
    )
    max_open_batches_per_key: int = Field(
        16, ge=1, description="batches a key may have not yet ended (validating, in progress, finalizing, cancelling)"
    )
    batches_per_process: int = Field(
        4, ge=1, description="batches one process runs at once; more wait for it, or run on another process or replica"
    )
    concurrency_per_batch: int = Field(8, ge=1, description="requests of one batch running at once")
    concurrency_per_key: int = Field(16, ge=1, description="requests of one key's batches running at once, per process")
    lease_seconds: float = Field(
        30.0, gt=0, description="how long a process holds a batch without renewing; past it another takes it over"
    )
    poll_seconds: float = Field(1.0, gt=0, description="how often an idle process looks for batches to run")
    file_retention_seconds: float | None = Field(
        30 * 24 * 3600.0, gt=0, description="seconds a file (input or result) is kept; null: until deleted"
    )
    retry_seconds: float = Field(
        1.0, gt=0, description="wait before a request refused for capacity (429 budget, 503) is tried again, at least"
    )
    retry_max_seconds: float = Field(
        30.0, gt=0, description="the longest such wait, whatever the answer's Retry-After says"
    )
