"""The pausable allocator's library as the compiler checks it, and its errors as a thread
reads them: every build (install, first use, the tests) makes every warning an error, and
each thread reads its own last error."""

from __future__ import annotations

import shutil
import threading

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


@pytest.fixture(scope="module")
def allocator():
    lib = vmm.load()
    if lib.backend == 0:
        lib.init(vmm.HOST)
    if lib.backend != vmm.HOST:
        pytest.skip("this process chose the CUDA backend")
    return lib


def test_two_threads_read_their_own_last_errors(allocator):
    """Two threads fail at once, differently; each then reads its own error, not the one
    the other made last, and a third thread's stays as it was."""
    ptr = allocator.malloc(2 << 20)
    mine = (allocator.last_error, allocator.last_message)
    both_failed = threading.Barrier(2, timeout=10)
    seen: dict[str, tuple] = {}

    def fail(name, call):
        try:
            call()
        except vmm.VMMError as e:
            raised = (e.code, e.name, e.detail)
        both_failed.wait()
        seen[name] = (*raised, allocator.last_error, allocator.last_message)

    threads = [
        threading.Thread(target=fail, args=("unknown", lambda: allocator.unmap(0x1000))),
        threading.Thread(target=fail, args=("mapped", lambda: allocator.map(ptr))),
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        allocator.free(ptr)
    unknown, mapped = "releasing the unit at 0x1000", f"mapping the unit at {ptr:#x}: mapped already"
    assert seen["unknown"] == (901, "VGPU_ERROR_UNKNOWN_POINTER", unknown, 901, unknown)
    assert seen["mapped"] == (902, "VGPU_ERROR_BAD_STATE", mapped, 902, mapped)
    assert (allocator.last_error, allocator.last_message) == mine
