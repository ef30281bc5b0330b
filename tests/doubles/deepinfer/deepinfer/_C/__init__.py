"""TEST DOUBLE of DeepInfer's compiled extension ``deepinfer._C`` (pure Python here).

The real ``_C`` is a torch C++ extension linked against ``libc10.so`` / ``libtorch*.so`` without an rpath to them:
it loads only once ``import torch`` has loaded those libraries, and fails with exactly this error otherwise.
"""

import sys

if "torch" not in sys.modules:
    raise ImportError("libc10.so: cannot open shared object file: No such file or directory")

from deepinfer._C import engine as engine

__all__ = ["engine"]
