"""The README cannot drift from the code: its `%vgpu status` sample is what a real
kernel prints (issue 43: the GPU name, the `pausable` and `tier` lines had changed since
it was copied by hand), but for the one figure that depends on the machine (the kernel
process's own memory); and it says how long its test command takes."""

import re

from jupyter_vgpu.testing import readme_status


def test_the_readme_status_sample_is_what_a_kernel_prints(tmp_path):
    printed = readme_status.CELL.splitlines()[-1] + "\n" + readme_status.render(tmp_path)
    shown = readme_status.in_readme()
    assert readme_status.steady(shown) == readme_status.steady(printed), (
        "the README's %vgpu status sample is not what the code prints; refresh it with "
        f"python -m jupyter_vgpu.testing.readme_status\n--- README:\n{shown}\n--- printed:\n{printed}"
    )


def test_the_readme_says_how_long_the_tests_take():
    readme = readme_status.README.read_text(encoding="utf-8")
    top = readme.split("## ", 1)[0]  # before the first section: where a new user looks
    assert re.search(r"bash scripts/test\b.*\babout \d+ minutes\b", top, re.S), top
