"""The security tests need root: real accounts and a root arbiter (CI runs as root)."""

import pytest

from jupyter_vgpu.testing import security_scene
from jupyter_vgpu.testing.server_process import xdist_worker


def pytest_collection_modifyitems(items):
    why = security_scene.unavailable()
    if why:
        for item in items:
            if "tests/security/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session", autouse=True)
def accounts():
    """The victim's and the attacker's accounts, removed after the session: in one pytest
    process, whoever made them (a run cut short leaves them); in a pytest-xdist worker, only
    those it made, since another worker may be using them still."""
    yield
    if xdist_worker() is not None:
        security_scene.remove_made()
    elif security_scene.unavailable() is None:
        for name in (security_scene.VICTIM, security_scene.ATTACKER):
            security_scene.remove_account(name)
