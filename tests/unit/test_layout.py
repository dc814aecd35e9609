"""The floors of the tree, read from the code: every import of every module, the ones
inside functions included, against the rules of docs/design.md's layout.

- ``jupyter_vgpu.host`` (the host's utilities: cgroups, socket paths, processes, the
  driver's checkpoint, meminfo, the arbiter's control client) is below everything: it
  imports none of the package's other floors.
- The Hub (``hub_spawner``) never imports torch, the node arbiter or the kernel side.
- The kernel side (``jupyter_vgpu.kernel``) never imports jupyterhub, the Hub or the
  node arbiter; the server extension neither.
- The node arbiter (``jupyter_vgpu.node``) imports neither the Hub, nor the kernel, nor
  the server extension.
- Only ``jupyter_vgpu.nvml`` touches pynvml.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports."""
    return _imports_of(path.read_text(encoding="utf-8"), _module(path), path.name == "__init__.py")


def _imports_of(source: str, module: str, is_package: bool) -> set[str]:
    """Every module ``source`` (the text of ``module``) imports, at any depth, absolute:
    its relative imports resolved, and ``from a import b`` counted as ``a`` and ``a.b``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            found.add(stem)
            found.update(f"{stem}.{alias.name}" for alias in node.names)
    return found


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _offending(packages: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in _sources(*packages):
        for name in sorted(_imports(path)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


RULES = {
    "host is below everything": (
        ("jupyter_vgpu/host",),
        (
            "jupyter_vgpu.node",
            "jupyter_vgpu.kernel",
            "jupyter_vgpu.server",
            "hub_spawner",
            "torch",
            "jupyterhub",
        ),
    ),
    "the Hub never imports torch, the arbiter or the kernel side": (
        ("hub_spawner",),
        ("torch", "jupyter_vgpu.node", "jupyter_vgpu.kernel"),
    ),
    "the kernel side never imports jupyterhub, the Hub or the arbiter": (
        ("jupyter_vgpu/kernel", "jupyter_vgpu/server"),
        ("jupyterhub", "hub_spawner", "jupyter_vgpu.node"),
    ),
    "the arbiter imports neither the Hub nor the kernel side": (
        ("jupyter_vgpu/node",),
        ("hub_spawner", "jupyterhub", "jupyter_vgpu.kernel", "jupyter_vgpu.server", "torch"),
    ),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_each_floor_imports_only_what_is_below_it(rule):
    packages, forbidden = RULES[rule]
    assert _sources(*packages), f"no sources under {packages}"
    found = _offending(packages, forbidden)
    assert not found, f"{rule}:\n" + "\n".join(found)


def test_only_the_nvml_module_touches_pynvml():
    found = [
        f"{p.relative_to(ROOT)} imports pynvml"
        for p in _sources("jupyter_vgpu", "hub_spawner", "benchmarks")
        if p.relative_to(ROOT).as_posix() != "jupyter_vgpu/nvml.py"
        and any(n == "pynvml" or n.startswith("pynvml.") for n in _imports(p))
    ]
    assert not found, "\n".join(found)


def test_the_reader_sees_imports_inside_functions_and_relative_ones():
    """The rules above can fail: an import hidden in a function, and a relative one, are
    both found, and both break a rule."""
    source = "def f():\n    import jupyterhub.app\n    from ..node import arbiter\n"
    found = _imports_of(source, "jupyter_vgpu.kernel.probe", is_package=False)
    assert {"jupyterhub.app", "jupyter_vgpu.node", "jupyter_vgpu.node.arbiter"} <= found
