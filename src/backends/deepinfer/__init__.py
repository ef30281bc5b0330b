"""The ``deepinfer`` backend kind: DeepSeek's DeepInfer engine in process (NVIDIA SM100 / Ascend 950).

``deepinfer`` itself is imported lazily, on the engine thread, after the environment it reads at import time has
been set; the gateway installs and runs without it. See docs/deepinfer.md.
"""
