"""Which user names a cell's code mentions: what to restore before it runs."""

from __future__ import annotations

import ast
import types
from collections.abc import Mapping


def cell_names(shell, raw_cell: str) -> set[str] | None:
    """Names read or written by ``raw_cell`` (after IPython's transforms: magics become
    calls), including the roots of attribute chains (``model`` in ``model.fc.weight``).

    Returns None when the cell does not parse: the caller should then restore
    everything, since it cannot know what the cell reaches.
    """
    try:
        source = shell.transform_cell(raw_cell) if shell is not None else raw_cell
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}


def expand_through_functions(names: set[str], user_ns: Mapping[str, object], depth: int = 3) -> set[str]:
    """``names`` plus the globals read by the notebook's own functions among them (and by
    the functions those name, ``depth`` levels down): a cell that calls ``train()``
    reaches whatever ``train`` reads."""
    result = set(names)
    frontier = set(names)
    for _ in range(depth):
        found: set[str] = set()
        for name in frontier:
            fn = user_ns.get(name)
            if isinstance(fn, types.FunctionType) and fn.__globals__ is user_ns:
                found |= _code_names(fn.__code__)
        frontier = found - result
        result |= found
        if not frontier:
            break
    return result


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names
