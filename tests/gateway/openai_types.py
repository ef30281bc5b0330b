"""Hypothesis strategies for JSON request bodies, built from the request types the official ``openai`` package ships
(``TypedDict``s such as ``openai.types.chat.completion_create_params.CompletionCreateParamsNonStreaming``).

The package's types give field names (with their wire aliases), which fields are required, literals, unions and
nesting; they carry no numeric bounds, so callers pass ``overrides`` (by field name, at any depth) for the fields
whose valid range OpenAI documents in prose (``temperature`` 0-2 and so on).
"""

from __future__ import annotations

import collections.abc
import types
import typing
from typing import Any, Literal, NotRequired, Required, Union, get_args, get_origin

from hypothesis import strategies as st
from typing_extensions import get_type_hints, is_typeddict

JSON_KINDS = ("null", "boolean", "integer", "number", "string", "array", "object")
TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e6, 1e6) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
_LISTS = (list, collections.abc.Iterable, collections.abc.Sequence)


def _is_list(origin: object) -> bool:
    # openai's SequenceNotStr[T] is a Sequence that is not a str: on the wire, an array.
    return origin in _LISTS or getattr(origin, "__name__", "") == "SequenceNotStr"


def wire_fields(typed_dict: type) -> dict[str, tuple[Any, bool]]:
    """A TypedDict's fields by their JSON names: (type, required)."""
    hints = get_type_hints(typed_dict, include_extras=True)
    out = {}
    for name, hint in hints.items():
        wire = name
        for meta in _metadata(hint):
            wire = getattr(meta, "alias", None) or wire
        # The package's modules use string annotations, so ``__required_keys__`` misses ``Required[...]``.
        origin = get_origin(hint)
        total = getattr(typed_dict, "__total__", True)
        out[wire] = (hint, origin is Required or (total and origin is not NotRequired))
    return out


def _metadata(hint: Any) -> tuple[Any, ...]:
    while get_origin(hint) in (Required, NotRequired):
        hint = get_args(hint)[0]
    return hint.__metadata__ if get_origin(hint) is typing.Annotated else ()


def _strip(hint: Any) -> Any:
    while get_origin(hint) in (Required, NotRequired, typing.Annotated):
        hint = get_args(hint)[0]
    return hint


def json_kinds(hint: Any) -> set[str]:
    """The JSON kinds a type accepts (a number field accepts integers too)."""
    hint = _strip(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return set().union(*(json_kinds(a) for a in args))
    if origin is Literal:
        return {json_kind(a) for a in args}
    if hint is type(None):
        return {"null"}
    if hint is bool:
        return {"boolean"}
    if hint is int:
        return {"integer"}
    if hint is float:
        return {"integer", "number"}
    if hint is str:
        return {"string"}
    if hint is object:
        return set(JSON_KINDS)
    if is_typeddict(hint) or origin in (dict, collections.abc.Mapping) or hint is dict:
        return {"object"}
    if _is_list(origin):
        return {"array"}
    raise TypeError(f"no JSON kind for {hint!r}")


def json_kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


VALUES_OF_KIND: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "integer": st.integers(-(2**40), 2**40),
    "number": st.floats(-1e9, 1e9).filter(lambda x: not x.is_integer()),
    "string": TEXT,
    "array": st.lists(JSON_VALUES, max_size=2),
    "object": st.dictionaries(TEXT, JSON_VALUES, max_size=2),
}


def from_type(hint: Any, overrides: dict[str, st.SearchStrategy[Any]], name: str | None = None) -> st.SearchStrategy:
    """JSON values of the type ``hint``; ``overrides`` replace the strategy of fields with that name."""
    if name is not None and name in overrides:
        return overrides[name]
    hint = _strip(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        return st.one_of([from_type(a, overrides, name) for a in args])
    if origin is Literal:
        return st.sampled_from(args)
    if hint is type(None):
        return st.none()
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(-(2**31), 2**31 - 1)
    if hint is float:
        return st.floats(-1e6, 1e6)
    if hint is str:
        return TEXT
    if hint is object:
        return JSON_VALUES
    if is_typeddict(hint):
        fields = wire_fields(hint)
        required = {k: from_type(t, overrides, k) for k, (t, needed) in fields.items() if needed}
        optional = {k: from_type(t, overrides, k) for k, (t, needed) in fields.items() if not needed}
        return st.fixed_dictionaries(required, optional=optional)
    if origin in (dict, collections.abc.Mapping):
        return st.dictionaries(TEXT, from_type(args[1], overrides), max_size=2)
    if _is_list(origin):
        return st.lists(from_type(args[0], overrides), max_size=2)
    raise TypeError(f"no strategy for {hint!r}")
