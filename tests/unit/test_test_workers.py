"""What keeps the tests' processes apart under pytest-xdist (scripts/test runs two): each
worker's servers, Hubs and proxies take ports of its own, and its Hubs make system
accounts of their own (a Hub removes the accounts it made when it is shut down)."""

import pytest

from hub_spawner.ports import SERVER_RANGE
from jupyter_vgpu.testing.hub_process import account_prefix
from jupyter_vgpu.testing.server_process import TEST_PORTS, free_port, worker_share


@pytest.mark.parametrize("count", [2, 3, 4])
@pytest.mark.parametrize("ports", [TEST_PORTS, SERVER_RANGE])
def test_each_worker_has_ports_no_other_has(monkeypatch, count, ports):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(count))
    shares = []
    for n in range(count):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        shares.append(worker_share(*ports))
    for low, high in shares:
        assert ports[0] <= low <= high <= ports[1]
        assert high - low + 1 >= (ports[1] - ports[0] + 1) // count
    taken = [p for low, high in shares for p in range(low, high + 1)]
    assert len(taken) == len(set(taken))


def test_one_process_has_every_port(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert worker_share(*TEST_PORTS) == TEST_PORTS


def test_a_picked_port_is_of_the_workers_share(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    low, high = worker_share(*TEST_PORTS)
    assert low > TEST_PORTS[0]
    for _ in range(20):
        assert low <= free_port() <= high


def test_each_worker_has_its_own_accounts(monkeypatch):
    from hub_spawner.demo import system_user

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert account_prefix() == system_user.PREFIX
    names = set()
    for n in range(3):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        names.add(system_user.account_name("ada", account_prefix()))
    assert len(names) == 3
