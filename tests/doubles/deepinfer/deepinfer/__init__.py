"""TEST DOUBLE of DeepSeek's ``deepinfer`` 0.1.0 package, for the gateway's tests only (see README.md here).

It follows ``shared/reference/deepinfer-engine.md``: same module paths, classes and signatures as the parts of
DeepInfer the gateway's binding uses, with the same traps, and a trivial echo "model".
"""

from __future__ import annotations

import os

from deepinfer.environ import envs as envs

__version__ = "0.1.0+testdouble"
IS_TEST_DOUBLE = True

_WATCHED_PREFIXES = ("DEEPINFER_", "CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")
IMPORT_ENVIRON: dict[str, str] = {k: v for k, v in os.environ.items() if k.startswith(_WATCHED_PREFIXES)}
"""The engine-relevant environment as it was when ``deepinfer`` was imported (what import-time reads saw)."""

# DeepInfer's import side effects (deepinfer/__init__.py).
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
os.environ["CUDA_SCALE_LAUNCH_QUEUES"] = "4x"
