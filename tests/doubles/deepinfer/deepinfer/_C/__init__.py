"""TEST DOUBLE of DeepInfer's compiled extension ``deepinfer._C`` (pure Python here)."""

from deepinfer._C import engine as engine

__all__ = ["engine"]
