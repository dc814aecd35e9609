"""Contracts: every JSON document that crosses a process boundary, defined once.

Each document has one JSON Schema (draft 2020-12) in this folder,
``<name>.schema.json``, with an ``$id`` of ``urn:jupyter-vgpu:<name>`` and a top-level
``version`` (the layout version that documents of that kind carry in their own
``version`` field). The receiving side checks what it receives with
:func:`validate`; the JupyterLab extension's TypeScript types are generated from the
same files (:mod:`jupyter_vgpu.contracts.typescript`). Adding a document is adding a
file here; nothing else needs registering.

Two departures from plain JSON Schema, both stricter, both for Python's JSON parser:

- ``integer`` is a JSON number written without a fraction or exponent (``1.0`` and
  ``1e3`` are not integers here, as they are not bytes);
- ``number`` is finite (Python's parser accepts ``NaN`` and ``Infinity``, which every
  range check would let through).

Pure Python: imports jsonschema (lazily, on first validation), never torch or
jupyterhub. Importing jsonschema costs about a second where ``rfc3987-syntax`` is
installed, so kernels do not validate with it (see :mod:`jupyter_vgpu.slice`); the
messages of the node arbiter's sockets (``to-arbiter``, ``from-arbiter``; ``to-pieces``,
``from-pieces``), checked by the arbiter and by every kernel, are checked against these
same schemas by :mod:`jupyter_vgpu.contracts.lean`, without jsonschema.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from typing import Any

__all__ = ["ContractError", "names", "schema", "validate", "version"]

URN = "urn:jupyter-vgpu:"
SUFFIX = ".schema.json"


class ContractError(ValueError):
    """A document does not follow its contract.

    The message names the document, the field (``usage.totals.used``) and what is
    wrong, in JSON's terms; values in it are shortened.

    Attributes:
        name: the contract's name.
        path: the offending field as a dotted path ("" for the document itself).
    """

    def __init__(self, name: str, path: str, problem: str):
        self.name = name
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}" if path else problem)


def names() -> list[str]:
    """The names of every contract (file names without ``.schema.json``), sorted."""
    return sorted(
        p.name[: -len(SUFFIX)] for p in resources.files(__package__).iterdir() if p.name.endswith(SUFFIX)
    )


@functools.cache
def schema(name: str) -> dict[str, Any]:
    """The JSON Schema of contract ``name``, as a dict (do not modify it).

    Raises:
        KeyError: no such contract.
    """
    path = resources.files(__package__) / f"{name}{SUFFIX}"
    if not path.is_file():
        raise KeyError(f"no contract named {name!r}; known: {', '.join(names())}")
    return json.loads(path.read_text(encoding="utf-8"))


def version(name: str) -> int:
    """The current layout version of contract ``name``.

    Raises:
        KeyError: no such contract.
    """
    return schema(name)["version"]


def validate(name: str, document: Any, *, field: str = "") -> None:
    """Check ``document`` against contract ``name``.

    Args:
        name: the contract (see :func:`names`).
        document: the decoded JSON.
        field: a prefix for the field paths in the message (``"usage"`` gives
            ``usage.totals.used``).

    Raises:
        ContractError: the document breaks the contract; the message names the field.
        KeyError: no such contract.
    """
    import jsonschema

    errors = sorted(_validator(name).iter_errors(document), key=jsonschema.exceptions.relevance)
    if errors:
        error = _deepest(errors[0])
        path = ".".join(
            [field, *(f"[{p}]" if isinstance(p, int) else str(p) for p in error.absolute_path)]
        ).strip(".")
        raise ContractError(name, path.replace(".[", "["), _explain(error))


def _deepest(error):
    """The most specific error under an ``anyOf``/``oneOf`` (the branch that got furthest)."""
    while error.context:
        error = max(error.context, key=lambda e: (len(e.absolute_path), -len(e.context or ())))
        if not error.context:
            break
    return error


def _short(value: Any, limit: int = 40) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number with a fraction" if math.isfinite(value) else "NaN or infinite"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


_TYPE_WORDS = {
    "integer": "an integer",
    "number": "a number",
    "string": "a string",
    "boolean": "true or false",
    "object": "an object",
    "array": "an array",
    "null": "null",
}


def _explain(error) -> str:
    """One sentence for a jsonschema error, without Python's reprs of huge values."""
    allowed = error.schema.get("properties", {}) if error.validator == "additionalProperties" else ()
    said = _problem(error.validator, error.validator_value, error.instance, allowed)
    if said is not None:
        return said
    return error.message if len(error.message) <= 200 else error.message[:199] + "…"


def _problem(keyword: str, expected: Any, got: Any, allowed: Any = ()) -> str | None:
    """What is wrong with ``got`` under schema keyword ``keyword`` (whose value is
    ``expected``), in one sentence with values shortened; ``allowed`` names the fields an
    ``additionalProperties: false`` object may have. None for a keyword without words of
    its own. Shared by :func:`validate` and :mod:`.lean`, so both say the same."""
    v = keyword
    if v == "type":
        wanted = " or ".join(_TYPE_WORDS[t] for t in (expected if isinstance(expected, list) else [expected]))
        shown = (
            f" ({_short(got)})" if isinstance(got, (int, float, str)) and not isinstance(got, bool) else ""
        )
        return f"must be {wanted}, not {_kind(got)}{shown}"
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        words = {
            "minimum": "at least",
            "maximum": "at most",
            "exclusiveMinimum": "more than",
            "exclusiveMaximum": "less than",
        }
        return f"must be {words[v]} {expected}; got {_short(got)}"
    if v == "enum":
        return f"must be one of {', '.join(json.dumps(e) for e in expected)}; got {_short(got)}"
    if v == "const":
        return f"must be {json.dumps(expected)}; got {_short(got)}"
    if v == "required":
        missing = [k for k in expected if isinstance(got, dict) and k not in got]
        return f"missing field(s): {', '.join(missing)}"
    if v == "additionalProperties":
        extra = sorted(k for k in got if k not in allowed) if isinstance(got, dict) else []
        return f"unknown field(s): {', '.join(_short(k) for k in extra)}"
    template = _SIZE_WORDS.get(v)
    return None if template is None else template.format(expected)


#: How :func:`_problem` says a size keyword's bound.
_SIZE_WORDS = {
    "maxLength": "must be at most {} characters long",
    "minLength": "must be at least {} character(s) long",
    "maxItems": "must have at most {} items",
}


@functools.cache
def _validator(name: str):
    import jsonschema
    from referencing import Registry, Resource
    from referencing.jsonschema import DRAFT202012

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine_many(
        {
            "integer": lambda _, v: isinstance(v, int) and not isinstance(v, bool),
            "number": lambda _, v: (
                not isinstance(v, bool)
                and (isinstance(v, int) or (isinstance(v, float) and math.isfinite(v)))
            ),
        }
    )
    cls = jsonschema.validators.extend(base, type_checker=checker)
    # Without "$schema", a schema reached through $ref keeps these strict types:
    # jsonschema picks the validator class of a resource that names its dialect.
    contents = {n: {k: v for k, v in schema(n).items() if k != "$schema"} for n in names()}
    registry = Registry().with_resources(
        (f"{URN}{n}", Resource(contents=c, specification=DRAFT202012)) for n, c in contents.items()
    )
    cls.check_schema(schema(name))
    return cls(contents[name], registry=registry)
