"""Which user names a cell's code mentions: what to restore before it runs."""

from __future__ import annotations

import ast


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
