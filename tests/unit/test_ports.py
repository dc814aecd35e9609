"""Ports for local servers: free ones of the range, never one in use or just handed out."""

import socket

import pytest

from hub_spawner import ports


def hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def some_free_ports(n: int, low: int = 20000, high: int = 29999) -> list[int]:
    """n consecutive ports of [low, high] that are free now."""
    for start in range(low, high - n):
        if all(ports._bindable("127.0.0.1", p) for p in range(start, start + n)):
            return list(range(start, start + n))
    pytest.skip("no run of free ports on this machine")


def test_a_port_in_use_is_never_handed_out():
    a, b = some_free_ports(2)
    with hold(a):
        picker = ports.PortPicker(a, b)
        assert picker.pick() == b


def test_a_port_handed_out_is_not_handed_out_again_while_its_server_starts():
    a, b = some_free_ports(2)
    picker = ports.PortPicker(a, b)
    assert {picker.pick(), picker.pick()} == {a, b}  # nothing bound them yet
    with pytest.raises(ports.NoFreePort, match=f"no free port in {a}-{b}"):
        picker.pick()


def test_a_port_is_handed_out_again_once_its_hold_has_passed():
    (a,) = some_free_ports(1)
    picker = ports.PortPicker(a, a, hold_seconds=0)
    assert picker.pick() == picker.pick() == a


@pytest.mark.parametrize(("low", "high"), [(80, 90), (30000, 29999), (60000, 70000)])
def test_a_range_outside_unprivileged_ports_is_refused(low, high):
    with pytest.raises(ValueError, match="port range"):
        ports.PortPicker(low, high)


def test_the_ephemeral_range_is_read_from_the_os_or_falls_back_to_linux_default(tmp_path):
    path = tmp_path / "range"
    path.write_text("40000\t50000\n")
    assert ports.ephemeral_range(path) == (40000, 50000)
    path.write_text("garbage")
    assert ports.ephemeral_range(path) == ports.LINUX_DEFAULT_EPHEMERAL
    assert ports.ephemeral_range(tmp_path / "absent") == ports.LINUX_DEFAULT_EPHEMERAL


def test_the_default_range_of_the_local_spawners_stays_clear_of_this_machines_ephemeral_range():
    from hub_spawner.spawner import VGPUSpawner

    assert not ports.overlap(VGPUSpawner.class_traits()["port_range"].default(), ports.ephemeral_range())


def test_an_ipv6_address_is_tested_on_ipv6():
    if not socket.has_ipv6 or not ports._bindable("::1", 0):
        pytest.skip("no IPv6 loopback here")
    a, b = some_free_ports(2)
    assert ports.PortPicker(a, b).pick("::1") in (a, b)


def test_the_spawner_refuses_a_port_range_outside_unprivileged_ports():
    from traitlets import TraitError

    from hub_spawner.spawner import VGPUSpawner

    with pytest.raises(TraitError, match="port_range: port range 80-90"):
        VGPUSpawner(port_range=(80, 90))
