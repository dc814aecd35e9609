"""Hub settings: documented, listed in a generated config, validated."""

import subprocess
import sys

import pytest
from traitlets import TraitError
from traitlets.config import Config

from hub_spawner.config import VGPUHub
from hub_spawner.demo.spawner import DemoSpawner
from hub_spawner.inventory import GPUInventory


@pytest.mark.parametrize("cls", [VGPUHub, GPUInventory, DemoSpawner])
def test_every_setting_has_help(cls):
    for name, trait in cls.class_own_traits(config=True).items():
        assert len(trait.help) > 20, f"{cls.__name__}.{name} has no help"


def test_the_generated_config_lists_jupyterhubs_settings_and_ours():
    """Issue 10, defect 7: `jupyterhub --generate-config` lists only JupyterHub's and its
    entry points' classes; `python -m hub_spawner.config` adds ours."""
    out = subprocess.run(
        [sys.executable, "-m", "hub_spawner.config"], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    for setting in (
        "c.JupyterHub.spawner_class",
        "c.VGPUHub.overcommit_ratio",
        "c.VGPUHub.isolation",
        "c.VGPUHub.min_memory_limit",
        "c.VGPUHub.default_memory_request",
        "c.VGPUHub.default_priority",
        "c.GPUInventory.simulate",
        "c.GPUInventory.simulated_mig_profiles",
    ):
        assert f"# {setting} =" in out, setting
    compile(out, "jupyterhub_config.py", "exec")


@pytest.mark.parametrize(
    "bad",
    [
        {"overcommit_ratio": 0.5},
        {"default_compute_share": 0},
        {"default_priority": 101},
        {"high_watermark": 0},
        {"isolation": "vmware"},
        {"gpu_isolation": {"0": "vmware"}},
    ],
)
def test_bad_settings_are_refused(bad):
    with pytest.raises((TraitError, ValueError)):
        VGPUHub(config=Config({"VGPUHub": bad}))
