"""Every test module can be collected without the optional extras: one that needs an extra
skips and says which, instead of stopping the whole run with a collection error.

The extras' modules are hidden in a second pytest (``tests/without_extras.py``), which
only collects: a module that imports one of them without ``pytest.importorskip`` fails it.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Top-level modules of the optional extras (pyproject.toml), and their extra.
EXTRAS = {
    "torch": "torch",
    "kubespawner": "kubernetes",
    "kubernetes_asyncio": "kubernetes",
    "cuda": "gpu",  # cuda-bindings
    "nvidia": "gpu",  # nvCOMP, NVRTC
}
COLLECT = ["--collect-only", "-q", "-rs", "tests"]


def test_every_module_is_collected_without_the_optional_extras():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.without_extras", "-p", "no:cacheprovider", *COLLECT],
        cwd=ROOT,
        env={**os.environ, "JUPYTER_VGPU_HIDE_MODULES": ",".join(EXTRAS)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert " error" not in out.splitlines()[-1], out[-6000:]
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for module, reason in [
        ("test_kube_spawner.py", "needs the kubernetes extra"),
        ("test_kube_manifests.py", "needs the kubernetes extra"),
        ("test_tensors.py", "needs PyTorch"),
    ]:
        assert any(module in line and reason in line for line in skipped), (module, skipped)
