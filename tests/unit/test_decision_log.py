"""The arbiter's decision log keeps the latest ``ArbiterApp.decisions_kept`` decisions."""

import pytest
from traitlets import TraitError

from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter


def test_the_books_keep_the_latest_decisions_kept():
    arbiter = Arbiter(ArbiterApp(registrars="none", decisions_kept=3))
    for i in range(5):
        arbiter.decide("pause", server=f"user{i}/", reason="idle")
    assert [d["server"] for d in arbiter.decisions] == ["user2/", "user3/", "user4/"]


def test_decisions_kept_below_one_is_refused():
    with pytest.raises(TraitError):
        ArbiterApp(decisions_kept=0)
