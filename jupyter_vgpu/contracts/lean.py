"""Contracts checked without jsonschema, for processes that check every message they read.

The node arbiter's socket carries a message per line both ways, checked where received
(the ``to-arbiter`` and ``from-arbiter`` contracts): by the arbiter, and by every kernel.
Importing jsonschema costs a second or more where ``rfc3987-syntax`` is installed (14 s
on a loaded two-core machine), which every kernel would pay as it starts and the arbiter
at every restart, before the first hello of the kernels that come back. This module
reads the same schema files and checks a document against them itself, for the part of
JSON Schema 2020-12 those contracts use: ``type`` (one or a list), ``const``, ``enum``,
``minimum``/``maximum``/``exclusiveMinimum``/``exclusiveMaximum``,
``minLength``/``maxLength``, ``required``, ``properties``, ``additionalProperties:
false``, ``items`` and ``maxItems``, ``allOf``, ``if``/``then``/``else`` and local ``$ref``; annotations
(``title``, ``description``...) are read past. A schema with any other keyword is
refused when it is first used (:class:`UnsupportedSchema`), so a contract can never be
checked less than it says in silence. Types are the contracts' own (``integer`` without
a fraction or exponent, ``number`` finite: see :mod:`jupyter_vgpu.contracts`), and the
errors are the same :class:`~jupyter_vgpu.contracts.ContractError` in the same words.

Where a document breaks several rules, the first found is named: the document's type,
then its value, then missing fields, unknown fields, each field in the schema's order,
an array's length, each item in turn, and the schema's conditions.
``tests/unit/test_arbiter_contracts.py`` holds it to jsonschema on every message of both
contracts and on their broken variants.

Pure Python; imports neither jsonschema, torch nor jupyterhub.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from . import ContractError, _problem, schema

__all__ = ["UnsupportedSchema", "validate", "validate_message"]

#: Keywords this module checks, or reads past (annotations).
KEYWORDS = frozenset(
    {
        "$schema", "$id", "$defs", "$ref", "version", "title", "description",
        "type", "const", "enum", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
        "minLength", "maxLength", "required", "properties", "additionalProperties",
        "items", "maxItems", "allOf", "if", "then", "else",
    }
)  # fmt: skip

_TYPES: dict[str, Callable[[Any], bool]] = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: (
        not isinstance(v, bool) and (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v)))
    ),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}
#: The classes of each type's values as the JSON parser makes them (a float still has to
#: be finite to be a number).
_EXACT = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "null": (type(None),),
    "object": (dict,),
    "array": (list,),
}
_BOUNDS: dict[str, Callable[[Any, Any], bool]] = {
    "minimum": lambda v, b: v >= b,
    "maximum": lambda v, b: v <= b,
    "exclusiveMinimum": lambda v, b: v > b,
    "exclusiveMaximum": lambda v, b: v < b,
}

#: A broken rule: the path to the value within the one checked (keys and indexes), and
#: what :func:`~jupyter_vgpu.contracts._problem` needs to say what is wrong with it (the
#: keyword, its value in the schema, the value found, the fields allowed), put into
#: words only for the rule reported (conditions break rules all the time).
Broken = tuple[tuple, str, Any, Any, Any]
#: A compiled schema: the first rule a value breaks, or None.
Check = Callable[[Any], "Broken | None"]


class UnsupportedSchema(ValueError):
    """A contract uses a keyword (or a form of one) this module does not check."""


def validate(name: str, document: Any, *, field: str = "") -> None:
    """Check ``document`` against contract ``name``, as :func:`jupyter_vgpu.contracts.validate`
    does, without jsonschema.

    Args:
        name: the contract (``to-arbiter``, ``from-arbiter``, or another that keeps to
            the keywords of :data:`KEYWORDS`).
        document: the decoded JSON.
        field: a prefix for the field path in the message.

    Raises:
        ContractError: the document breaks the contract; the message names the field.
        KeyError: no such contract.
        UnsupportedSchema: the contract uses a keyword this module does not check.
    """
    broken = _root(name)(document)
    if broken is not None:
        path, problem = broken[0], _problem(*broken[1:])
        dotted = ".".join([field, *(f"[{p}]" if isinstance(p, int) else str(p) for p in path)]).strip(".")
        raise ContractError(name, dotted.replace(".[", "["), problem)


def validate_message(name: str, message: Any) -> None:
    """Check one message of a protocol whose messages are told apart by their ``type``
    (``to-arbiter``, ``from-arbiter``): as :func:`validate`, with the message's type
    leading the field's path where the type is one the contract knows
    (``reply.released: must be at least 0; got -1``, ``room: unknown field(s): "budget"``).

    Raises:
        ContractError: the message breaks the contract.
        KeyError: no such contract.
        UnsupportedSchema: the contract uses a keyword this module does not check.
    """
    try:
        validate(name, message)
    except ContractError as e:
        kind = message.get("type") if isinstance(message, dict) else None
        if not isinstance(kind, str) or e.path == "type":
            raise
        raise ContractError(name, f"{kind}.{e.path}".rstrip("."), e.problem) from None


@functools.cache
def _root(name: str) -> Check:
    """Contract ``name``, compiled (once: a message is checked in tens of microseconds)."""
    root = schema(name)
    _refuse_unknown(root, name)
    return _Compiler(root).compile(root)


def _refuse_unknown(node: Any, where: str) -> None:
    if not isinstance(node, dict):
        raise UnsupportedSchema(f"{where}: a schema must be an object")
    unknown = set(node) - KEYWORDS
    if unknown:
        raise UnsupportedSchema(f"{where}: keyword(s) {', '.join(sorted(unknown))} are not checked here")
    if node.get("additionalProperties", False) is not False:
        raise UnsupportedSchema(f"{where}: additionalProperties must be false or left out")
    ref = node.get("$ref")
    if ref is not None and not ref.startswith("#/"):
        raise UnsupportedSchema(f"{where}: $ref {ref!r} is not within the schema")
    children = [
        *((f"{where}.$defs.{k}", v) for k, v in node.get("$defs", {}).items()),
        *((f"{where}.properties.{k}", v) for k, v in node.get("properties", {}).items()),
        *((f"{where}.allOf[{i}]", v) for i, v in enumerate(node.get("allOf", ()))),
        *((f"{where}.{k}", node[k]) for k in ("if", "then", "else", "items") if k in node),
    ]
    for child_where, child in children:
        _refuse_unknown(child, child_where)


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1`` is ``1.0``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _first(checks: list[Check]) -> Check:
    """One check of all ``checks``, in order: the first rule broken."""
    if len(checks) == 1:
        return checks[0]

    def check(v):
        for c in checks:
            broken = c(v)
            if broken is not None:
                return broken
        return None

    return check


class _Compiler:
    """Turns a schema into nested closures, each keyword read once, that find the first
    rule broken in the order the module's docstring gives (type, value, missing fields,
    unknown fields, each field, conditions)."""

    def __init__(self, root: dict[str, Any]):
        self.root = root
        self.refs: dict[str, Check] = {}

    def ref(self, ref: str) -> Check:
        if ref not in self.refs:
            done: list[Check] = []
            self.refs[ref] = lambda v: done[0](v)  # a reference to itself, while it is compiled
            node: Any = self.root
            for part in ref[2:].split("/"):
                node = node[part]
            done.append(self.compile(node))
            self.refs[ref] = done[0]
        return self.refs[ref]

    def compile(self, node: dict[str, Any]) -> Check:
        checks: list[Check] = []
        if "$ref" in node:
            checks.append(self.ref(node["$ref"]))
        if "type" in node:
            checks.append(self._type(node["type"]))
        if "const" in node:
            checks.append(self._one_of("const", node["const"], [node["const"]]))
        if "enum" in node:
            checks.append(self._one_of("enum", node["enum"], node["enum"]))
        bounds = [(k, node[k], holds) for k, holds in _BOUNDS.items() if k in node]
        if bounds:
            checks.append(self._bounds(bounds))
        if "maxLength" in node or "minLength" in node:
            checks.append(self._length(node.get("minLength", 0), node.get("maxLength")))
        if {"required", "properties", "additionalProperties"} & set(node):
            checks.append(self._object(node))
        if "items" in node or "maxItems" in node:
            checks.append(self._array(node))
        subs = node.get("allOf", ())
        chosen = self._by_field(subs) if subs else None
        checks += [chosen] if chosen is not None else [self.compile(sub) for sub in subs]
        if "if" in node:
            checks.append(self._if(node))
        return _first(checks) if checks else lambda v: None

    @staticmethod
    def _type(types: str | list[str]) -> Check:
        names = [types] if isinstance(types, str) else types
        holds = tuple(_TYPES[t] for t in names)
        exact = frozenset(cls for t in names for cls in _EXACT[t])  # the quick answer, mostly

        def check(v):
            cls = type(v)
            if cls in exact and (cls is not float or math.isfinite(v)):
                return None
            for h in holds:  # subclasses
                if h(v):
                    return None
            return (), "type", types, v, ()

        return check

    @staticmethod
    def _one_of(keyword: str, expected: Any, values: list) -> Check:
        if all(isinstance(e, str) for e in values):  # the common case, quickest
            strings = frozenset(values)

            def check(v):
                if isinstance(v, str) and v in strings:
                    return None
                return (), keyword, expected, v, ()

            return check

        def check_any(v):
            if any(_equal(v, e) for e in values):
                return None
            return (), keyword, expected, v, ()

        return check_any

    @staticmethod
    def _bounds(bounds: list) -> Check:
        number = _TYPES["number"]

        def check(v):
            cls = type(v)
            if cls is int or (cls is float and math.isfinite(v)) or (cls is not float and number(v)):
                for keyword, bound, holds in bounds:
                    if not holds(v, bound):
                        return (), keyword, bound, v, ()
            return None

        return check

    @staticmethod
    def _length(least: int, most: int | None) -> Check:
        def check(v):
            if isinstance(v, str):
                if most is not None and len(v) > most:
                    return (), "maxLength", most, v, ()
                if len(v) < least:
                    return (), "minLength", least, v, ()
            return None

        return check

    def _object(self, node: dict[str, Any]) -> Check:
        required = list(node.get("required", ()))
        fields = [(k, self.compile(sub)) for k, sub in node.get("properties", {}).items()]
        allowed = frozenset(k for k, _ in fields)
        closed = node.get("additionalProperties", True) is False

        def check(v):
            if not isinstance(v, dict):
                return None
            for k in required:
                if k not in v:
                    return (), "required", required, v, ()
            if closed:
                for k in v:
                    if k not in allowed:
                        return (), "additionalProperties", False, v, allowed
            for k, c in fields:
                if k in v:
                    broken = c(v[k])
                    if broken is not None:
                        return ((k, *broken[0]), *broken[1:])
            return None

        return check

    def _array(self, node: dict[str, Any]) -> Check:
        item = self.compile(node["items"]) if "items" in node else None
        most = node.get("maxItems")

        def check(v):
            if not isinstance(v, list):
                return None
            if most is not None and len(v) > most:
                return (), "maxItems", most, v, ()
            for i, x in enumerate(v if item is not None else ()):
                broken = item(x)
                if broken is not None:
                    return ((i, *broken[0]), *broken[1:])
            return None

        return check

    def _by_field(self, subs: list[dict[str, Any]]) -> Check | None:
        """``allOf`` of conditions on one field's string value (``{"if": {"required": [k],
        "properties": {k: {"const": ...}}}, "then": ...}``: a message's type), compiled to a
        look-up of the branches that apply instead of every condition tried in turn; None
        where ``subs`` are not of that form. Same answers: on an object, a branch applies
        exactly when the field holds one of its strings; on anything else every condition
        holds (``required`` and ``properties`` look at objects only)."""
        field, table, branches = None, {}, []
        for sub in subs:
            condition = sub.get("if", {})
            if set(sub) != {"if", "then"} or set(condition) != {"required", "properties"}:
                return None
            if len(condition["properties"]) != 1:
                return None
            ((key, rule),) = condition["properties"].items()
            values = rule.get("enum", [rule.get("const")]) if len(rule) == 1 else None
            if condition["required"] != [key] or field not in (None, key) or values is None:
                return None
            if not all(isinstance(value, str) for value in values):
                return None
            field = key
            branch = self.compile(sub["then"])
            branches.append(branch)
            for value in values:
                table.setdefault(value, []).append(branch)
        every = _first(branches)

        def check(v):
            if not isinstance(v, dict):
                return every(v)
            value = v.get(field)
            for branch in table.get(value, ()) if isinstance(value, str) else ():
                broken = branch(v)
                if broken is not None:
                    return broken
            return None

        return check

    def _if(self, node: dict[str, Any]) -> Check:
        condition = self.compile(node["if"])
        then = self.compile(node["then"]) if "then" in node else None
        otherwise = self.compile(node["else"]) if "else" in node else None

        def check(v):
            branch = then if condition(v) is None else otherwise
            return branch(v) if branch is not None else None

        return check
