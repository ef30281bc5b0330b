"""Give memory back to the OS after huge prompts (glibc): RSS should fall again once a 7 MiB prompt is gone.

glibc keeps freed memory in its arenas, and after the first large buffer is freed it raises its mmap threshold
(up to 32 MiB), so later multi-MiB buffers (request bodies, parsed and rendered prompts) land in the arenas too
and stay there. ``cap_mmap_threshold`` pins the threshold, so buffers of 1 MiB or more are always mapped and
unmapped when freed; ``release_free_heap`` (``malloc_trim``) returns what a huge tokenization left in the arenas.
Both are no-ops where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import Any

MMAP_THRESHOLD_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number

_trim_lock = threading.Lock()


def _libc() -> Any | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    return libc


_LIBC = _libc()


def cap_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Buffers of ``size`` bytes or more are mmapped (and returned to the OS when freed); True if applied."""
    return _LIBC is not None and _LIBC.mallopt(_M_MMAP_THRESHOLD, size) == 1


def release_free_heap() -> None:
    """Returns free arena memory to the OS (``malloc_trim``); concurrent calls collapse into one."""
    if _LIBC is not None and _trim_lock.acquire(blocking=False):
        try:
            _LIBC.malloc_trim(0)  # ctypes releases the GIL for the call
        finally:
            _trim_lock.release()
