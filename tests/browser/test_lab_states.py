"""The panel's other states in a real ``jupyter lab``: no slice, a silent server, a budget
nearly full, code between cells, and a paused kernel brought back by its user's click."""

import os
import re
import signal
import time

import pytest
from playwright.sync_api import expect

from jupyter_vgpu import channel
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.server_process import JupyterServer

from .lab_page import (
    create_notebook,
    prepare_lab,
    run_cell,
    screenshot,
    show_panel,
    wait_for_kernel,
    wait_for_lab,
)

MiB = 2**20
GiB = 2**30
# 256 MiB of tensors is 91% of this budget: above the 90% warning threshold.
SMALL = Slice("GPU-sim-0", 0, "NVIDIA H100 80GB HBM3", 80 * GiB, 280 * MiB, 25, simulated=True)


def _lab(root, slice_json):
    env = {"JUPYTERHUB_API_URL": ""}
    if slice_json is not None:
        env["JUPYTER_VGPU_SLICE"] = slice_json
    return JupyterServer(root, env, app="jupyterlab", args=[f"--VGPUServer.channel_dir={root / 'channel'}"])


@pytest.fixture
def lab_without_slice(tmp_path, monkeypatch):
    monkeypatch.delenv("JUPYTER_VGPU_SLICE", raising=False)
    server = _lab(tmp_path, None)
    yield server
    server.stop()


@pytest.fixture
def lab_small_budget(tmp_path):
    server = _lab(tmp_path, SMALL.to_json())
    yield server
    server.stop()


def open_lab(lab, page, path: str = "lab") -> None:
    """``lab``'s page ``path`` (``lab``, or ``lab/tree/<notebook>``) open in a freshly
    reset light lab."""
    prepare_lab(lab.url, "light", {"Authorization": f"token {lab.token}"})
    page.goto(f"{lab.url}/{path}?reset&token={lab.token}")
    wait_for_lab(page)


def open_new_notebook(lab, page, name: str) -> None:
    """A new notebook ``name`` open in a freshly reset light lab, its kernel idle."""
    create_notebook(lab.url, {"Authorization": f"token {lab.token}"}, name)
    open_lab(lab, page, f"lab/tree/{name}")
    wait_for_kernel(page)


def _prefetch_trail(lab, requests_seen: list[str], answers: list[int]) -> str:
    """Where a prefetch stopped, for a failure's message: the page's requests and their
    answers, what the server wrote to its kernels (``server.json``), each kernel's last
    report (its state, and how old it is: a report that stopped coming names a kernel
    whose channel thread stalled), and the end of the server's log."""
    directory = lab.root / "channel"
    lines = [f"prefetch requests from the page: {requests_seen}, answers: {answers}"]
    lines.append(f"server.json: {channel.read_json(channel.server_path(directory))}")
    for path in sorted(directory.glob("kernel-*.json")):
        report = channel.read_json(path) or {}
        age = time.time() - report.get("updated", 0.0)
        lines.append(
            f"{path.name}: state {report.get('state')!r}, written {age:.1f} s ago, "
            f"last prefetch {report.get('last_prefetch')!r}"
        )
    lines.append(f"server log (end):\n{lab.log_path.read_text()[-3000:]}")
    return "\n".join(lines)


def test_without_a_slice_the_panel_says_so(lab_without_slice, page):
    open_lab(lab_without_slice, page)
    expect(page.locator(".jp-vgpu-indicator")).to_have_text("vGPU: no slice", timeout=60_000)
    show_panel(page)
    expect(page.locator("#jupyter-vgpu-panel .jp-vgpu-notice[data-state='no-slice']")).to_be_visible()
    expect(page.locator("#jupyter-vgpu-panel .jp-vgpu-meter")).to_have_count(0)


def test_a_server_that_goes_silent_is_shown_disconnected_never_live(lab_small_budget, page):
    """A usage stream that stops without closing (here the server is stopped with SIGSTOP,
    its connections left open, as a hung event loop or a proxy holding the connection
    would) is taken for failed: the footer leaves "Live" for "Disconnected", with the time
    of the figures still shown, while the server says nothing; once it answers a poll
    again, the panel goes back to its stream."""
    lab = lab_small_budget
    open_lab(lab, page)
    show_panel(page)
    footer = page.locator("#jupyter-vgpu-panel .jp-vgpu-footer")
    expect(footer).to_have_class(re.compile(r"\bjp-vgpu-connection-stream\b"), timeout=60_000)
    os.kill(lab.proc.pid, signal.SIGSTOP)
    try:
        # silent 10 s: the stream is dropped; a poll waits 10 s more, then "Disconnected"
        expect(footer).to_have_class(re.compile(r"\bjp-vgpu-connection-error\b"), timeout=60_000)
        expect(footer).to_have_text(re.compile(r"^Disconnected: the figures above are from \S"))
        screenshot(page, "panel-disconnected", "#jupyter-vgpu-panel", docs=False)
    finally:
        os.kill(lab.proc.pid, signal.SIGCONT)
    expect(footer).to_have_class(re.compile(r"\bjp-vgpu-connection-stream\b"), timeout=60_000)
    expect(footer).to_have_text("Live")


def test_above_90_percent_of_the_budget_the_status_bar_warns(lab_small_budget, page):
    lab = lab_small_budget
    open_new_notebook(lab, page, "full.ipynb")
    indicator = page.locator(".jp-vgpu-indicator")
    expect(indicator).to_have_text(re.compile(r"^vGPU \d+\.\d / 280\.0 MiB$"), timeout=60_000)
    expect(indicator).not_to_have_class(re.compile(r"jp-mod-warn"))

    run_cell(page, "import torch; x = torch.zeros(64 * 2**20)")
    expect(indicator).to_have_class(re.compile(r"jp-mod-warn"), timeout=60_000)
    expect(indicator).to_have_text("vGPU 256.0 / 280.0 MiB")
    show_panel(page)
    expect(page.locator("#jupyter-vgpu-panel .jp-vgpu-meter")).to_have_class(re.compile(r"jp-mod-warn"))
    screenshot(page, "status-bar-warning", "#jp-main-statusbar")
    screenshot(page, "panel-warning", "#jupyter-vgpu-panel")


def test_code_that_runs_between_cells_is_named_in_the_panel(lab_small_budget, page):
    """A thread that may use the GPU while the kernel is idle keeps no kernel on the card
    (its GPU calls bring the kernel back): the panel's kernel row names it, says so, and
    does not call the kernel unpausable; the note goes once the thread ends."""
    lab = lab_small_budget
    open_new_notebook(lab, page, "threads.ipynb")
    show_panel(page)
    note = page.locator("#jupyter-vgpu-panel .jp-vgpu-kernel-note[data-between-cells]")
    expect(note).to_have_count(0)
    run_cell(
        page,
        "import threading\nstop = threading.Event()\n"
        "t = threading.Thread(target=stop.wait, name='watcher'); t.start()",
    )
    expect(note).to_contain_text("Runs between cells: thread 'watcher'", timeout=60_000)
    expect(note).to_contain_text("its GPU calls bring this kernel back")
    expect(page.locator("#jupyter-vgpu-panel .jp-vgpu-kernel-note[data-pausable]")).to_have_count(0)
    screenshot(page, "panel-between-cells", "#jupyter-vgpu-panel")
    editor = page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content").first
    editor.click()
    page.keyboard.press("Control+a")
    page.keyboard.press("Delete")
    run_cell(page, "stop.set(); t.join()")
    expect(note).to_have_count(0, timeout=60_000)


def test_a_paused_kernel_comes_back_as_its_user_clicks_into_its_notebook(lab_small_budget, page):
    """Resume before the cell runs: a click into a paused kernel's notebook tells the
    server, which tells the kernel; the panel shows it back, no cell having run."""
    lab = lab_small_budget
    open_new_notebook(lab, page, "prefetch.ipynb")
    requests_seen, answers = [], []
    # the server's prefetch endpoint only (the notebook's own name holds "prefetch" too)
    endpoint = re.compile(r"/api/vgpu/kernels/[^/]+/prefetch$")
    page.on("request", lambda r: endpoint.search(r.url.split("?")[0]) and requests_seen.append(r.method))
    page.on("response", lambda r: endpoint.search(r.url.split("?")[0]) and answers.append(r.status))
    run_cell(page, "import torch\nweights = torch.zeros(16 * 2**20)\n%vgpu pause")
    show_panel(page)
    details = page.locator("#jupyter-vgpu-panel tbody:has-text('prefetch.ipynb') .jp-vgpu-kernel-details")
    expect(details).to_have_attribute("data-state", "paused", timeout=60_000)
    prompts = page.locator(".jp-NotebookPanel:visible .jp-InputArea-prompt")
    before = prompts.all_inner_texts()

    page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content").first.click()
    try:
        expect(details).to_have_attribute("data-state", "idle", timeout=30_000)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{_prefetch_trail(lab, requests_seen, answers)}") from None
    assert requests_seen == ["POST"], requests_seen  # one request, however many events
    assert prompts.all_inner_texts() == before  # nothing ran
