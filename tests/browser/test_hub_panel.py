"""The user's path through a real Hub: log in, JupyterLab opens, the vGPU panel follows a
cell's allocation; the admin sees the users' slices on the Hub's vGPU page."""

import re

import pytest
from playwright.sync_api import expect

from jupyter_vgpu.testing.hub_process import PASSWORD, HubProcess

from .lab_page import (
    create_notebook,
    prepare_lab,
    run_cell,
    screenshot,
    show_panel,
    used_bytes,
    wait_for_kernel,
    watch_usage_requests,
)

MiB = 2**20


@pytest.fixture(scope="module")
def hub():
    process = HubProcess("browser-hub")
    try:
        process.start()
        yield process
    finally:
        process.shutdown()


def login(page, hub, username):
    """Log in through the Hub's login form."""
    page.goto(f"{hub.url}/hub/login")
    page.locator("input[name=username]").fill(username)
    page.locator("input[name=password]").fill(PASSWORD)
    page.locator("form [type=submit]").first.click()
    page.wait_for_url(re.compile(r".*/(hub/(home|spawn.*)|user/.*)$|.*/lab.*"), timeout=120_000)


def test_user_logs_in_and_sees_the_panel_follow_a_cell(hub, page):
    headers = {"Authorization": f"token {hub.user_token('ada')}"}
    server = hub.spawn("ada")
    prepare_lab(server, "light", headers)
    create_notebook(server, headers, "hub.ipynb")

    login(page, hub, "ada")
    requests_made = watch_usage_requests(page)
    page.goto(f"{server}lab/tree/hub.ipynb?reset")
    wait_for_kernel(page)
    indicator = page.locator(".jp-vgpu-indicator")
    expect(indicator).to_have_text(re.compile(r"^vGPU \d+\.\d / 8\.0 GiB$"), timeout=60_000)
    show_panel(page)
    panel = page.locator("#jupyter-vgpu-panel")
    expect(panel.locator(".jp-vgpu-slice")).to_contain_text("8.0 GiB")
    expect(panel.locator("tbody:has-text('hub.ipynb')")).to_be_visible(timeout=60_000)
    before = used_bytes(page)

    run_cell(page, "import torch; x = torch.zeros(64 * 2**20)")
    expect(panel.locator("tbody:has-text('hub.ipynb') .jp-vgpu-kernel-used")).to_have_text(
        "256.0 MiB", timeout=60_000
    )
    assert used_bytes(page) >= before + 256 * MiB
    expect(indicator).not_to_have_text("vGPU 0.0 / 8.0 GiB")
    expect(panel.locator(".jp-vgpu-footer")).to_have_text("Live")
    expect(panel.locator(".jp-vgpu-slice")).to_contain_text("Compute sharenot enforced (time-sliced)")
    # where the kernel's memory is, and the node's host memory and disk tier, from the arbiter
    expect(panel.locator("tbody:has-text('hub.ipynb') .jp-vgpu-kernel-details")).to_contain_text(
        re.compile(r"(idle|active) \(tier: gpu\)"), timeout=60_000
    )
    expect(panel.locator(".jp-vgpu-slice")).to_contain_text("Node host memory")
    expect(panel.locator(".jp-vgpu-slice")).to_contain_text("Node disk tier")
    # through the Hub the stream authenticates with the session cookie and its XSRF
    # header, and nothing in the URL
    streams = [u for u in requests_made if "/api/vgpu/usage/stream" in u]
    assert streams
    assert not [u for u in streams if "token=" in u or "_xsrf=" in u], streams
    screenshot(page, "hub-lab")


def test_admin_page_lists_both_users(hub, page):
    for user in ("ada", "bob"):
        hub.login(user)
        hub.spawn(user)
    login(page, hub, "admin")
    page.goto(f"{hub.url}/hub/vgpu")
    for user in ("ada", "bob"):
        expect(page.get_by_text(user, exact=True).first).to_be_visible(timeout=60_000)
    expect(page.locator("tr.vgpu-slice[data-user='ada'] .vgpu-compute")).to_have_text(
        "not enforced (time-sliced)"
    )
    expect(page.locator("tr.vgpu-slice[data-user='ada'] .vgpu-request")).to_have_text("8.00 GiB")
    # the node arbiter's kernels, each in its tier, and the node's host memory and disk tier
    expect(page.locator(".vgpu-node-tiers")).to_contain_text("Host memory held by kernels (paused data")
    expect(page.locator("tr.vgpu-kernel[data-tier='gpu']").first).to_be_visible()
    # each kernel process's host memory (its PSS: libraries shared, divided among their
    # sharers; before the arbiter's first look, its RSS), and what of it that process alone holds
    expect(page.locator("tr.vgpu-kernel .vgpu-process-bytes").first).to_have_text(
        re.compile(r"\d[\d.]* [MG]iB \(\d[\d.]* [MG]iB own\)")
    )
    screenshot(page, "hub-admin")
