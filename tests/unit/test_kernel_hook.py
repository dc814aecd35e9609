"""The kernel hook in real IPython kernels: slice, status, live changes, reports."""

import json
import re

import pytest

from jupyter_vgpu import channel
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.simulated_slice import simulated_slice
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
SLICE = simulated_slice(gpu_index=1, compute_share=40)


@pytest.fixture
def channel_dir(tmp_path):
    d = tmp_path / "channel"
    d.mkdir()
    channel.write_json(channel.server_path(d), {"slice": SLICE.to_dict(), "pressure": False})
    return d


@pytest.fixture
def kernel(tmp_path, channel_dir):
    k = Kernel(tmp_path, {"JUPYTER_VGPU_CHANNEL": str(channel_dir), "JUPYTER_VGPU_SLICE": ""})
    yield k
    k.shutdown()


def test_status_shows_the_slice_without_any_user_action(kernel):
    out = kernel.run("%vgpu status")
    assert "8.00 GiB" in out
    assert "not enforced (time-sliced)" in out  # a 40% share promises nothing under time-slicing
    assert "simulated" in out
    assert "index 1" in out
    assert "not imported yet" in out


def test_budget_applies_when_torch_is_imported(kernel):
    out = kernel.run("import torch\nprint(get_ipython()._jupyter_vgpu_hook.budget.torch is torch)\n%vgpu")
    assert "True" in out
    assert "CUDA is not available" in out


def test_live_change_reaches_the_running_kernel(kernel, channel_dir):
    assert "8.00 GiB" in kernel.run("%vgpu status")
    channel.write_json(
        channel.server_path(channel_dir),
        {
            "slice": SLICE.replace(memory_limit=2 * GiB, compute_share=10, isolation="mps").to_dict(),
            "pressure": False,
        },
    )

    def new_budget_shown():
        out = kernel.run("%vgpu status")
        return out if "2.00 GiB" in out else None

    out = wait_for(new_budget_shown, 30, "the new budget in %vgpu status")
    assert "10% under MPS, not enforced" in out


def test_report_counts_tensors_on_a_simulated_gpu(kernel, channel_dir):
    kernel.run("import torch\nx = torch.zeros(64 * 2**20)\ny = x[:10]")
    path = channel.kernel_path(channel_dir, kernel.id)
    report = wait_for(lambda: channel.read_json(path), 30, "the kernel's report")
    assert report["kernel_id"] == kernel.id
    fields = {"pid", "updated", "torch_imported", "cuda_available", "torch_allocated"}
    fields |= {"torch_reserved", "budget", "simulated_used", "busy", "pause"}
    assert fields <= set(report)
    assert report["cuda_available"] is False
    assert report["pause"]["stand_in"] is True
    assert report["torch_reserved"] == 0
    assert report["budget"] == 8 * GiB
    assert report["torch_imported"] is True
    assert report["simulated"] is True
    assert report["simulated_used"] == 256 * 2**20  # x and its view share one storage
    assert "used (tensors)  256.00 MiB" in kernel.run("%vgpu")


def test_bad_arguments_get_a_usage_line_and_loading_twice_is_harmless(kernel):
    out = kernel.run("%vgpu bogus")
    assert "UsageError" in out
    assert "invalid choice" in out
    out = kernel.run("%load_ext jupyter_vgpu\n%vgpu status")
    assert out.count("jupyter-vgpu slice status") == 1
    assert (
        kernel.run(
            "print(len([f for f in get_ipython().events.callbacks['post_run_cell'] if 'vgpu' in repr(f)]))"
        ).strip()
        == "1"
    )
    handler = "h = get_ipython().kernel.shell_handlers['execute_request']\n"
    wrapped = kernel.run(handler + "print(h.__name__, h._jupyter_vgpu_original.__name__)")
    assert wrapped.split() == ["wrapper", "execute_request"]


def test_help_and_the_question_mark_print_the_magics_usage(kernel):
    """Issue 43: `%vgpu?` went to a pager, which a kernel turns into a page payload that
    a notebook run outside JupyterLab (nbclient, a REST client) never shows."""
    from jupyter_vgpu.kernel.magics import usage

    text = usage()
    assert text.startswith("  %vgpu [status|pause|resume|help]")
    for action in ("status", "pause", "resume", "help"):
        assert re.search(rf"^  {action} ", text, re.M), action
    assert kernel.run("%vgpu help") == text + "\n"
    assert kernel.run("%vgpu?") == text + "\n"
    # any other `?` still goes to the pager, as a page payload of the reply
    msg_id = kernel.client.execute("len?")
    reply = kernel.client.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    pages = [p for p in reply["content"]["payload"] if p["source"] == "page"]
    assert pages
    assert "Return the number of items" in pages[0]["data"]["text/plain"]


def test_no_slice_outside_a_hub(tmp_path):
    k = Kernel(tmp_path, {"JUPYTER_VGPU_CHANNEL": "", "JUPYTER_VGPU_SLICE": ""})
    try:
        out = k.run("%vgpu")
        assert "no vGPU slice" in out
    finally:
        k.shutdown()


def test_slice_from_the_environment_and_malformed_slice(tmp_path):
    k = Kernel(tmp_path, {"JUPYTER_VGPU_CHANNEL": "", "JUPYTER_VGPU_SLICE": SLICE.to_json()})
    try:
        out = k.run("%vgpu\nimport os; print(os.environ['CUPY_GPU_MEMORY_LIMIT'])")
        assert "8.00 GiB" in out
        assert str(8 * GiB) in out
    finally:
        k.shutdown()
    k = Kernel(tmp_path, {"JUPYTER_VGPU_CHANNEL": "", "JUPYTER_VGPU_SLICE": json.dumps({"gpu_uuid": 1})})
    try:
        out = k.run("%vgpu")
        assert re.search(r"malformed", out)
        assert "no vGPU slice" in out
    finally:
        k.shutdown()


def test_unload_removes_the_hook_and_the_oom_handler(kernel):
    out = kernel.run(
        "import torch\nip = get_ipython()\nprint(ip.custom_exceptions == (torch.OutOfMemoryError,))\n"
        "%unload_ext jupyter_vgpu\nprint(ip.custom_exceptions, ip._jupyter_vgpu_hook)"
    )
    assert out.split() == ["True", "()", "None"]
