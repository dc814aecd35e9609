"""Real notebooks in real kernels on the GPU, with chaos mode on and off: every cell's
output must be identical."""

from pathlib import Path

import nbformat
import pytest

from ..kernel_runner import Kernel

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = [ROOT / "binder" / "example.ipynb", *sorted((ROOT / "tests" / "notebooks").glob("*.ipynb"))]


def outputs(path, tmp_path, chaos):
    k = Kernel(tmp_path, {"JUPYTER_VGPU_CHAOS": "1" if chaos else "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"})
    try:
        k.run("import torch; torch.use_deterministic_algorithms(True)")
        cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
        return [k.run(src) for src in cells if not src.startswith("%vgpu status")]
    finally:
        k.shutdown()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chaos_mode_changes_no_output(path, tmp_path):
    plain = outputs(path, tmp_path, chaos=False)
    chaos = outputs(path, tmp_path, chaos=True)
    for i, (a, b) in enumerate(zip(plain, chaos, strict=True)):
        if "Offloaded" in a or "Offloaded" in b:  # %vgpu offload reports differ by design
            continue
        assert a == b, f"cell {i} of {path.name}:\nplain: {a}\nchaos: {b}"
    assert "Error" not in "".join(chaos)
