import pytest

from jupyter_vgpu.testing.hub_process import HubProcess


@pytest.fixture(scope="session")
def hub():
    """The real demo Hub, proxy and servers, shared by the integration tests."""
    process = HubProcess("hub")
    try:
        process.start()
        yield process
    finally:
        process.shutdown()


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
