"""Harness processes only (this directory on ``PYTHONPATH``): DeepInfer's model replaced, see deepinfer_cpu_model."""

import deepinfer_cpu_model

deepinfer_cpu_model.install()
