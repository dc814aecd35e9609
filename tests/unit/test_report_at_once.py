"""The plugin scripts/gpu-tests uses: a failure's report is printed before the next test runs."""

import subprocess
import sys


def test_a_failures_report_comes_before_the_next_test_runs(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "def test_a():\n    assert 1 + 1 == 3, 'the reason a failed'\n\n"
        "def test_b():\n    print('b runs')\n    assert True\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "jupyter_vgpu.testing.report_at_once", "-v", "-s",
         "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 1, out
    assert "the reason a failed" in out, out
    assert out.index("the reason a failed") < out.index("b runs"), out
