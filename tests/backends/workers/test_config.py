"""Configuration of data parallelism on the reference backend, checked before anything starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from backends.config import ReferenceBackendConfig
from backends.engine.backend import EngineBackend
from backends.reference.backend import build_reference_backend
from backends.workers.backend import DataParallelBackend


def test_one_rank_stays_in_process_unless_workers_are_asked_for() -> None:
    assert not ReferenceBackendConfig(name="r").uses_workers
    single = build_reference_backend(ReferenceBackendConfig(name="r"))
    assert type(single) is EngineBackend
    assert isinstance(
        build_reference_backend(ReferenceBackendConfig(name="r", worker_processes=True)), DataParallelBackend
    )
    backend = build_reference_backend(ReferenceBackendConfig(name="r", data_parallel_size=4, lockstep=True))
    assert isinstance(backend, DataParallelBackend)
    assert backend.driver.plan.size == 4 and backend.driver.plan.lockstep


def test_remote_endpoints_must_name_every_rank() -> None:
    with pytest.raises(ValidationError, match="one per rank"):
        ReferenceBackendConfig(name="r", data_parallel_size=2, worker_endpoints=["tcp://a:5600"])
    with pytest.raises(ValidationError):
        ReferenceBackendConfig(name="r", worker_endpoints=["http://a:5600"])
    with pytest.raises(ValidationError, match="need worker processes"):
        ReferenceBackendConfig(name="r", data_parallel_size=2, worker_processes=False)


def test_front_end_processes_share_rank_workers_but_not_an_in_process_deepinfer_engine() -> None:
    from gateway.config import GatewayConfig

    models = [{"name": "m", "backends": ["r"]}]
    for backend in (
        {"name": "r", "kind": "reference", "data_parallel_size": 2},
        {"name": "r", "kind": "reference", "worker_processes": True, "lockstep": True},
        {"name": "r", "kind": "reference", "data_parallel_size": 2, "worker_endpoints": ["ipc:///a", "ipc:///b"]},
    ):
        GatewayConfig(server={"workers": 2}, backends=[backend], models=models)
    deepinfer = {"name": "r", "kind": "deepinfer", "model": "/models/x", "max_model_len": 4096}
    with pytest.raises(ValidationError, match=r"server.workers > 1 is not supported with a deepinfer backend"):
        GatewayConfig(server={"workers": 2}, backends=[deepinfer], models=models)
    GatewayConfig(server={"workers": 1}, backends=[deepinfer], models=models)
