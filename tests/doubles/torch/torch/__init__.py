"""TEST DOUBLE of the sliver of ``torch`` DeepInfer's data-parallel collectives use (``full``, ``int64``, ``item``).

Not torch: importable only when a test puts ``tests/doubles/torch`` on the path of a DeepInfer DP worker (see
README.md here). ``IS_TEST_DOUBLE`` is True so a log line or traceback shows at once if it was loaded by mistake.
"""

from __future__ import annotations

from typing import Any

__version__ = "2.13.0+testdouble"
IS_TEST_DOUBLE = True

int64 = "int64"


class Tensor:
    """A flat list of numbers: enough for the one-element tensors DeepInfer all-reduces."""

    def __init__(self, values: list[Any], dtype: str) -> None:
        self.values = values
        self.dtype = dtype

    def item(self) -> Any:
        if len(self.values) != 1:
            raise RuntimeError("a Tensor with more than one element cannot be converted to Scalar")
        return self.values[0]


def full(size: tuple[int, ...], fill_value: Any, *, dtype: str = int64, device: str = "cpu") -> Tensor:
    if device != "cpu":
        raise RuntimeError(f"the torch test double has no {device!r} device")
    count = 1
    for dimension in size:
        count *= dimension
    return Tensor([int(fill_value) if dtype == int64 else fill_value] * count, dtype)
