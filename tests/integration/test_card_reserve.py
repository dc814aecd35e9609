"""``ArbiterApp.card_reserve``: memory of each card the arbiter never counts as room. Real
arbiter and kernels on a simulated card (1 GiB): ada holds 400 MiB and goes idle; bob's
cell may grow to 500 MiB. The card has 624 MiB free, so bob runs beside ada; with 300 MiB
reserved, 324 MiB are free to the arbiter, and ada is paused for bob. A reserve as large
as the card is said once, as a decision."""

from __future__ import annotations

import dataclasses

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB


@pytest.mark.parametrize(("reserve", "ada_paused"), [(None, False), ("300M", True)])
def test_reserved_memory_of_a_card_is_never_counted_as_room(tmp_path, reserve, ada_paused):
    settings = [f"--ArbiterApp.card_reserve={reserve}"] if reserve else []
    arbiter = ArbiterProcess(tmp_path, *settings).start()
    kernels = []
    try:
        ada = scene.start_kernel(tmp_path, arbiter, "ada")
        kernels.append(ada)
        bob = scene.start_kernel(
            tmp_path,
            arbiter,
            "bob",
            slice_=dataclasses.replace(scene.SLICE, memory_limit=500 * MiB, memory_request=500 * MiB),
        )
        kernels.append(bob)
        assert scene.run(ada, scene.hold_code(1, 16 * MiB, simulated_mib=400)).error is None
        wait_for(lambda: arbiter.kernel(ada.pid)["state"] == "idle", 10, "ada idle, holding 400 MiB")

        assert scene.run(bob, "print('bob ran')").text.strip().splitlines()[-1] == "bob ran"
        tier = arbiter.kernel(ada.pid)["tier"]
        assert tier == ("host" if ada_paused else "gpu"), (reserve, arbiter.books()["decisions"])
        # paused or not, ada's bytes are hers when her next cell runs
        out = scene.run(ada, scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
    finally:
        for k in kernels:
            k.shutdown()
        arbiter.stop()


def test_a_reserve_as_large_as_the_card_is_said_once(tmp_path):
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.card_reserve=2G").start()
    try:
        ada = scene.start_kernel(tmp_path, arbiter, "ada")
        try:
            for _ in range(2):  # each cell's room reads the card again
                assert scene.run(ada, "print('ran')").text.strip().splitlines()[-1] == "ran"
            said = [d for d in arbiter.books()["decisions"] if d["what"] == "card reserved whole"]
            assert len(said) == 1, arbiter.books()["decisions"]
            assert "ArbiterApp.card_reserve (2.00 GiB) is as large as the card" in said[0]["message"]
        finally:
            ada.shutdown()
    finally:
        arbiter.stop()
