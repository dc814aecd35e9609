import shutil

import pytest

from .lab_page import LAUNCH_ARGS

CHROMIUM = "/usr/bin/chromium"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="package")
def browser():
    """Debian's Chromium, headless, driven by Playwright (never a downloaded browser).

    Package-scoped: Playwright's sync API keeps an event loop marked running in the
    main thread while it is open, which would break later tests that run asyncio."""
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is not installed")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=LAUNCH_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 860})
    context.set_default_timeout(60_000)
    yield context.new_page()
    context.close()
