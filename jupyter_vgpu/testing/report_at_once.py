"""A pytest plugin that prints each failure's report when it happens, not at the session's
end, so that a run cut short by a time limit (a lent GPU machine's per-call limit) still
records why its failures failed.

Use: ``python -m pytest -p jupyter_vgpu.testing.report_at_once`` (``scripts/gpu-tests``
does).
"""

from __future__ import annotations

import pytest


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed:
        return
    terminal = _config.pluginmanager.get_plugin("terminalreporter") if _config else None
    if terminal is None:
        return
    terminal.write_line("")
    terminal.write_sep("_", f"{report.nodeid} failed ({report.when})")
    terminal.write_line(report.longreprtext)


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
