"""Structured outputs for the reference engine: DeepInfer's ``SamplingParams.so_args`` on the CPU, via llguidance.

DeepInfer compiles ``so_args`` with xgrammar, which needs torch; the reference engine must stay light, so it uses
llguidance (a dependency-free Rust library with a 32-bit-word token bitmask, ~10 us per mask on this vocabulary).
The contract is DeepInfer's (``reference/deepinfer-engine.md`` section D):

- ``schema_type`` ``json`` | ``regex`` | ``ebnf`` and ``schema``, a string: JSON-schema text, a regex, or a
  GBNF grammar with a ``root`` rule. Optional ``trigger_token_ids`` (free text until that token sequence has
  appeared in the output) and ``bound_token_id`` (needs a trigger; once emitted while the trigger is pending,
  the rest of the trigger is forced, then the grammar applies). EOS is allowed only where the grammar accepts
  and is the only choice once it is complete; after EOS the mask is full.
- Raised by ``add_request``: ``serialized`` / ``bound_token_ids`` keys (ValueError), no ``schema`` (KeyError),
  ``so_args`` not a mapping (TypeError; DeepInfer has no check). Everything else that is wrong (unknown
  ``schema_type``, bad trigger or bound, a schema that does not compile) ends the request with DeepInfer's
  ``FINISHED_SO_FAILED`` output instead. Stricter than DeepInfer: trigger or bound ids outside the vocabulary
  fail too (they could never match, or could not be forced).
- The bound token itself is emitted (then the rest of the trigger, after what the bound already matched); a bound
  equal to EOS therefore ends the request like any EOS.
- Masks apply to the model's top-K candidates; where the grammar allows none of them, the row becomes the allowed
  tokens of highest context-free weight (``token_prior``), so a tiny model can still complete any grammar. Free
  strings are continued as prose until the model happens to close them: bound them (``maxLength``, ``enum``,
  ``pattern``) when a test needs the output to finish.

Dialects: ``json`` is JSON Schema as llguidance implements it (draft 2020-12, properties in schema order,
unsupported keywords ignored as xgrammar warns and ignores them), made strict like xgrammar's ``strict_mode=True``
by ``strict_schema.strict_json_schema``; whitespace is free as with xgrammar's default ``any_whitespace``. A schema
may also be a dict (xgrammar accepts both). ``regex`` is Rust ``regex`` syntax, matched against the whole output
(``^``/``$`` are accepted; no lookaround or backreferences). ``ebnf`` is GBNF, llama.cpp's dialect that xgrammar
follows, translated to llguidance's Lark format by llguidance's own translator: rules made only of terminals become
lexemes, which llguidance lexes greedily, so a grammar that depends on ambiguous tokenization of its terminals may
accept less than under xgrammar. xgrammar's extensions beyond GBNF, such as lookahead assertions ``(= ...)``, fail
the request (FINISHED_SO_FAILED), and so do Lark grammars, which DeepInfer would not accept.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy as llguidance_np
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark
from tokenizers import Tokenizer

from .model import NGramModel
from .strict_schema import strict_json_schema
from .structured_state import FORCING, GRAMMAR, StructuredState

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of llguidance's stubs only

SCHEMA_TYPES = frozenset({"json", "regex", "ebnf"})
REJECTED_KEYS = ("serialized", "bound_token_ids")
"""Keys DeepInfer's ``SOMatcherBuilder`` refuses synchronously with a ValueError."""

GRAMMAR_CACHE_SIZE = 128
"""Compiled grammars kept per engine, keyed by (schema_type, schema); failures are cached too."""

JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": True, "lenient": True}
"""Like xgrammar's defaults: any whitespace, unsupported keywords ignored (xgrammar warns and ignores them)."""

PARALLEL_MASK_ROWS = 8
"""From this many grammar rows in a step, masks are computed by llguidance's thread pool (GIL released)."""


class StructuredOutputError(Exception):
    """``so_args`` that DeepInfer would accept at ``add_request`` but fail asynchronously (FINISHED_SO_FAILED)."""


class CompiledGrammar:
    """A request's grammar compiled ahead of ``add_request``: the pristine matcher and its trigger, or the error."""

    __slots__ = ("bound", "error", "template", "trigger")

    def __init__(
        self,
        template: llguidance.LLMatcher | None,
        trigger: tuple[int, ...] = (),
        bound: int | None = None,
        error: str = "",
    ) -> None:
        self.template = template
        self.trigger = trigger
        self.bound = bound
        self.error = error


class CompiledSoArgs(dict[str, Any]):
    """``so_args`` whose grammar was compiled off the engine thread; still the same mapping for everything else."""

    __slots__ = ("grammar",)

    def __init__(self, so_args: Mapping[str, Any], grammar: CompiledGrammar) -> None:
        super().__init__(so_args)
        self.grammar = grammar


def check_so_args(so_args: object) -> None:
    """The synchronous checks of DeepInfer's ``add_request``; everything else fails later as SO_FAILED."""
    if not isinstance(so_args, Mapping):
        raise TypeError(f"so_args must be a dict, not {type(so_args).__name__}")
    for key in REJECTED_KEYS:
        if key in so_args:
            raise ValueError(f"so_args key {key!r} is not supported")
    if "schema" not in so_args:
        raise KeyError("schema")


def token_prior(model: NGramModel) -> tuple[np.ndarray, np.ndarray]:
    """A context-free weight per token for rows where the grammar allows none of the model's top-K candidates:
    the model's ``background`` distribution (every token the grammar allows can be drawn). Returns the ids
    ordered by descending weight and the weights (by id)."""
    weights = model.background()
    order = np.argsort(-weights, kind="stable")
    return order, weights


class StructuredOutputs:
    """Per-engine structured-output machinery: the llguidance tokenizer, the grammar cache, batched masks."""

    def __init__(self, tokenizer: Tokenizer, model: NGramModel, eos: int, cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        self.vocab_size = model.vocab_size
        self.eos = eos
        self._tokenizer = tokenizer
        self._model = model
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher | str] = OrderedDict()
        self._lock = threading.Lock()  # compile() runs on the gateway's preparation threads and the engine thread
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._prior_order: np.ndarray | None = None
        self._prior: np.ndarray | None = None
        self._words = (self.vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None

    # ---- compile ------------------------------------------------------------------------------------------

    def compile(self, so_args: Mapping[str, Any]) -> StructuredState:
        """A fresh state for a request; raises StructuredOutputError where DeepInfer fails asynchronously.

        ``so_args`` compiled ahead (``prepare``) only cost a copy of their matcher here.
        """
        grammar = so_args.grammar if isinstance(so_args, CompiledSoArgs) else self._grammar(so_args)
        if grammar.template is None:
            raise StructuredOutputError(grammar.error)
        return StructuredState(grammar.template.deep_copy(), grammar.trigger, grammar.bound)

    def prepare(self, so_args: Mapping[str, Any]) -> Mapping[str, Any]:
        """Compiles the grammar of ``so_args`` now, on any thread; ``add_request`` then only copies it.

        ``so_args`` that ``add_request`` refuses synchronously come back unchanged, so it still raises for them.
        """
        if isinstance(so_args, CompiledSoArgs):
            return so_args
        try:
            check_so_args(so_args)
        except (TypeError, ValueError, KeyError):
            return so_args
        return CompiledSoArgs(so_args, self._grammar(so_args))

    def _grammar(self, so_args: Mapping[str, Any]) -> CompiledGrammar:
        try:
            schema_type = so_args.get("schema_type")
            if schema_type not in SCHEMA_TYPES:
                raise StructuredOutputError(f"unknown schema_type {schema_type!r}")
            trigger = self._trigger(so_args.get("trigger_token_ids"))
            bound = so_args.get("bound_token_id")
            if bound is not None:
                if not self._is_token(bound):
                    raise StructuredOutputError(f"bound_token_id must be a token id, got {bound!r}")
                if not trigger:
                    raise StructuredOutputError("bound_token_id needs non-empty trigger_token_ids")
            schema = so_args["schema"]
            if schema_type == "json" and isinstance(schema, Mapping):
                schema = json.dumps(schema)
            if not isinstance(schema, str):
                raise StructuredOutputError(f"schema must be a string, not {type(schema).__name__}")
            return CompiledGrammar(self._compiled(schema_type, schema), trigger, bound)
        except StructuredOutputError as exc:
            return CompiledGrammar(None, error=str(exc))

    def _is_token(self, value: object) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < self.vocab_size

    def _trigger(self, value: object) -> tuple[int, ...]:
        if value is None:
            return ()
        if not isinstance(value, list | tuple) or not all(self._is_token(t) for t in value):
            raise StructuredOutputError(f"trigger_token_ids must be a list of token ids, got {value!r}")
        return tuple(value)

    def _compiled(self, schema_type: str, schema: str) -> llguidance.LLMatcher:
        """The cached pristine matcher for (schema_type, schema); requests get deep copies of it."""
        key = (schema_type, schema)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
        if entry is None:
            entry = self._build(schema_type, schema)  # outside the lock: compiles may run in parallel
            with self._lock:
                self._cache[key] = entry
                if len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(entry, str):
            raise StructuredOutputError(entry)
        return entry

    def _build(self, schema_type: str, schema: str) -> llguidance.LLMatcher | str:
        """Compile a grammar, or return the error message (cached like a grammar, so retries stay cheap)."""
        try:
            if schema_type == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    strict_json_schema(json.loads(schema)), overrides=JSON_OPTIONS
                )
            elif schema_type == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(schema)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(schema))
        except Exception as exc:  # malformed JSON, GBNF syntax errors: the translators raise various types
            return f"{schema_type} schema does not compile: {exc}"
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"{schema_type} schema does not compile: {matcher.get_error()}"
        return matcher

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (~40 ms): engines that never see so_args never pay for it."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tokenizer_within_vocab(self._tokenizer, self.vocab_size),
                    n_vocab=self.vocab_size,
                    eos_token=self.eos,
                )
            return self._ll_tokenizer

    # ---- per step -----------------------------------------------------------------------------------------

    def constrain(
        self, states: Sequence[StructuredState], ids: np.ndarray, probs: np.ndarray, no_eos: np.ndarray
    ) -> np.ndarray:
        """Mask the candidate rows (``[n, K]``, modified in place) of structured requests for one token.

        Forced rows become one-hot; grammar rows keep the model's allowed candidates, or, when the grammar
        allows none of them, the K allowed tokens of highest prior weight. Returns the rows whose grammar
        failed (matcher error or nothing allowed): they end with FINISHED_SO_FAILED instead of a token.
        """
        n = len(states)
        failed = np.zeros(n, dtype=bool)
        grammar_rows: list[int] = []
        for i, state in enumerate(states):
            if state.phase == GRAMMAR:
                grammar_rows.append(i)
            elif state.phase == FORCING:
                _one_hot(ids[i], probs[i], state.next_forced)
        if not grammar_rows:
            return failed
        rows = np.array(grammar_rows)
        masks = np.empty((rows.size, self._words), dtype=np.int32)
        if rows.size >= PARALLEL_MASK_ROWS:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llguidance_np.fill_next_token_bitmask_par(
                self._executor, [(states[i].matcher, j) for j, i in enumerate(grammar_rows)], masks
            )
        else:
            row_bytes = masks.shape[1] * 4
            for j, i in enumerate(grammar_rows):
                states[i].matcher.unsafe_compute_mask_ptr(masks[j].ctypes.data, row_bytes)
        for i in grammar_rows:
            if states[i].matcher.is_error():
                failed[i] = True
        if no_eos.any():
            self._mask_eos(masks, no_eos[rows])
        cand = ids[rows]  # int64
        allowed = (masks[np.arange(rows.size)[:, None], cand >> 5] >> (cand & 31)) & 1
        sub = probs[rows] * allowed
        probs[rows] = sub
        empty = np.flatnonzero(sub.sum(axis=1) <= 0.0)
        for j in empty.tolist():
            i = grammar_rows[j]
            if not failed[i] and not self._fallback(masks[j], ids[i], probs[i]):
                failed[i] = True
        return failed

    def _mask_eos(self, masks: np.ndarray, rows: np.ndarray) -> None:
        """``first_n_token_no_eos``: clear EOS in the masks of ``rows``, unless it is all the grammar allows."""
        word, bit = divmod(self.eos, 32)
        eos = np.int32(1 << bit) if bit < 31 else np.int32(np.iinfo(np.int32).min)
        for j in np.flatnonzero(rows).tolist():
            without = masks[j].copy()
            without[word] &= ~eos
            if without.any():
                masks[j] = without

    def _fallback(self, mask: np.ndarray, ids: np.ndarray, probs: np.ndarray) -> bool:
        """Replace a row by the allowed tokens of highest prior weight; False if the grammar allows nothing."""
        if self._prior_order is None:
            self._prior_order, self._prior = token_prior(self._model)
        order = self._prior_order
        assert self._prior is not None
        bits = np.unpackbits(mask.view(np.uint8), bitorder="little", count=self.vocab_size).view(bool)
        ranked = bits[order]
        k = ids.size
        allowed = order[ranked][:k]
        if allowed.size == 0:
            return False
        ids[: allowed.size] = allowed
        probs[: allowed.size] = self._prior[allowed]
        if allowed.size < k:  # pad with distinct disallowed ids at probability 0
            ids[allowed.size :] = order[~ranked][: k - allowed.size]
            probs[allowed.size :] = 0.0
        return True

    def advance(self, states: Sequence[StructuredState], tokens: Sequence[int]) -> list[int]:
        """Advance each state by its emitted token; returns the indices whose token was rejected."""
        eos = self.eos
        return [i for i, (state, token) in enumerate(zip(states, tokens, strict=True)) if not state.advance(token, eos)]


def _one_hot(ids: np.ndarray, probs: np.ndarray, token: int) -> None:
    """Force ``token``: it becomes the row's only candidate (at its column, or in place of the last one)."""
    at = np.flatnonzero(ids == token)
    column = int(at[0]) if at.size else ids.size - 1
    ids[column] = token
    probs[:] = 0.0
    probs[column] = 1.0


def tokenizer_within_vocab(tokenizer: Tokenizer, vocab_size: int) -> str:
    """The tokenizer's JSON without the added tokens past the model's vocabulary (the image placeholder, which
    the engine expands before sampling and no grammar can produce)."""
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [token for token in spec.get("added_tokens", []) if token["id"] < vocab_size]
    return json.dumps(spec)
