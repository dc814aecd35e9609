"""A pytest plugin that makes modules look uninstalled, for the check that every test
module can be collected without the optional extras (``tests/unit/test_collection.py``).

    JUPYTER_VGPU_HIDE_MODULES=torch,kubespawner python -m pytest -p tests.without_extras --collect-only

Importing a hidden module (or anything below it) raises ``ModuleNotFoundError``, as where
its extra is not installed, so ``pytest.importorskip`` skips and a plain import fails.
"""

from __future__ import annotations

import os
import sys

import pytest

HIDDEN = frozenset(filter(None, os.environ.get("JUPYTER_VGPU_HIDE_MODULES", "").split(",")))


class _Hidden:
    """A finder, first on ``sys.meta_path``, that finds no hidden module."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by tests.without_extras)", name=name)
        return None


imported = sorted(m for m in HIDDEN if m in sys.modules)
if imported:
    raise pytest.UsageError(f"already imported, cannot be hidden: {', '.join(imported)}")
sys.meta_path.insert(0, _Hidden())
