"""Batched sampling for one engine step: temperature, top-k, top-p, a counter-based draw, and logprobs.

Every request of a step goes through the same few numpy calls on ``[batch, K]`` candidate rows. The uniform for
output position ``i`` of a request is a SplitMix64 hash of (its seed, ``i``), like DeepInfer's sampler, so a seed
gives the same tokens whether the request runs alone or among many. Logprobs are those of the processed
distribution (after temperature, top-k and top-p), floored at -9999.0 as DeepInfer clamps them.
"""

from __future__ import annotations

import numpy as np

LOGPROB_FLOOR = -9999.0
GREEDY_TEMPERATURE = 1e-5
"""DeepInfer turns ``temperature < 1e-5`` into greedy decoding (temperature 1e-5, no top-k/top-p)."""

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)
_TO_UNIT = 2.0**-53


def splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's output function on a uint64 array (wrapping arithmetic)."""
    z = x ^ (x >> _S30)
    z = z * _MIX1
    z ^= z >> _S27
    z *= _MIX2
    z ^= z >> _S31
    return z


def stream_keys(seeds: np.ndarray) -> np.ndarray:
    """Per-request SplitMix64 stream state derived from 64-bit seeds (computed once per request)."""
    return splitmix64(np.asarray(seeds, dtype=np.uint64))


def uniforms(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1): the ``positions``-th output of each request's SplitMix64 stream."""
    state = keys + (positions.astype(np.uint64) + np.uint64(1)) * _GAMMA
    return (splitmix64(state) >> _S11).astype(np.float64) * _TO_UNIT


def process(
    probs: np.ndarray,
    temperature: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    greedy: np.ndarray,
) -> np.ndarray:
    """Apply temperature, top-k and top-p to rows sorted by descending probability; returns normalized rows.

    ``probs`` is float64 ``[B, K]`` (it is modified); zero entries stay zero. ``top_k`` holds values in
    ``1..K`` (``K`` = off), ``top_p`` values in ``(0, 1]``. Greedy rows become one-hot on their best candidate.
    """
    probs /= probs.sum(axis=1, keepdims=True)
    scaled = np.flatnonzero((temperature != 1.0) & ~greedy)
    if scaled.size:
        with np.errstate(divide="ignore"):
            logits = np.log(probs[scaled]) / temperature[scaled, None]
        logits -= logits.max(axis=1, keepdims=True)
        rows = np.exp(logits)
        probs[scaled] = rows / rows.sum(axis=1, keepdims=True)
    width = probs.shape[1]
    limited = np.flatnonzero((top_k < width) & ~greedy)
    if limited.size:
        rows = probs[limited]
        rank = np.cumsum(rows > 0.0, axis=1)
        rows[rank > top_k[limited, None]] = 0.0
        probs[limited] = rows / rows.sum(axis=1, keepdims=True)
    nucleus = np.flatnonzero((top_p < 1.0) & ~greedy)
    if nucleus.size:
        rows = probs[nucleus]
        before = np.cumsum(rows, axis=1) - rows
        rows[before >= top_p[nucleus, None]] = 0.0
        probs[nucleus] = rows / rows.sum(axis=1, keepdims=True)
    pick = np.flatnonzero(greedy)
    if pick.size:
        best = probs[pick].argmax(axis=1)
        probs[pick] = 0.0
        probs[pick, best] = 1.0
    return probs


def draw(probs: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of one column per row; never returns a zero-probability column."""
    cdf = np.cumsum(probs, axis=1)
    column = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
    width = probs.shape[1]
    np.minimum(column, width - 1, out=column)
    rows = np.arange(probs.shape[0])
    bad = np.flatnonzero(probs[rows, column] <= 0.0)  # only rounding at the end of a row can land here
    if bad.size:
        column[bad] = width - 1 - np.argmax(probs[bad, ::-1] > 0.0, axis=1)
    return column


def logprobs(probs: np.ndarray) -> np.ndarray:
    """Log of processed probabilities, floored at -9999.0 (zero probability included)."""
    with np.errstate(divide="ignore"):
        out = np.log(probs)
    np.maximum(out, LOGPROB_FLOOR, out=out)
    return out


def top_logprobs(probs: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Columns of each row's ``n`` most likely candidates (descending, ties by column) and their logprobs."""
    order = np.argsort(-probs, axis=1, kind="stable")[:, :n]
    return order, logprobs(np.take_along_axis(probs, order, axis=1))
