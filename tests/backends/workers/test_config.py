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


def test_front_end_processes_share_rank_workers_and_deepinfer_engines() -> None:
    from gateway.config import GatewayConfig

    models = [{"name": "m", "backends": ["r"]}]
    deepinfer = {"name": "r", "kind": "deepinfer", "model": "/models/x", "max_model_len": 4096}
    for backend in (
        {"name": "r", "kind": "reference", "data_parallel_size": 2},
        {"name": "r", "kind": "reference", "worker_processes": True, "lockstep": True},
        {"name": "r", "kind": "reference", "data_parallel_size": 2, "worker_endpoints": ["ipc:///a", "ipc:///b"]},
        deepinfer,  # the front-end supervisor hosts its engine in a rank worker (tests/gateway/test_scale_out.py)
        {**deepinfer, "data_parallel_size": 2, "worker_endpoints": ["tcp://a:5600", "tcp://b:5600"], "rank_keys": "/k"},
    ):
        GatewayConfig(server={"runtime": {"workers": 2}}, backends=[backend], models=models)


@pytest.mark.parametrize("kind", ["reference", "deepinfer"])
def test_ranks_reached_beyond_the_loopback_need_rank_keys(kind: str) -> None:
    backend = {"name": "r", "kind": kind, "data_parallel_size": 2}
    if kind == "deepinfer":
        backend.update(model="/models/x", max_model_len=4096)
    from gateway.config import ConfigError, GatewayConfig

    models = [{"name": "m", "backends": ["r"]}]
    remote = {**backend, "worker_endpoints": ["tcp://127.0.0.1:5600", "tcp://node-1:5600"]}
    with pytest.raises((ValidationError, ConfigError), match=r"\['tcp://node-1:5600'\].*set rank_keys"):
        GatewayConfig(backends=[remote], models=models)
    GatewayConfig(backends=[{**remote, "rank_keys": "/etc/deepinfer-gateway/rank-keys"}], models=models)
    local = ["tcp://127.0.0.1:5600", "tcp://localhost:5601"]
    GatewayConfig(backends=[{**backend, "worker_endpoints": local}], models=models)
    GatewayConfig(backends=[{**backend, "worker_endpoints": ["ipc:///a", "ipc:///b"]}], models=models)
