"""Prompt logprobs of the reference engine: each prompt token scored by the model given the tokens before it."""

from __future__ import annotations

import numpy as np

from backends.engine.protocol import EngineOutput

from .model import NO_TOKEN, NGramModel, regions_after, smoothed


def attach_prompt_logprobs(outputs: list[EngineOutput], scored: dict[str, list[float]]) -> None:
    """Put each scored request's prompt logprobs on its first output (the prompt step's), as DeepInfer does."""
    for position, out in enumerate(outputs):
        values = scored.pop(out.request_id, None)
        if values is not None:
            outputs[position] = out._replace(prompt_logprobs=values)
            if not scored:
                return


def prompt_logprobs(model: NGramModel, prompt: np.ndarray, background: np.ndarray) -> list[float]:
    """Logprob of each prompt token after the first given the tokens before it, from the same candidate rows that
    sampling uses (unprocessed: no temperature, top-k or top-p), smoothed (``model.smoothed``): a token outside
    its context's top ``K`` keeps a small, finite probability, as under a real model, so the logprobs of any
    text sum to a finite number (word perplexity). ``background`` is ``model.background()``, computed once."""
    tokens = prompt.astype(np.int64)
    if tokens.size < 2:
        return []
    regions = regions_after(tokens, np.zeros(1, dtype=np.int64), model.region_of_token)
    prev2 = np.r_[NO_TOKEN, tokens[:-2]]
    ids, probs = model.candidates(prev2, tokens[:-1], regions[:-1])
    weights = probs.astype(np.float64)
    totals = np.maximum(weights.sum(axis=1), np.finfo(np.float64).tiny)
    chosen = ((ids.astype(np.int64) == tokens[1:, None]) * weights).sum(axis=1) / totals
    return np.log(smoothed(chosen, background[tokens[1:]])).tolist()
