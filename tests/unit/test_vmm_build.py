"""The pausable allocator's library as the compiler checks it: every build (install, first
use, the tests) makes every warning an error."""

from __future__ import annotations

import shutil

import pytest

from jupyter_vgpu.kernel.pause import vmm

STRICT = ("-Wall", "-Wextra", "-Wmissing-prototypes", "-Werror")

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler")


def test_every_build_makes_every_warning_an_error():
    command = vmm.compile_command("cc", "out.so")
    assert all(flag in command for flag in STRICT), command
    assert "-O2" in command  # dlsym's sibling call to glibc's (see vmm.build)


@needs_cc
@pytest.mark.parametrize(
    ("flag", "source"),
    [
        ("missing-prototypes", "int helper(void) { return 1; }\n"),  # declared by hand elsewhere
        ("unused-parameter", "static int f(int unused) { return 0; }\nint (*keep)(int) = f;\n"),
        ("unused-variable", "void g(void);\nvoid g(void) { int idle; }\n"),
    ],
)
def test_a_warning_stops_the_build(tmp_path, flag, source):
    """What each flag is there for: a source with the warning does not build."""
    bad = tmp_path / "bad.c"
    bad.write_text(source)
    with pytest.raises(vmm.VMMUnavailable, match=flag):
        vmm.build(tmp_path / "bad.so", (bad,))
    assert not (tmp_path / "bad.so").exists()


@needs_cc
def test_the_library_builds_with_every_warning_an_error(tmp_path):
    assert vmm.build(tmp_path / vmm.LIBRARY_NAME).exists()
