"""Chaos mode in real kernels on the CPU stand-in (CI): every notebook cell's output is
the same with everything offloaded after every cell as without. The GPU tests repeat
this on CUDA tensors."""

import pytest

from ..gpu.test_offload_notebooks import NOTEBOOKS, outputs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_chaos_mode_changes_no_output_on_cpu(path, tmp_path):
    plain = outputs(path, tmp_path, chaos=False)
    chaos = outputs(path, tmp_path, chaos=True)
    compared = 0
    for i, (a, b) in enumerate(zip(plain, chaos, strict=True)):
        if "%vgpu" in a or "Offloaded" in b or "Nothing to do" in a:  # offload reports differ by design
            continue
        assert a == b, f"cell {i} of {path.name}:\nplain: {a}\nchaos: {b}"
        compared += 1
    assert compared >= 3
    assert "Error" not in "".join(chaos)
