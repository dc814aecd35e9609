"""What the fault-injection suite's GPU tests and ``benchmarks/faults.py`` share: kernels
with a slice of the real card under an arbiter, filled with bf16-like weights whose
digest the kernel prints (the SHA-256 of each GiB's SHA-256, hashed on four threads), a
kernel reached through its connection file, and a user's real server with a kernel it
started."""

from __future__ import annotations

import dataclasses
import queue
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from jupyter_client import BlockingKernelClient

from . import fault_scene
from .arbiter_process import ArbiterProcess
from .kernel_runner import Kernel
from .waiting import wait_for

if TYPE_CHECKING:
    from .server_process import JupyterServer

GiB, MiB = 2**30, 2**20

FILL = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed({seed})\n"
    "data = [(torch.randn(2**29, device='cuda', generator=g) * 0.02).to(torch.bfloat16)\n"
    "        for _ in range({n})]\n"
    "def _one(d):\n"
    "    return hashlib.sha256(d.view(torch.uint8).cpu().numpy()).digest()\n"
    "def digest():\n"
    "    from concurrent.futures import ThreadPoolExecutor\n"
    "    with ThreadPoolExecutor(4) as pool:  # hashlib lets go of the GIL: a GiB per thread\n"
    "        return hashlib.sha256(b''.join(pool.map(_one, data))).hexdigest()\n"
    "print(digest())"
)
DIGEST = "print(digest())"


def gpu_slice(limit: int):
    from jupyter_vgpu import nvml
    from jupyter_vgpu.slice import Slice

    gpu = nvml.list_gpus()[0]
    return Slice.on_card(gpu, limit, 100, overcommit_ratio=4.0)


def card_free() -> int:
    from jupyter_vgpu import nvml

    return nvml.free_memory(nvml.list_gpus()[0].uuid)


def gpu_kernel(tmp_path, arbiter: ArbiterProcess | None, user: str, limit: int, env=None, args=()) -> Kernel:
    from jupyter_vgpu.testing.preloaded import environment

    extra = {"JUPYTER_VGPU_SLICE": gpu_slice(limit).to_json(), **(env or {})}
    if arbiter is not None:
        extra["JUPYTER_VGPU_ARBITER"] = str(arbiter.socket)
    kernel = Kernel(tmp_path, environment(**extra), load_extension=True, args=args)
    kernel.user = user
    if arbiter is not None:
        with arbiter.control() as c:
            c.register(kernel.pid, user, "", gpu_slice(limit))
        wait_for(lambda: arbiter.kernel(kernel.pid), 30, f"{user}'s kernel to join the arbiter")
    return kernel


def fill(kernel: Kernel, seed: int, n: int = 2) -> str:
    out = fault_scene.run(kernel, FILL.format(seed=seed, n=n), timeout=300)
    assert out.error is None, out.error
    digest = out.text.strip().splitlines()[-1] if out.text.strip() else ""
    assert re.fullmatch(r"[0-9a-f]{64}", digest), f"the fill failed: {out.text[-2000:]}"
    return digest


def needs_the_victim(arbiter: ArbiterProcess, asker: Kernel) -> None:
    """Give the asker a budget its next cell can have only once the victim is paused: what
    the card has free, what the asker holds by the arbiter's books, and 1.5 GiB more.

    The arbiter pauses only what its books say a kernel holds: first wait until they hold
    the 1.5 GiB on the other kernels (usage reports lag the fill by a report interval).
    """

    def others() -> int:
        return sum(k["resident"] for k in arbiter.books()["kernels"] if k["pid"] != asker.pid)

    wait_for(
        lambda: others() >= 3 * GiB // 2,
        30,
        "the other kernels' bytes in the arbiter's books",
    )
    held = arbiter.kernel(asker.pid)["resident"]
    with arbiter.control() as c:
        c.register(asker.pid, asker.user, "", gpu_slice(card_free() + held + 3 * GiB // 2))


def same(kernel: Kernel, expected: str) -> None:
    """The kernel's bytes are ``expected`` (their SHA-256), and the wait before its cell
    ran had no stretch over :data:`fault_scene.SILENCE` without a word (hashing GiBs on
    the CPU takes seconds of the cell's own)."""
    out = fault_scene.run(kernel, fault_scene.BACK + DIGEST, timeout=300)
    assert out.text.strip().splitlines()[-1] == expected, out.text
    assert out.silence_until("back") <= fault_scene.SILENCE, (out.silence_until("back"), out.text)


class Attached:
    """A kernel reached through its connection file (the run helpers need ``client``).

    Ready once it answers ``kernel_info`` on the shell channel and IOPub carries its
    status, waited for with :func:`.waiting.wait_for` (``timeout`` seconds). ``gone``,
    where given, is asked at every try and returns why the kernel will never answer (it
    died, its server let it go) or None: the wait then ends at once with that reason.
    ``BlockingKernelClient.wait_for_ready`` is not used: a client without a kernel
    manager judges the kernel alive by its heartbeat alone, and on the H100 machine a
    server-started kernel still loading CUDA missed its first beats and was called dead
    ("Kernel died before replying to kernel_info") while it was starting."""

    def __init__(self, connection_file, timeout: float = 120, gone: Callable[[], str | None] | None = None):
        self.gone = gone
        self.client = BlockingKernelClient()
        self.client.load_connection_file(connection_file)
        self.client.start_channels()
        wait_for(self._answers, timeout, "the kernel's kernel_info reply and its IOPub status", interval=0)

    def _answers(self) -> bool:
        why = self.gone() if self.gone is not None else None
        assert why is None, f"the kernel will not answer: {why}"
        asked = self.client.kernel_info()
        try:
            while True:  # replies to earlier tries may come first
                reply = self.client.get_shell_msg(timeout=1)
                if reply["parent_header"].get("msg_id") == asked:
                    break
            self.client.get_iopub_msg(timeout=0.5)  # IOPub is connected: no output is missed
        except queue.Empty:
            return False
        while True:  # what the tries left on IOPub is not a later cell's
            try:
                self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                return True


def kernel_gone(server: JupyterServer, kid: str) -> str | None:
    """Why ``server``'s kernel ``kid`` will never answer, or None while it may: the server
    drops a kernel that died and could not be restarted (404), or marks it dead."""
    try:
        answer = server.request("GET", f"api/kernels/{kid}")
    except OSError as e:  # the server itself went away
        return f"its server does not answer: {e}"
    if answer.status_code == 404:
        return f"its server no longer has kernel {kid}: it died and could not be restarted"
    if answer.ok and answer.json().get("execution_state") == "dead":
        return f"its server reports kernel {kid} dead"
    return None


def kernel_of(arbiter, server: str) -> int | None:
    return next((k["pid"] for k in arbiter.books()["kernels"] if k["server"] == server), None)


@dataclasses.dataclass
class Served:
    """A user's real Jupyter server under an arbiter, and the kernel it started:
    ``kernel_id``, the ``kernel`` reached through its connection file, and its ``pid``
    (from the arbiter's books)."""

    server: JupyterServer
    kernel_id: str
    kernel: Attached
    pid: int


def served_kernel(tmp: Path, arbiter: ArbiterProcess, user: str = "ada") -> Served:
    """Start ``user``'s Jupyter server in ``tmp/<user>`` with the simulated
    :data:`fault_scene.SLICE`, register it with ``arbiter`` as the Hub's registrar would,
    and start one kernel through its REST API; returns once the kernel is in the books.
    The caller stops the server (here, only when something fails on the way).

    Raises:
        AssertionError: the server or its kernel did not come up (60 s for the server and
            for the books, 120 s for the kernel's first reply: :class:`Attached`).
    """
    from .server_process import JupyterServer  # a server's parts only where one is started

    env = {"JUPYTER_VGPU_ARBITER": str(arbiter.socket), "JUPYTER_VGPU_SLICE": fault_scene.SLICE.to_json()}
    server = JupyterServer(tmp / user, env, args=[f"--VGPUServer.channel_dir={tmp / 'channel'}"], vgpu=True)
    try:
        with arbiter.control() as c:
            c.register(server.proc.pid, user, "", fault_scene.SLICE)
        kid = server.request("POST", "api/kernels", json={"name": "python3"}).json()["id"]
        kernel = Attached(server.runtime / f"kernel-{kid}.json", gone=lambda: kernel_gone(server, kid))
        pid = wait_for(lambda: kernel_of(arbiter, f"{user}/"), 60, f"{user}'s kernel in the books")
    except BaseException as e:
        server.stop()
        if server.log_path.exists():  # what the server and its kernel said on the way
            e.add_note(f"{server.log_path}:\n{server.log_path.read_text()[-4000:]}")
        raise
    return Served(server, kid, kernel, pid)
