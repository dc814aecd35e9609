"""The metrics collector, and the Grafana dashboard that reads it."""

import json
import re
import types
from pathlib import Path

from hub_spawner.inventory import GPU
from hub_spawner.metrics import SliceCollector
from hub_spawner.usage import UsageBoard, gpu_rows, parse_report, slice_rows
from jupyter_vgpu.slice import Card, Slice
from jupyter_vgpu.testing.documents import report

GiB = 2**30
DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "jupyter-vgpu.json"


def snapshot():
    gpu = GPU(0, "GPU-sim-0", "H100", 80 * GiB, True)
    s = Slice(
        gpu.uuid, 0, gpu.name, gpu.memory, 8 * GiB, 50, simulated=True, memory_request=2 * GiB, priority=70
    )
    board = UsageBoard()
    totals = {"used": GiB, "reserved": GiB, "offloaded": 4 * GiB, "offloaded_compressed": 2 * GiB}
    board.record("ada/", parse_report(report(s, totals=totals))[1])
    rows = slice_rows([("ada", types.SimpleNamespace(name="", vgpu_slice=s))], board)
    return rows, gpu_rows([gpu], 1.5, rows)


def families():
    return {f.name: f for f in SliceCollector(snapshot).collect()}


def test_collector_values():
    fams = families()
    value = {f: fams[f].samples[0].value for f in fams if fams[f].samples}
    assert value["jupyterhub_vgpu_slice_budget_bytes"] == 8 * GiB
    assert value["jupyterhub_vgpu_slice_request_bytes"] == 2 * GiB
    assert value["jupyterhub_vgpu_slice_priority"] == 70
    assert value["jupyterhub_vgpu_gpu_requested_bytes"] == 2 * GiB
    assert value["jupyterhub_vgpu_slice_compression_ratio"] == 2.0
    assert value["jupyterhub_vgpu_gpu_overcommit_ratio"] == 0.1
    assert fams["jupyterhub_vgpu_slice_sm_percent"].samples == []  # unknown is absent, not 0
    assert fams["jupyterhub_vgpu_slice_used_bytes"].samples[0].labels == {
        "user": "ada",
        "server": "",
        "gpu": "0",
    }


def test_a_slice_of_two_cards_has_its_settings_on_each_card_and_its_report_on_the_first():
    gpus = [GPU(i, f"GPU-sim-{i}", "H100", 80 * GiB, True) for i in range(2)]
    s = Slice(
        gpus[0].uuid,
        0,
        "H100",
        80 * GiB,
        8 * GiB,
        50,
        simulated=True,
        more_gpus=(Card(gpus[1].uuid, 1, 80 * GiB),),
    )
    board = UsageBoard()
    totals = {"used": GiB, "reserved": GiB, "offloaded": 0, "offloaded_compressed": 0}
    board.record("ada/", parse_report(report(s, totals=totals))[1])
    rows = slice_rows([("ada", types.SimpleNamespace(name="", vgpu_slice=s))], board)
    fams = {f.name: f for f in SliceCollector(lambda: (rows, gpu_rows(gpus, 1.5, rows))).collect()}

    def on(name: str) -> dict[str, float]:
        return {x.labels["gpu"]: x.value for x in fams[name].samples}

    assert on("jupyterhub_vgpu_slice_budget_bytes") == {"0": 8 * GiB, "1": 8 * GiB}
    assert on("jupyterhub_vgpu_slice_used_bytes") == {"0": GiB}
    assert on("jupyterhub_vgpu_gpu_committed_bytes") == {"0": 8 * GiB, "1": 8 * GiB}
    assert on("jupyterhub_vgpu_gpu_used_bytes") == {"0": GiB, "1": 0}
    assert on("jupyterhub_vgpu_gpu_slices") == {"0": 1, "1": 1}


def test_no_series_before_the_hub_runs():
    assert list(SliceCollector(lambda: None).collect()) == []


def test_the_grafana_dashboard_reads_only_series_we_export():
    exported = set(families())
    dashboard = json.loads(DASHBOARD.read_text())
    used = {
        m
        for p in dashboard["panels"]
        for t in p["targets"]
        for m in re.findall(r"jupyterhub_vgpu_\w+", t["expr"])
    }
    assert used
    assert used <= exported, used - exported
