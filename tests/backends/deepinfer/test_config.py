"""DeepInfer backend configuration: validation, the engine environment, and model directory resolution."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from backends.config import DeepInferBackendConfig
from backends.deepinfer import model_path
from backends.deepinfer.environment import EngineEnvironmentError, engine_environment
from backends.deepinfer.model_path import ModelNotFoundError, resolve_model_dir


def config(**overrides: Any) -> DeepInferBackendConfig:
    fields: dict[str, Any] = {"name": "d", "model": "/models/m", "max_model_len": 8192}
    fields.update(overrides)
    return DeepInferBackendConfig(**fields)


# ---- validation ----------------------------------------------------------------------------------------------


def test_max_model_len_is_required() -> None:
    with pytest.raises(ValidationError, match="max_model_len"):
        DeepInferBackendConfig(name="d", model="/models/m")  # type: ignore[call-arg]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"expert_parallel_size": 8}, "must divide context_parallel_size"),
        ({"data_parallel_size": 2, "expert_parallel_size": 4}, "must divide context_parallel_size"),
        ({"data_parallel_size": 2, "visible_devices": "0"}, "context_parallel_size x data_parallel_size"),
        ({"data_parallel_size": 2, "visible_devices": "0,0"}, "ranks must not share a device"),
        ({"data_parallel_size": 2, "env": {"MASTER_PORT": "29500"}}, "with master_port, not env"),
        ({"context_parallel_size": 4, "visible_devices": "0,1"}, "at least context_parallel_size"),
        ({"visible_devices": "0;1"}, "pattern"),
        ({"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "visible_devices, not env"),
        ({"env": {"deepinfer_x": "1"}}, "not an environment variable name"),
        ({"env": {"DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "0"}}, "an integer >= 1"),
        ({"env": {"DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE": "half"}}, "off, mask or compact"),
        ({"max_num_batched_tokens": 4096}, "needs chunked_prefill"),
        (
            {"max_num_batched_tokens": 1000, "chunked_prefill": True, "env": {"DEEPINFER_USE_NEXTN_DECODE": "5"}},
            "max_num_seqs x",
        ),
        ({"accelerator": "ascend", "env": {"DEEPINFER_BATCH_INVARIANT": "1"}}, "NVIDIA-only"),
        ({"data_parallel_size": 2, "worker_endpoints": ["tcp://a:5600"]}, "exactly data_parallel_size endpoints"),
        ({"worker_endpoints": ["http://a:5600"]}, "pattern"),
    ],
)
def test_invalid_engine_settings_fail_config_validation(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        config(**overrides)


def test_data_parallel_config_is_accepted_with_a_device_group_per_rank() -> None:
    parsed = config(data_parallel_size=2, context_parallel_size=2, expert_parallel_size=4, visible_devices="0,1,2,3")
    assert (parsed.data_parallel_size, parsed.master_addr, parsed.master_port) == (2, "127.0.0.1", None)


def test_ranks_on_other_hosts_are_reached_never_started() -> None:
    from backends.deepinfer.backend import build_deepinfer_backend
    from backends.workers.backend import DataParallelBackend

    endpoints = ["tcp://node-0:5600", "tcp://node-1:5600"]
    keys = "/etc/deepinfer-gateway/rank-keys"
    backend = build_deepinfer_backend(config(data_parallel_size=2, worker_endpoints=endpoints, rank_keys=keys))
    assert isinstance(backend, DataParallelBackend)
    plan = backend.driver.plan
    assert (plan.remote_endpoints, plan.lockstep, plan.rank_env, plan.keys) == (endpoints, True, None, keys)
    single = build_deepinfer_backend(config(worker_endpoints=["tcp://node-0:5600"], rank_keys=keys))
    assert isinstance(single, DataParallelBackend), "one remote engine is reached as a rank too"


def test_valid_multi_gpu_config() -> None:
    parsed = config(context_parallel_size=8, expert_parallel_size=8, visible_devices="0,1,2,3,4,5,6,7")
    assert parsed.expert_parallel_size == 8


# ---- environment ---------------------------------------------------------------------------------------------


def test_environment_defaults_to_text_serving_and_first_devices() -> None:
    env = engine_environment(config(context_parallel_size=2), {})
    assert env["DEEPINFER_USE_MULTIMODAL_POOL"] == "0"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert env["DEEPINFER_ACCELERATOR"] == "nvidia"
    assert "ASCEND_RT_VISIBLE_DEVICES" not in env


def test_environment_keeps_the_process_devices_and_its_own_choices() -> None:
    env = engine_environment(config(), {"CUDA_VISIBLE_DEVICES": "5", "DEEPINFER_USE_MULTIMODAL_POOL": "1"})
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert "DEEPINFER_USE_MULTIMODAL_POOL" not in env, "an operator's explicit choice is left alone"


def test_config_env_and_devices_win() -> None:
    env = engine_environment(
        config(visible_devices="2", env={"DEEPINFER_USE_MULTIMODAL_POOL": "1", "NCCL_DEBUG": "WARN"}),
        {"CUDA_VISIBLE_DEVICES": "5"},
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["DEEPINFER_USE_MULTIMODAL_POOL"] == "1"
    assert env["NCCL_DEBUG"] == "WARN"


def test_ascend_sets_both_device_variables() -> None:
    env = engine_environment(config(accelerator="ascend"), {"ASCEND_RT_VISIBLE_DEVICES": "3"})
    assert env["CUDA_VISIBLE_DEVICES"] == env["ASCEND_RT_VISIBLE_DEVICES"] == "3"


def test_environment_contradicting_the_config_is_an_error() -> None:
    with pytest.raises(EngineEnvironmentError, match="DEEPINFER_ACCELERATOR=ascend"):
        engine_environment(config(), {"DEEPINFER_ACCELERATOR": "ascend"})
    with pytest.raises(EngineEnvironmentError, match="empty"):
        engine_environment(config(), {"CUDA_VISIBLE_DEVICES": ""})


def test_speculative_tokens_from_the_process_environment_size_the_batch_check() -> None:
    """``max_num_batched_tokens`` must hold ``max_num_seqs x (1 + DEEPINFER_USE_NEXTN_DECODE)`` with the value the
    engine will see: the config's ``env``, else the process environment, else DeepInfer's default of 5."""
    tight = config(max_num_seqs=256, max_num_batched_tokens=512, chunked_prefill=True)  # fits only 1 token/request
    assert engine_environment(tight, {"DEEPINFER_USE_NEXTN_DECODE": "1"})
    with pytest.raises(EngineEnvironmentError, match=r"DEEPINFER_USE_NEXTN_DECODE=5\) = 1536"):
        engine_environment(tight, {})
    with pytest.raises(EngineEnvironmentError, match=r"DEEPINFER_USE_NEXTN_DECODE=2\) = 768"):
        engine_environment(tight, {"DEEPINFER_USE_NEXTN_DECODE": "2"})
    overridden = config(
        max_num_seqs=256, max_num_batched_tokens=512, chunked_prefill=True, env={"DEEPINFER_USE_NEXTN_DECODE": "1"}
    )
    assert engine_environment(overridden, {"DEEPINFER_USE_NEXTN_DECODE": "5"}), "the config's env wins, as it is set"


def test_single_rank_engines_rendezvous_on_a_free_port_each() -> None:
    """DeepInfer's one-rank engine still listens at MASTER_PORT - 50 (default 23333): two gateways on one host
    would collide there, so each engine gets its own free port unless one is configured or already set."""
    ports = {int(engine_environment(config(), {})["MASTER_PORT"]) for _ in range(2)}
    assert len(ports) == 2 and all(port != 23333 for port in ports)
    env = engine_environment(config(), {})
    assert env["MASTER_ADDR"] == "127.0.0.1"
    import socket

    with socket.socket() as listener:  # the port DeepInfer will listen on is free
        listener.bind(("127.0.0.1", int(env["MASTER_PORT"]) - 50))
    assert engine_environment(config(master_port=30050), {})["MASTER_PORT"] == "30050"
    assert "MASTER_PORT" not in engine_environment(config(), {"MASTER_PORT": "29999"}), "an explicit choice stands"
    assert engine_environment(config(env={"MASTER_PORT": "29998"}), {})["MASTER_PORT"] == "29998"


# ---- model directory -----------------------------------------------------------------------------------------


def model_files(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name in model_path.REQUIRED_FILES:
        (directory / name).write_text("{}")
    return directory


def hub_snapshot(cache: Path, repo_id: str, commit: str = "a" * 40, ref: str = "main") -> Path:
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / ref).write_text(commit)
    return model_files(repo / "snapshots" / commit)


def test_local_directory_is_used_as_is(tmp_path: Path) -> None:
    assert resolve_model_dir(str(model_files(tmp_path / "m"))) == (tmp_path / "m").resolve()


def test_local_directory_missing_files_is_named(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"lacks tokenizer\.json, tokenizer_config\.json"):
        resolve_model_dir(str(tmp_path / "m"))


@pytest.mark.parametrize("with_hub", [True, False], ids=["huggingface_hub", "cache-layout"])
def test_repo_id_resolves_to_a_cached_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_hub: bool) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    if not with_hub:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # not installed
    snapshot = hub_snapshot(tmp_path, "deepseek-ai/DeepSeek-V4.1-Flash")
    assert resolve_model_dir("deepseek-ai/DeepSeek-V4.1-Flash") == snapshot
    assert resolve_model_dir("deepseek-ai/DeepSeek-V4.1-Flash", "a" * 40) == snapshot


def test_repo_id_not_in_cache_is_an_error_that_never_downloads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    with pytest.raises(ModelNotFoundError, match=r"never downloads.*huggingface-cli download org/absent"):
        resolve_model_dir("org/absent")
    hub_snapshot(tmp_path, "org/other", ref="main")
    with pytest.raises(ModelNotFoundError, match="revision 'v2'"):
        resolve_model_dir("org/other", "v2")
