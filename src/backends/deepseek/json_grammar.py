"""JSON Schema compiled to GBNF rules, for schema values embedded in a larger grammar (forced DSML tool calls).

``response_format`` schemas go to the engine as JSON Schema and the engine compiles them (xgrammar on DeepInfer,
llguidance on the reference engine). A forced tool call is a DSML block whose parameter values each follow a
sub-schema, and DeepInfer's ``so_args`` accept one grammar only (``ebnf``, xgrammar's GBNF): so the sub-schemas
are compiled here, into GBNF that both engines read. The semantics follow the engines' JSON compilers in
xgrammar's strict mode:

- ``type`` (one or a list), ``enum``, ``const``, ``anyOf`` / ``oneOf`` (either branch), ``allOf`` (merged),
  local ``$ref`` (recursion included), booleans as schemas;
- objects: declared ``properties`` in declaration order, ``required`` ones always, others at most once; no other
  keys unless ``additionalProperties`` allows them (an object that declares no properties allows any);
- arrays: ``items``, ``prefixItems``, ``minItems`` / ``maxItems`` (an array without ``items`` holds any JSON);
- strings: ``minLength`` / ``maxLength`` (in characters, an escape counts as one), ``pattern`` and the
  ``format``s of ``regex_grammar.FORMATS`` (``string_grammar``, ``regex_grammar``);
- integers and numbers: ``minimum`` / ``maximum`` / ``exclusiveMinimum`` / ``exclusiveMaximum`` (a bounded
  number is written without an exponent, with at most 16 decimals; bounds of at most ``MAX_BOUND_DIGITS``
  digits: ``number_grammar``).

Refused with ``ValueError`` (a 400 naming the parameter), rather than silently unenforced: ``multipleOf``,
``minProperties`` / ``maxProperties``, ``pattern`` or ``format`` together with ``minLength`` / ``maxLength``,
larger bounds. Not compiled, and documented as such (the value is only as constrained as its other keywords
make it): other ``format``s, ``not``, ``if``/``then``/``else``, ``uniqueItems``, ``contains``,
``patternProperties``, ``dependent*``. A schema that nothing satisfies (``false``, an empty integer range) raises
``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backends.deepseek.gbnf import alternatives, class_char, json_literal, literal, repeat
from backends.deepseek.json_schema import pointer
from backends.deepseek.number_grammar import integer_value, number_value
from backends.deepseek.string_grammar import JSON_CHAR_THEN, StringGrammar

BASE_RULES = (
    'json-string ::= "\\"" json-char* "\\""',
    # A string value of a schema: the rest up to its closing quote is right-recursive, the quote inside. xgrammar
    # then masks its tokens in microseconds (with `json-char* "\""` a token such as `",` needs the parent's
    # context: about 10 ms a token); llguidance is as fast. Free-form JSON keeps `json-string`: non-recursive, it
    # stays one lexeme for llguidance (JSON_DEPTH).
    'json-text ::= "\\"" json-string-rest',
    'json-string-rest ::= "\\"" | ' + JSON_CHAR_THEN.format(next="json-string-rest"),
    'json-char ::= [^"\\\\\\x00-\\x1f] | "\\\\" (["\\\\/bfnrt] | "u" hex hex hex hex)',
    "hex ::= [0-9a-fA-F]",
    'json-number ::= json-int ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    'json-int ::= "-"? ("0" | [1-9] [0-9]*)',
    'json-bool ::= "true" | "false"',
    'ws ::= " "?',
)
"""Rules every compiled schema may use, defined once per grammar (with ``json_value_rules``)."""

REFUSED_KEYWORDS = ("multipleOf", "minProperties", "maxProperties")
"""Keywords a forced call cannot enforce in GBNF here: refused (400) rather than silently ignored."""

JSON_DEPTH = 4
"""Nesting depth of free-form JSON (``{}``, arrays without ``items``). Bounded so its rules are non-recursive:
grammar libraries with a lexer (llguidance) then compile such a value to one regular token."""

_STRING_KEYWORDS = ("minLength", "maxLength", "pattern", "format")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_KEYWORDS = ("properties", "additionalProperties", "required")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems", "maxItems")


def json_value_rules(depth: int = JSON_DEPTH) -> list[str]:
    """``json-value``, ``json-object`` and ``json-array``: any JSON up to ``depth`` levels of nesting."""
    rules = ['json-value-0 ::= json-string | json-number | json-bool | "null"']
    for d in range(1, depth + 1):
        inner = f"json-value-{d - 1}"
        member = f'json-string ws ":" ws {inner}'
        rules += [
            f'json-object-{d} ::= "{{" ws ({member} ws ("," ws {member} ws)*)? "}}"',
            f'json-array-{d} ::= "[" ws ({inner} ws ("," ws {inner} ws)*)? "]"',
            f"json-value-{d} ::= {inner} | json-object-{d} | json-array-{d}",
        ]
    return [
        *rules,
        f"json-value ::= json-value-{depth}",
        f"json-object ::= json-object-{depth}",
        f"json-array ::= json-array-{depth}",
    ]


class SchemaGrammar:
    """Compiles the sub-schemas of one root schema into GBNF rules named ``{prefix}-...``.

    ``value(schema)`` returns a GBNF expression for JSON values valid under ``schema`` and adds the rules it
    needs to ``rules``; ``$ref`` targets become one rule each, so recursive schemas compile to recursive rules.
    """

    def __init__(self, root: Any, prefix: str, rules: list[str]) -> None:
        self.root = root
        self.prefix = prefix
        self.rules = rules
        self._refs: dict[str, str] = {}
        self._strings = StringGrammar(prefix, rules)
        self._count = 0

    def value(self, schema: Any) -> str:
        if schema is True:
            return "json-value"
        if schema is False:
            raise ValueError("the schema false allows no value")
        if not isinstance(schema, Mapping):
            raise ValueError("a schema must be an object or a boolean")
        if "$ref" in schema:
            return self._ref(schema["$ref"])
        if "allOf" in schema:
            return self.value(self.merged(schema))
        refused = next((key for key in REFUSED_KEYWORDS if key in schema), None)
        if refused is not None:
            raise ValueError(f"{refused} is not supported in a forced tool call (use tool_choice 'auto')")
        if "const" in schema:
            return json_literal(schema["const"])
        if isinstance(schema.get("enum"), list):
            return alternatives([json_literal(v) for v in schema["enum"]])
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                return alternatives([self.value(branch) for branch in schema[key]])
        types = self.types(schema)
        if types is None:
            return "json-value"
        return alternatives([self._typed(kind, schema) for kind in types])

    def merged(self, schema: Mapping[str, Any]) -> dict[str, Any]:
        """``schema`` with its ``allOf`` branches folded in (properties and required lists are unions)."""
        out: dict[str, Any] = {k: v for k, v in schema.items() if k != "allOf"}
        for branch in schema.get("allOf") or ():
            branch = self.resolve(branch)
            if branch is False:
                raise ValueError("an allOf branch is false: the schema allows no value")
            if not isinstance(branch, Mapping):
                continue
            if "allOf" in branch:
                branch = self.merged(branch)
            for key, item in branch.items():
                if key == "properties" and isinstance(item, Mapping):
                    out["properties"] = {**item, **out.get("properties", {})}
                elif key == "required" and isinstance(item, list):
                    out["required"] = [*out.get("required", []), *item]
                else:
                    out.setdefault(key, item)
        return out

    def resolve(self, schema: Any) -> Any:
        seen = 0
        while isinstance(schema, Mapping) and isinstance(schema.get("$ref"), str) and seen < 32:
            target = pointer(self.root, schema["$ref"])
            if target is None:
                raise ValueError(f"$ref {schema['$ref']!r} points at nothing in the schema")
            schema, seen = target, seen + 1
        return schema

    @staticmethod
    def types(schema: Mapping[str, Any]) -> list[str] | None:
        """The JSON types to generate for ``schema`` (None: any JSON), inferred from keywords without a type."""
        kind = schema.get("type")
        if isinstance(kind, str):
            return [kind]
        if isinstance(kind, list) and kind:
            return list(dict.fromkeys(kind))
        inferred = [
            name
            for name, keywords in (
                ("object", _OBJECT_KEYWORDS),
                ("array", _ARRAY_KEYWORDS),
                ("string", _STRING_KEYWORDS),
                ("number", _NUMBER_KEYWORDS),
            )
            if any(k in schema for k in keywords)
        ]
        return inferred or None

    # ---- internals ------------------------------------------------------------------------------------------

    def _rule(self, body: str, name: str | None = None) -> str:
        if name is None:
            self._count += 1
            name = f"{self.prefix}-r{self._count}"
        self.rules.append(f"{name} ::= {body}")
        return name

    def _ref(self, ref: Any) -> str:
        if not isinstance(ref, str):
            raise ValueError("$ref must be a string")
        name = self._refs.get(ref)
        if name is None:
            target = pointer(self.root, ref)
            if target is None:
                raise ValueError(f"$ref {ref!r} points at nothing in the schema")
            self._count += 1
            name = self._refs[ref] = f"{self.prefix}-ref{self._count}"
            self._rule(self.value(target), name)  # registered first, so recursion finds the name
        return name

    def _typed(self, kind: str, schema: Mapping[str, Any]) -> str:
        if kind == "string":
            return self._strings.value(schema)
        if kind == "integer":
            return integer_value(schema)
        if kind == "number":
            return number_value(schema)
        if kind == "boolean":
            return "json-bool"
        if kind == "null":
            return '"null"'
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        raise ValueError(f"unknown type {kind!r}")

    def _object(self, schema: Mapping[str, Any]) -> str:
        properties = schema.get("properties")
        properties = properties if isinstance(properties, Mapping) else {}
        required = set(schema.get("required") or ())
        extra = schema.get("additionalProperties", None if properties else True)
        extra_member = None
        if extra is not None and extra is not False:
            extra_member = f'{self._other_key(list(properties))} ws ":" ws {self.value(extra)}'
        members = [
            (f'{json_literal(key)} ws ":" ws {self.value(sub)}', key in required) for key, sub in properties.items()
        ]
        missing = required - set(properties)
        if missing and extra_member is None:
            raise ValueError(f"required properties {sorted(missing)} are not allowed by the schema")
        if not members:
            if extra_member is None:
                return '"{" ws "}"'
            return f'"{{" ws ({extra_member} ws ("," ws {extra_member} ws)*)? "}}"'
        # tails[i]: what may follow once a member before index i has been written; every member is ", " + m
        tail_names = [f"{self.prefix}-r{self._count + 1 + i}" for i in range(len(members) + 1)]
        self._count += len(members) + 1
        for i, (member, is_required) in enumerate(members):
            step = f'"," ws {member} ws'
            self._rule(f"{step if is_required else '(' + step + ')?'} {tail_names[i + 1]}", tail_names[i])
        last = f'("," ws {extra_member} ws)*' if extra_member is not None else '""'
        self._rule(last, tail_names[-1])
        starts = []
        for i, (member, is_required) in enumerate(members):
            starts.append(f"{member} ws {tail_names[i + 1]}")
            if is_required:
                break
        else:  # every declared member optional: the object may also start with an extra one, or be empty
            if extra_member is not None:
                starts.append(f"{extra_member} ws {tail_names[-1]}")
            starts.append('""')
        return f'"{{" ws {alternatives(starts)} "}}"'

    def _other_key(self, declared: list[str]) -> str:
        """A JSON string that is none of the ``declared`` property names (they follow their own schemas).

        A trie of the names: at each node the key may end (unless a name ends there), go on with a name's next
        character, or leave the trie with any other character (or an escape) and continue freely.
        """
        if not declared:
            return "json-string"
        trie: dict[str, Any] = {}
        for name in declared:
            node = trie
            for ch in name:
                node = node.setdefault(ch, {})
            node[""] = {}  # a name ends here

        def rule(node: dict[str, Any]) -> str:
            children = [ch for ch in node if ch]
            options = [] if "" in node else ['""']
            options += [f"{literal(ch)} {rule(node[ch])}" for ch in children]
            options.append(f'[^{"".join(class_char(ch) for ch in children)}"\\\\\\x00-\\x1f] json-char*')
            options.append('"\\\\" (["\\\\/bfnrt] | "u" hex hex hex hex) json-char*')
            return self._rule(" | ".join(options))

        return f'"\\"" {rule(trie)} "\\""'

    def _array(self, schema: Mapping[str, Any]) -> str:
        prefix_items = schema.get("prefixItems")
        prefix_items = prefix_items if isinstance(prefix_items, list) else []
        items = schema.get("items", not prefix_items)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        if high is not None and high < low:
            raise ValueError("maxItems is below minItems: no array fits")
        parts = [self.value(sub) for sub in prefix_items]
        if high is not None and high < len(parts):
            parts = parts[:high]
        rest_low = max(low - len(parts), 0)
        rest_high = None if high is None else high - len(parts)
        item = None if items is False else self.value(items)
        if item is None:
            if rest_low:
                raise ValueError("minItems needs more items than prefixItems allows")
            rest_high = 0
        if parts:  # prefix items in order, the first minItems of them required, then the further items
            inner = ""
            if rest_high != 0:
                inner = repeat(f'(ws "," ws {item})', rest_low, rest_high)
            required = min(low, len(parts))
            for i in reversed(range(len(parts))):
                piece = f"{parts[i]} {inner}".strip()
                if i:
                    piece = f'ws "," ws {piece}'
                inner = piece if i < required else f"({piece})?"
            return f'"[" ws {inner} ws "]"'
        if rest_high == 0:
            return '"[" ws "]"'
        more_high = None if rest_high is None else rest_high - 1
        following = f'(ws "," ws {item})'
        inner = f"{item} {repeat(following, max(rest_low - 1, 0), more_high)}"
        if rest_low == 0:
            inner = f"({inner})?"
        return f'"[" ws {inner} ws "]"'
