"""The ``lmdeploy`` backend kind: LMDeploy ``api_server`` nodes behind the shared backend interface."""

from backends.lmdeploy.backend import LMDeployBackend, build_lmdeploy_backend

__all__ = ["LMDeployBackend", "build_lmdeploy_backend"]
