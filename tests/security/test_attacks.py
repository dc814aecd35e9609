"""Each attack on the root arbiter, for real: a root arbiter as an admin runs it, the
victim's and the attacker's processes as accounts of their own (see
:mod:`jupyter_vgpu.testing.attacks` for each attack and what it checks is unchanged).
Every one must be refused; ``benchmarks/attacks.py`` records the same runs with their
messages in ``benchmarks/results/attacks-cpu.json``."""

import pytest

from jupyter_vgpu.testing import attacks


@pytest.mark.parametrize("attack", attacks.ALL, ids=[a.name for a in attacks.ALL])
def test_the_attack_is_refused_and_nothing_changed(attack):
    outcome = attack()
    assert outcome.refused, f"{attack.name} ({attack.surface}): {outcome.message}"
