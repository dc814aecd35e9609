"""Driving JupyterLab in Chromium: the vGPU panel, the status bar, notebook cells.

Every wait is a functional deadline (Playwright's ``wait_for`` / ``expect`` with a
timeout), never a sleep.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import requests
from playwright.sync_api import Page, expect
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from .. import screenshots

ROOT = Path(__file__).resolve().parents[2]
# Screenshots go to test-artifacts/ (git-ignored); JUPYTER_VGPU_UPDATE_SCREENSHOTS=1
# writes the documentation's to docs/screenshots/ instead (tests/screenshots.py).
ARTIFACTS = ROOT / "test-artifacts" / "screenshots"
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": ""}],
    "metadata": {
        "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}


def prepare_lab(server_url: str, theme: str, headers=None, cookies=None) -> None:
    """Choose the Lab theme (``light`` or ``dark``) and turn off the news prompt, through
    the settings REST API of the server at ``server_url`` (token ``headers`` or ``cookies``
    with their XSRF header).

    Raises:
        AssertionError: the server refused a setting.
    """
    settings = {
        "@jupyterlab/apputils-extension:themes": {"theme": THEMES[theme]},
        "@jupyterlab/apputils-extension:notification": {"fetchNews": "false"},
    }
    for plugin, values in settings.items():
        r = requests.put(
            f"{server_url.rstrip('/')}/lab/api/settings/{plugin}",
            json={"raw": json.dumps(values)},
            headers=headers,
            cookies=cookies,
            timeout=30,
        )
        assert r.status_code == 204, f"{plugin}: {r.status_code} {r.text[:300]}"


def create_notebook(
    server_url: str, headers: dict[str, str], path: str, kernelspec: dict[str, str] | None = None
) -> None:
    """Write an empty Python notebook at ``path`` through the contents API, for the
    kernel ``kernelspec`` (``{"name": ..., "display_name": ...}``; default Python 3)."""
    content = json.loads(json.dumps(NOTEBOOK))
    if kernelspec is not None:
        content["metadata"]["kernelspec"] = {"language": "python", **kernelspec}
    r = requests.put(
        f"{server_url.rstrip('/')}/api/contents/{path}",
        json={"type": "notebook", "format": "json", "content": content},
        headers=headers,
        timeout=30,
    )
    assert r.status_code in (200, 201), f"create {path}: {r.status_code} {r.text[:300]}"


def shut_down_sessions(server_url: str, headers: dict[str, str]) -> None:
    """Shut every notebook session of the server at ``server_url`` down, kernels included.

    Raises:
        AssertionError: the server refused.
    """
    base = server_url.rstrip("/")
    for session in requests.get(f"{base}/api/sessions", headers=headers, timeout=30).json():
        r = requests.delete(f"{base}/api/sessions/{session['id']}", headers=headers, timeout=60)
        assert r.status_code == 204, f"shut down {session['path']}: {r.status_code} {r.text[:300]}"


def wait_for_lab(page: Page, timeout_ms: float = 120_000) -> None:
    """Wait until JupyterLab has started and our status-bar item is shown."""
    page.locator("#jp-main-statusbar").wait_for(timeout=timeout_ms)
    page.locator(".jp-vgpu-indicator").wait_for(timeout=timeout_ms)


def run_command(page: Page, label: str, done, state: str = "visible") -> None:
    """Run the command palette's item ``label`` until the locator ``done`` is in ``state``
    (``visible``, or ``attached`` for what has no size of its own).

    The palette is a modal that closes when focus moves (a notebook still opening takes
    it), so it is opened again until the command could be chosen.
    """
    search = page.locator(".lm-CommandPalette-input").first
    for _ in range(10):
        page.keyboard.press("Control+Shift+C")
        try:
            search.fill(label, timeout=3_000)
            page.locator(".lm-CommandPalette-item", has_text=label).first.click(timeout=3_000)
            done.wait_for(state=state, timeout=3_000)
            return
        except PlaywrightTimeoutError:
            page.keyboard.press("Escape")
    done.wait_for(state=state, timeout=10_000)


def show_panel(page: Page) -> None:
    """Open the vGPU panel through the command palette ("Show vGPU usage")."""
    run_command(page, "Show vGPU usage", page.locator("#jupyter-vgpu-panel"))


def use_theme(page: Page, theme: str) -> None:
    """Switch JupyterLab to ``theme`` (``light`` or ``dark``) in place, without a reload
    (a reload would reconnect the notebooks' kernels)."""
    name = THEMES[theme]
    run_command(page, f"Use Theme: {name}", page.locator(f"body[data-jp-theme-name='{name}']"), "attached")
    page.locator("#jupyterlab-splash").wait_for(state="detached")  # shown while the theme loads


def wait_for_kernel(page: Page, timeout_ms: float = 120_000) -> None:
    """Wait until the active notebook's kernel is idle."""
    expect(
        page.locator(".jp-NotebookPanel:visible .jp-Notebook-ExecutionIndicator[data-status='idle']").first
    ).to_be_attached(timeout=timeout_ms)


def _click(page: Page, editor) -> None:
    """Click ``editor``. Where JupyterLab asks which kernel to start (it may, when the
    notebook opened before a fresh server listed its kernels), answer as a user would, with
    its preselected Python 3; where another dialog covers it, fail saying what it asks."""
    try:
        editor.click()
    except PlaywrightTimeoutError:
        dialog = page.locator(".jp-Dialog")
        if not dialog.count():
            raise
        text = dialog.first.inner_text()
        if text.startswith("Select Kernel") and "Python 3 (ipykernel)" in text:
            dialog.first.locator(".jp-Dialog-button.jp-mod-accept").click()
            wait_for_kernel(page)
            editor.click()
            return
        screenshot(page, "dialog-before-run-cell", docs=False)  # JupyterLab asks something: say what
        raise AssertionError(f"a JupyterLab dialog covers the notebook: {text!r}") from None


def run_cell(page: Page, code: str, timeout_ms: float = 120_000) -> None:
    """Type ``code`` into the active notebook's first cell and run it once; wait for its
    execution count.

    JupyterLab shows ``[*]:`` the moment it sends a cell to the kernel. A run request
    made while a just-opened notebook's kernel connection settles may send nothing and
    leave the prompt blank (``[ ]:``); only then is Ctrl+Enter pressed again. Once the
    prompt shows ``[*]`` or a count the cell was sent, and it is never sent twice: a
    cell that then does not finish fails the test instead.
    """
    editor = page.locator(".jp-NotebookPanel:visible .jp-Cell .cm-content").first
    prompt = page.locator(".jp-NotebookPanel:visible .jp-InputPrompt").first
    editor.wait_for(timeout=timeout_ms)
    wait_for_kernel(page, timeout_ms)
    _click(page, editor)
    page.keyboard.type(code)
    expect(editor).to_have_text(code.replace("\n", ""))  # one element per line, no newline
    sent = re.compile(r"\[(\*|\d+)\]:")
    for _ in range(6):
        page.keyboard.press("Control+Enter")
        try:
            expect(prompt).to_have_text(sent, timeout=5_000)
            break
        except AssertionError:
            if sent.search(prompt.text_content() or ""):
                break  # sent just now: never press again
            _click(page, editor)
    try:
        expect(prompt).to_have_text(re.compile(r"\[\d+\]:"), timeout=timeout_ms)
    except AssertionError:
        screenshot(page, "failed-run-cell", docs=False)
        raise


def watch_usage_requests(page: Page) -> list[str]:
    """The URLs of every request the page makes to ``/api/vgpu/...``, as they happen."""
    urls: list[str] = []
    page.on("request", lambda request: urls.append(request.url) if "/api/vgpu/" in request.url else None)
    return urls


def used_bytes(page: Page) -> int:
    """The used bytes the panel's meter shows now."""
    return int(page.locator("#jupyter-vgpu-panel .jp-vgpu-used").get_attribute("data-bytes"))


def screenshot(page: Page, name: str, selector: str | None = None, *, docs: bool = True) -> Path:
    """Save a PNG of the page (or of ``selector``) as ``test-artifacts/screenshots/<name>.png``.

    A picture of the documentation (``docs``) goes to ``docs/screenshots/`` instead while
    JUPYTER_VGPU_UPDATE_SCREENSHOTS=1, recorded with the sources that drew it."""
    folder = screenshots.DOCS if docs and screenshots.updating() else ARTIFACTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    target = page.locator(selector).first if selector else page
    target.screenshot(path=str(path))
    if folder == screenshots.DOCS:
        screenshots.record(path)
    return path
