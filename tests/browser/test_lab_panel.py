"""The vGPU panel and status-bar item in a real ``jupyter lab`` with a simulated slice:
the slice, usage following a cell live, and kernels paused and suspended (the stand-in:
states for real, no memory moves)."""

import json
import re
import sys

import pytest
from playwright.sync_api import expect

from jupyter_vgpu.slice import Card, Slice
from jupyter_vgpu.testing.server_process import JupyterServer

from .lab_page import (
    create_notebook,
    prepare_lab,
    run_cell,
    screenshot,
    show_panel,
    shut_down_sessions,
    use_theme,
    used_bytes,
    wait_for_kernel,
    wait_for_lab,
    watch_usage_requests,
)

GiB = 2**30
MiB = 2**20
SLICE = Slice(
    "GPU-sim-0",
    0,
    "NVIDIA H100 80GB HBM3",
    80 * GiB,
    8 * GiB,
    50,
    "binpack",
    1.5,
    simulated=True,
    memory_request=2 * GiB,
    priority=70,
)
#: A kernel that suspends after every cell (chaos mode ``suspend``), chosen per notebook.
SUSPENDING = {"name": "python3-suspend", "display_name": "Python 3 (suspends after every cell)"}


def suspending_kernelspec(share) -> None:
    """Write the :data:`SUSPENDING` kernel under ``share/kernels`` (a JUPYTER_PATH entry)."""
    spec = share / "kernels" / SUSPENDING["name"]
    spec.mkdir(parents=True)
    kernel = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": SUSPENDING["display_name"],
        "language": "python",
        "env": {"JUPYTER_VGPU_CHAOS": "suspend"},
    }
    (spec / "kernel.json").write_text(json.dumps(kernel))


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab")
    share = tmp_path_factory.mktemp("share")  # outside the server's root: not in the file browser
    suspending_kernelspec(share)
    server = JupyterServer(
        root,
        {
            "JUPYTER_VGPU_SLICE": SLICE.to_json(),
            "JUPYTERHUB_API_URL": "",
            "JUPYTER_PATH": str(share),  # the suspending kernel
        },
        app="jupyterlab",
        args=[
            f"--VGPUServer.channel_dir={root / 'channel'}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
    )
    yield server
    server.stop()


def _headers(lab):
    return {"Authorization": f"token {lab.token}"}


@pytest.mark.parametrize("theme", ["light", "dark"])
def test_panel_shows_the_slice_and_a_cell_changes_the_usage_live(lab, page, theme):
    prepare_lab(lab.url, theme, _headers(lab))
    notebook = f"usage-{theme}.ipynb"
    create_notebook(lab.url, _headers(lab), notebook)
    requests_made = watch_usage_requests(page)
    page.goto(f"{lab.url}/lab/tree/{notebook}?reset&token={lab.token}")
    wait_for_lab(page)
    wait_for_kernel(page)
    indicator = page.locator(".jp-vgpu-indicator")
    expect(indicator).to_have_text(re.compile(r"^vGPU \d+\.\d / 8\.0 GiB$"), timeout=60_000)

    show_panel(page)
    panel = page.locator("#jupyter-vgpu-panel")
    expect(panel.locator(".jp-vgpu-notice[data-state='simulated']")).to_have_text(
        "Simulated GPU: usage counts the kernels' tensors."
    )
    slice_rows = panel.locator(".jp-vgpu-slice")
    expect(slice_rows).to_contain_text("Memory limit8.0 GiB")
    expect(slice_rows).to_contain_text("Guaranteed2.0 GiB")
    expect(slice_rows).to_contain_text("Compute sharenot enforced (time-sliced)")
    expect(slice_rows).to_contain_text("Priority70")
    expect(slice_rows).to_contain_text("Isolationtime-slicing")
    expect(panel.locator(f"tbody:has-text('{notebook}')")).to_be_visible(timeout=60_000)
    before = used_bytes(page)

    run_cell(page, "import torch; x = torch.zeros(64 * 2**20)")
    # 64 Mi float32 values are 256 MiB; the panel and the status bar follow without a reload.
    expect(panel.locator(".jp-vgpu-used")).not_to_have_attribute("data-bytes", str(before), timeout=60_000)
    assert used_bytes(page) >= before + 256 * MiB
    row = panel.locator(f"tbody:has-text('{notebook}') .jp-vgpu-kernel-used")
    expect(row).to_have_text("256.0 MiB", timeout=60_000)
    expect(indicator).to_have_text(re.compile(r"^vGPU 0\.[2-9] / 8\.0 GiB$"), timeout=60_000)
    expect(panel.locator(".jp-vgpu-chart polyline")).to_have_count(3)
    expect(panel.locator(".jp-vgpu-footer")).to_have_text("Live")
    # the stream is read with fetch: no credential travels in its URL
    streams = [u for u in requests_made if "/api/vgpu/usage/stream" in u]
    assert streams
    assert not [u for u in streams if "token=" in u or "_xsrf=" in u], streams

    if theme == "light":
        screenshot(page, "status-bar", "#jp-main-statusbar")


def test_a_paused_and_a_suspended_kernel_show_their_state(lab, page):
    shut_down_sessions(lab.url, _headers(lab))  # the panel shows these two kernels alone
    prepare_lab(lab.url, "light", _headers(lab))
    create_notebook(lab.url, _headers(lab), "suspended.ipynb", kernelspec=SUSPENDING)
    create_notebook(lab.url, _headers(lab), "paused.ipynb")
    page.goto(f"{lab.url}/lab/tree/suspended.ipynb?reset&token={lab.token}")
    wait_for_lab(page)
    run_cell(page, "import torch; state = torch.ones(32 * 2**20)")
    # opening the other notebook with ?reset closes this one: nothing reconnects to its kernel
    page.goto(f"{lab.url}/lab/tree/paused.ipynb?reset&token={lab.token}")
    wait_for_lab(page)
    run_cell(page, "import torch\nweights = torch.zeros(64 * 2**20)\n%vgpu pause")

    show_panel(page)
    panel = page.locator("#jupyter-vgpu-panel")
    expect(panel.locator("tbody.jp-vgpu-kernel")).to_have_count(2, timeout=60_000)
    for notebook, state in (("paused.ipynb", "paused"), ("suspended.ipynb", "suspended")):
        details = panel.locator(f"tbody:has-text('{notebook}') .jp-vgpu-kernel-details")
        expect(details).to_have_attribute("data-state", state, timeout=60_000)
        expect(details).to_contain_text(state)
    expect(panel.locator("tbody:has-text('paused.ipynb') .jp-vgpu-kernel-used")).to_have_text("256.0 MiB")
    expect(panel.locator("tbody:has-text('suspended.ipynb') .jp-vgpu-kernel-used")).to_have_text("128.0 MiB")
    screenshot(page, "panel-light", "#jupyter-vgpu-panel")
    screenshot(page, "lab-light")
    use_theme(page, "dark")
    expect(panel.locator("tbody:has-text('suspended.ipynb') .jp-vgpu-kernel-details")).to_contain_text(
        "suspended"
    )
    screenshot(page, "panel-dark", "#jupyter-vgpu-panel")
    screenshot(page, "lab-dark")


def test_status_bar_item_opens_the_panel(lab, page):
    prepare_lab(lab.url, "light", _headers(lab))
    page.goto(f"{lab.url}/lab?reset&token={lab.token}")
    wait_for_lab(page)
    expect(page.locator("#jupyter-vgpu-panel")).to_be_hidden()
    page.locator(".jp-vgpu-indicator").click()
    expect(page.locator("#jupyter-vgpu-panel")).to_be_visible(timeout=30_000)


def test_a_slice_of_two_cards_shows_both_cards_and_its_budget_on_each(tmp_path, page):
    pair = SLICE.replace(more_gpus=(Card("GPU-sim-1", 1, 80 * GiB),))
    server = JupyterServer(
        tmp_path,
        {"JUPYTER_VGPU_SLICE": pair.to_json(), "JUPYTERHUB_API_URL": ""},
        app="jupyterlab",
        args=[
            f"--VGPUServer.channel_dir={tmp_path / 'channel'}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        ],
    )
    try:
        prepare_lab(server.url, "light", _headers(server))
        page.goto(f"{server.url}/lab?reset&token={server.token}")
        wait_for_lab(page)
        show_panel(page)
        slice_rows = page.locator("#jupyter-vgpu-panel .jp-vgpu-slice")
        expect(slice_rows).to_contain_text("GPUs0 + 1: NVIDIA H100 80GB HBM3 (simulated)")
        expect(slice_rows).to_contain_text("Memory limit8.0 GiB on each card")
        expect(slice_rows).to_contain_text("Guaranteed2.0 GiB on each card")
        screenshot(page, "panel-two-cards", "#jupyter-vgpu-panel", docs=False)
    finally:
        server.stop()
