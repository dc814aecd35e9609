"""binder/example.ipynb runs cell by cell in a real kernel of a real server behind the Hub."""

from pathlib import Path

from jupyter_vgpu.testing.lab_client import LabClient

EXAMPLE = Path(__file__).resolve().parents[2] / "binder" / "example.ipynb"


def test_the_example_notebook_trains_in_a_users_kernel(hub):
    hub.user_token("grace")
    r = hub.api("PUT", "/vgpu/quotas/users/grace", json={"memory_limit": "2G", "compute_share": 30})
    assert r.status_code == 200, r.text
    lab = LabClient(hub.spawn("grace"), hub.user_token("grace"))
    kernel = lab.start_kernel()
    try:
        outputs = lab.run_notebook(kernel, EXAMPLE)
    finally:
        lab.shutdown_kernel(kernel)
        hub.stop_server("grace")
    text = "\n".join(outputs)
    assert "Error" not in text, text
    assert "device: cpu" in text, text
    assert "test accuracy: " in text, text
    accuracy = float(text.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.9, text
    assert "2.00 GiB" in outputs[0], outputs[0]  # %vgpu status shows grace's slice
    assert "30%" in outputs[0], outputs[0]
