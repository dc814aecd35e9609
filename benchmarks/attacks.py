"""Every known attack on the root arbiter, run for real; writes ``benchmarks/results/attacks-cpu.json``.

    sudo python benchmarks/attacks.py [--out FILE] [--attacks NAME ...]

Each attack of :data:`jupyter_vgpu.testing.attacks.ALL` runs in a fresh scene (a root
arbiter as an admin runs it, real accounts for a victim and an attacker: see
:mod:`jupyter_vgpu.testing.security_scene`), and its outcome is recorded: ``refused``
(the attack failed and nothing it aimed at changed), the surface, the review's severity,
what the arbiter or the system said, and the seconds it took. The CUDA IPC attacks run
over the driver stand-in of ``tests/native`` (``tests/unit/test_vmm_native.py``): their
outcome is that test's. Goal (issue 44): every one refused. Needs root; no GPU.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import provenance

from jupyter_vgpu.testing import attacks, security_scene

ROOT = Path(__file__).resolve().parents[1]
#: The CUDA IPC attacks, each a test of tests/unit/test_vmm_native.py.
IPC = {
    "ipc-token-of-another-user": "test_an_export_goes_to_processes_of_its_own_user_only",
    "ipc-impostor-on-an-ended-exporter": "test_an_importer_takes_memory_from_the_exporter_alone",
}


def run_ipc(name: str, test: str) -> dict:
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"tests/unit/test_vmm_native.py::{test}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    last = (done.stdout.strip().splitlines() or [""])[-1]
    refused = done.returncode == 0
    return {
        "name": name, "surface": "CUDA IPC sockets", "severity": "low-medium", "refused": refused,
        "message": f"{test}: {last}", "seconds": round(time.monotonic() - t0, 2),
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attacks-cpu.json"))
    names = [a.name for a in attacks.ALL] + list(IPC)
    parser.add_argument(
        "--attacks", nargs="*", default=names, choices=names, help="attacks to run (default all)"
    )
    args = parser.parse_args(argv)
    why = security_scene.unavailable()
    if why:
        sys.exit(f"attacks.py {why}")
    doc = provenance.record()
    rows = []
    for attack in attacks.ALL:
        if attack.name not in args.attacks:
            continue
        t0 = time.monotonic()
        try:
            outcome = attack()
            refused, message = outcome.refused, outcome.message
        except AssertionError as e:  # it went somewhere it must not: the attack worked
            refused, message = False, f"{type(e).__name__}: {e}"
        rows.append({
            "name": attack.name, "surface": attack.surface, "severity": attack.severity, "refused": refused,
            "message": message, "seconds": round(time.monotonic() - t0, 2),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    for name, test in IPC.items():
        if name in args.attacks:
            rows.append(run_ipc(name, test))
            print(json.dumps(rows[-1]), flush=True)
    for name in (security_scene.VICTIM, security_scene.ATTACKER):
        security_scene.remove_account(name)
    doc.update(attacks=rows, refused=sum(r["refused"] for r in rows), tried=len(rows))
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{doc['refused']} of {doc['tried']} refused; wrote {args.out}")


if __name__ == "__main__":
    main()
