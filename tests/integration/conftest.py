import pytest

from jupyter_vgpu.testing.hub_process import HubProcess


@pytest.fixture(scope="session")
def shared_hub():
    """The real demo Hub, proxy and servers, started once for the integration tests."""
    process = HubProcess("hub")
    try:
        process.start()
        yield process
    finally:
        process.shutdown()


@pytest.fixture(scope="module")
def hub(shared_hub):
    """The shared Hub, its vGPU quotas put back as this module found them once it ends.

    A quota one module sets stays in the Hub's database: ``test_user_path`` gives dora a
    100 GiB budget, and a module run after it that spawns dora was refused placement
    (``test_server_cgroups``, when pytest-xdist ran the modules in another order). Each
    module starts from the quotas the one before found, whatever the order.
    """
    before = shared_hub.quotas()
    yield shared_hub
    shared_hub.restore_quotas(before)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/integration/" in str(item.fspath):
            item.add_marker(pytest.mark.integration)
