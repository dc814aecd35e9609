"""Sessions per GPU: N real kernels sharing one card through the node arbiter.

Every session is a real IPython kernel started as a jupyter-vgpu server starts it (the
pausable allocator preloaded, the arbiter's socket in its environment), registered with
a standalone arbiter with the same slice. Each holds a working set W, by ``--workload``:

- ``mlp``: a bf16 MLP (``--layers`` blocks of ``--width`` -> 4x ``--width`` ->
  ``--width``) with its AdamW state (bf16); a training step also needs gradients and the
  activations of a batch of ``--batch`` random tokens, freed after the step;
- ``transformer``: a Llama-architecture causal language model of 1.1B parameters
  (TinyLlama-1.1B's shape: hidden 2048, 22 layers, 32 heads of which 4 key-value heads,
  MLP 5632, vocabulary 32000) built from its config with random weights (nothing is
  downloaded), bf16; a step is a LoRA fine-tuning step (rank 16 on every layer's query
  and value projections, AdamW) on a random batch of ``--tokens`` tokens (2,048), or with
  ``--tune full`` a full fine-tuning step (AdamW over every weight). With
  ``--same-checkpoint`` every session loads the same base weights from one checkpoint
  (written once by the harness, ``save_pretrained`` of the same random model, read by
  ``from_pretrained`` onto the card as a class loading one model does), so the frozen
  weights are byte for byte the same in every kernel; only the adapters differ.

Each session runs an interactive duty
cycle: a cell of training steps (about ``--cell-seconds`` on an empty card), then
``--think`` seconds idle, ``--cycles`` times; the first cell starts at a random time in
the first cycle (``--seed`` replays one draw, so that runs compared meet the same
schedule), so that cells of different sessions meet as they would by chance.

Baseline: static partitioning, the most sessions whose peak (working set, gradients,
activations and CUDA context, measured on the empty card) fit on the card side by side:
a static slice has to hold the session's peak. For each N the cell latencies (send to
reply, resume and any wait for room included) are compared with the same cell on the
empty card. Paused working sets live in host memory, so N is also bounded by the host's
memory (each run reports the host's peak memory in use). The think time sets how often
cells of different sessions run at the same time: they then share the card's compute,
which no memory policy can hide. Every run also carries ``compute_share``: the latencies
its own cells, sent when they were, would have had if memory cost nothing and cells that
meet shared the card's compute equally (``jupyter_vgpu/testing/compute_share.py``); the
measured latencies less these are what the memory path cost.

``--edit-before S`` replays a user who starts editing the cell S seconds before running
it: the harness asks for a prefetch as JupyterLab's extension would (through the
server's own writer of ``server.json``, :meth:`ServerState.prefetch`, which the server's
``POST /api/vgpu/kernels/<id>/prefetch`` calls), waits S seconds, then sends the cell.
``prefetched`` counts the cells whose kernel was away when the edit began and back on
the card when the cell was sent.

``--gpus N`` shares the host's first N cards: session i is on card i mod N (its slice
there, ``CUDA_VISIBLE_DEVICES`` its card), and static partitioning fills every card.
``--first-gpu F`` starts at card F, so that runs of several seeds go side by side on one
host, each with its own arbiter managing its own cards; they share the host's memory and
cores (``host_used_peak_bytes`` is the host's, all runs together).

The calibration also times the working set's first pause (``cold_pause``: ``cold_s``) beside
a second one (``warm_s``); the first comes once the idle kernel has pinned its host memory
ahead (``VGPUKernel.prepare_pinned``; ``pinned_ahead_s``: from the cell's end until it had).

``--calibration FILE`` takes the solo cell, the static count and the slice from an
earlier output and appends the new runs to it (one call per N on a device with a time
limit per call). A calibration of a smaller card than this one's (an H100's, run on an
H200) keeps the difference out of the kernels' and the arbiter's reach, by ``--card-cap``:

- ``reserve`` (the default): in the arbiter's books alone (``ArbiterApp.card_reserve``,
  ``card_reserve_bytes`` in the row), so that it decides as on the calibration's card.
  The kernels can still allocate the difference: a cell may hold more than the smaller
  card would have given it, and the card then reads as full (free 0) however much is
  taken off it. Where every running cell is granted its whole budget, room is made
  before cells grow and this never shows.
- ``ballast`` (the default with ``--grant-on-demand``): a process outside every server
  holds the difference for real (:func:`ballasts`; ``ballast_bytes`` in the row, NVML's
  figure, its CUDA context included), so that an allocation past the smaller card fails
  in the driver as it would there, and the cell asks to grow. The arbiter sees the whole
  card with the ballast in use; its watermark is moved to what it is on the smaller card
  (:func:`watermark_beside`; ``watermark_here`` in the row). With the books' reserve,
  three runs with growth on demand at 12x had cells whose steps reserve 16 GiB (the
  calibration's ``session_peak_bytes`` less its context), granted about 4.3 GiB as they
  started, grow into the H200's memory unasked (``grown`` 0), and each of 8 prefetches
  that suspended paused kernels for its return was refused after them: the card still
  read full or nearly (seeds 7, 11, 23 at e44a354, ``benchmarks/results/sessions-h100.json``).
``--solo-here`` times five solo cells on this machine's card too (the row's
``solo_here``): the runs are judged against the calibration's solo cell, and this says
how far this card's own differs. Such a row also carries ``compute_share_here``, the
compute-sharing model of its cells with this card's own solo cell: ``compute_share``
takes the calibration's, and a card that runs the cell 3% slower (an H200 kept to an
H100's memory: 1.077 s against 1.046 s) has its cells meet longer and more often, which
that model leaves out (seed 7 at 777869e: p95 3.003 s against 2.829 s).
``--time-slicing FILE`` (``benchmarks/time_slicing.py``'s output for this card) adds
``compute_share_sliced``: the model with time-slicing's own cost, each context's speed
measured by how many share the card (two MLP steps together on an H200: 0.46 each, not
0.5; ``benchmarks/results/time-slicing-h200.json``), so that what is left between a run
and it is the memory path's alone; ``compute_share`` stays the even model, as in every
earlier row.
``--isolation mps`` gives every session an ``mps`` slice and makes its kernel a client of
its card's MPS control daemon, the one the arbiter keeps (the run starts it before any
kernel makes its CUDA context, :func:`mps_daemons`, and stops it at the end), with the
environment the spawner gives such a server (:func:`mps_environment`); the row says
``isolation``. MPS runs the clients' kernels in one context, so cells that meet share
the card without the driver's switches between contexts (``time_slicing.py --mps``: 2
to 4 MLP steps together at 0.98-1.00 of the card, time-sliced 0.91-0.92).
``--turn-wait SECONDS`` sets the arbiter's ``turn_wait`` (cells take turns on a card,
:mod:`jupyter_vgpu.node.turns`; the arbiter's default, 2 s, where not given; 0: off);
where it is not 0 the row carries ``turns`` (the cells that waited,
from the arbiter's decisions) and ``compute_share_turns``, the model with cells taking
turns so (with ``--time-slicing``'s speeds where given): the floor of such a run.

A cell with no reply in 180 s (:data:`STALL_SECONDS`), the setup's included, is a
stall: the run records it in the row's ``stalls`` (the session's state by the arbiter
and by its own report, whether its process lives, the last line the cell printed: a
cell waiting for room says why) and that session sends no more cells; once a setup has
stalled, no more sessions are set up (each would wait as long: the row's
``sessions_set_up`` says how many were). ``--logs DIR`` keeps the arbiter's log, every
kernel's output with the package's log (:data:`KERNEL_LOG`: each pause and resume, each
round of offers of pieces and each piece) and, for each stall, the threads' stacks of
the kernel and of the arbiter (:func:`dump_stacks`) and the arbiter's log so far, and
two kernels' ``/proc/<pid>/smaps`` at the end. Once the first setups are done, the first
session is paused and, with sharing on, must offer its pieces (:func:`first_pause`): a
run whose pauses fail stops there, in a minute, with why.

Usage (GPU machine)::

    python benchmarks/sessions.py --out benchmarks/results/sessions-h100.json
    python benchmarks/sessions.py --workload transformer --think 30 --out sessions-transformer.json
    python benchmarks/sessions.py --calibration sessions-h100.json --sessions 20 --edit-before 2 \
        --out sessions-h100.json
    python benchmarks/sessions.py --workload transformer --same-checkpoint --sessions 44 \
        --calibration sessions-h100.json --share-pieces all --logs logs/ --out sessions-h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from gpu_common import require_gpu  # noqa: E402

from jupyter_vgpu import channel, nvml  # noqa: E402
from jupyter_vgpu.node.app import ArbiterApp  # noqa: E402
from jupyter_vgpu.node.mps import MPSDaemons  # noqa: E402
from jupyter_vgpu.server.state import ServerState  # noqa: E402
from jupyter_vgpu.slice import Slice  # noqa: E402
from jupyter_vgpu.testing import card_holder  # noqa: E402
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess  # noqa: E402
from jupyter_vgpu.testing.compute_share import load_rates, of_cells  # noqa: E402
from jupyter_vgpu.testing.kernel_runner import Kernel  # noqa: E402
from jupyter_vgpu.testing.percentiles import RULE, percentile, percentile_or_none  # noqa: E402
from jupyter_vgpu.testing.preloaded import environment  # noqa: E402
from jupyter_vgpu.testing.waiting import wait_for  # noqa: E402

GiB = 1 << 30
#: What a ballast's first process allocates, bytes, so that NVML shows its CUDA context
#: beside it (:func:`ballasts`)
PROBE_BYTES = 2 << 20

#: The training loop both workloads share: ``train(steps)`` runs ``steps`` steps and
#: keeps each one's seconds in ``step_seconds``; ``{step}`` is the workload's forward and
#: backward pass (indented for the loop).
TRAIN = """
step_seconds = []
def train(steps):
    step_seconds.clear()
    for _ in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
{step}
        opt.step()
        torch.cuda.synchronize()
        step_seconds.append(time.perf_counter() - t)
train(2)
"""

MLP = """
import os, time, torch
torch.manual_seed(int(os.environ.get("SESSION", "0")))
width, layers = {width}, {layers}
blocks = []
for _ in range(layers):
    blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
model = torch.nn.Sequential(*blocks).to("cuda", torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
"""
MLP_STEP = """\
        x = torch.randn({batch}, width, device="cuda", dtype=torch.bfloat16)
        model(x).float().square().mean().backward()"""

LLAMA_CONFIG = dict(
    hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
    num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096,
)  # fmt: skip

TRANSFORMER = """
import os, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(int(os.environ.get("SESSION", "0")))
config = LlamaConfig(**{config!r})
if {checkpoint!r}:  # every session's base weights from one checkpoint
    model = LlamaForCausalLM.from_pretrained({checkpoint!r}, torch_dtype=torch.bfloat16, device_map="cuda")
else:
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 on the card: no fp32 copy on the way
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
class LoRA(torch.nn.Module):
    def __init__(self, base, rank=16):
        super().__init__()
        self.base = base
        like = dict(device="cuda", dtype=base.weight.dtype)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, **like) / rank)
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank, **like))
    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()
if {lora}:
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
trained = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trained, lr=1e-4)
"""
TRANSFORMER_STEP = """\
        ids = torch.randint(0, config.vocab_size, (1, {tokens}), device="cuda")
        model(input_ids=ids, labels=ids).loss.backward()"""


#: With ``--logs``: the package's log of each kernel, into its output (the kernel's log
#: file): what its pauses and resumes did, each round of offers of pieces and each piece.
KERNEL_LOG = """
import logging as _logging, sys as _sys
_heard = _logging.StreamHandler(_sys.__stderr__)
_heard.setFormatter(_logging.Formatter("%(asctime)s %(name)s %(message)s"))
_logging.getLogger("jupyter_vgpu").addHandler(_heard)
_logging.getLogger("jupyter_vgpu").setLevel(_logging.INFO)
_logging.getLogger("jupyter_vgpu.pieces").setLevel(_logging.DEBUG)
"""


def write_checkpoint(folder: Path) -> Path:
    """The transformer's base weights, once, as a Hugging Face checkpoint in ``folder``
    (``save_pretrained``: safetensors, bf16, about 2.2 GB): random weights from seed 0,
    built on the CPU. Returns the folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG)).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def setup_code(args) -> str:
    """The cell that builds a session's working set (``--workload``)."""
    if args.workload == "transformer":
        checkpoint = str(args.checkpoint) if args.same_checkpoint else ""
        return (
            TRANSFORMER.format(lora=args.tune == "lora", config=LLAMA_CONFIG, checkpoint=checkpoint)
            + TRAIN.format(step=TRANSFORMER_STEP.format(tokens=args.tokens))
            + 'print("ready", sum(p.numel() for p in model.parameters()), sum(p.numel() for p in trained))\n'
        )
    return (
        MLP.format(width=args.width, layers=args.layers)
        + TRAIN.format(step=MLP_STEP.format(batch=args.batch))
        + 'print("ready", sum(p.numel() for p in model.parameters()))\n'
    )


def model_of(args) -> dict:
    if args.workload == "transformer":
        config = "TinyLlama-1.1B's: hidden 2048, 22 layers, 32 heads (4 kv), MLP 5632, vocabulary 32000"
        return {
            "workload": "transformer",
            "tune": args.tune,
            "tokens": args.tokens,
            "dtype": "bf16",
            "config": config,
            "same_checkpoint": args.same_checkpoint,
        }
    return {
        "workload": "mlp",
        "width": args.width,
        "layers": args.layers,
        "batch": args.batch,
        "dtype": "bf16",
    }


class Session(Kernel):
    """One kernel, started preloaded, with the arbiter's socket in its environment and a
    channel directory of its own, whose ``server.json`` :attr:`server` writes as its
    server would (the kernel reports its state there: :meth:`report`); ``more_env``: more
    of its environment (:func:`mps_environment`)."""

    def __init__(
        self,
        index: int,
        runtime: Path,
        socket: str,
        gpu_uuid: str,
        log: Path | None = None,
        args: tuple[str, ...] = (),
        more_env: dict[str, str] | None = None,
    ):
        self.channel = runtime / f"channel-{index}"
        self.channel.mkdir(exist_ok=True)  # a second try at starting the kernel finds it
        self.server = ServerState(self.channel, None)  # the arbiter's slice wins over its None
        env = environment(
            JUPYTER_VGPU_ARBITER=socket,
            JUPYTER_VGPU_CHANNEL=str(self.channel),
            CUDA_VISIBLE_DEVICES=gpu_uuid,  # the slice's card only, as the spawner sets it
            SESSION=str(index),
            **(more_env or {}),
        )
        super().__init__(runtime, env, load_extension=True, ready_timeout=120, log=log, args=args)
        self.index = index

    def report(self) -> dict:
        """The kernel's own report (``kernel-<id>.json`` in its channel), or {}."""
        return channel.read_json(channel.kernel_path(self.channel, self.id)) or {}

    def timed(self, code: str, timeout: float = 180) -> tuple[float, str, bool]:
        """``(seconds, output, failed)`` of one cell."""
        out: list[str] = []
        failed = False

        def hook(msg):
            nonlocal failed
            c, kind = msg["content"], msg["header"]["msg_type"]
            if kind == "stream":
                out.append(c["text"])
            elif kind == "error":
                failed = True
                out.append(f"{c['ename']}: {c['evalue']}")

        t0 = time.perf_counter()
        try:
            reply = self.client.execute_interactive(code, output_hook=hook, timeout=timeout)
        except TimeoutError:
            raise Stalled("".join(out)) from None
        failed = failed or reply["content"]["status"] != "ok"
        return time.perf_counter() - t0, "".join(out), failed


class Stalled(TimeoutError):
    """A cell gave no reply in time. ``said``: what it printed meanwhile (a cell that
    waits before its code runs says why on one line, updated each second)."""

    def __init__(self, said: str):
        super().__init__("no reply in time")
        self.said = said


class HostMemory:
    """The host's peak memory in use (``MemTotal - MemAvailable`` of /proc/meminfo, bytes),
    sampled every 0.5 s in a thread."""

    def __init__(self):
        self.total = self._read()["MemTotal"]
        self.peak_used = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> dict[str, int]:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}

    def _run(self) -> None:
        while not self._done.wait(0.5):
            info = self._read()
            self.peak_used = max(self.peak_used, info["MemTotal"] - info["MemAvailable"])

    def start(self) -> HostMemory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


#: What a run counts from the arbiter's Prometheus counters, by the counter's sample name
#: (``node/metrics.py``) and the labels a sample must have.
COUNTERS = {
    "pauses": ("jupyter_vgpu_pauses_total", {}),
    "suspends": ("jupyter_vgpu_suspends_total", {}),
    "releases": ("jupyter_vgpu_releases_total", {}),
    "spills": ("jupyter_vgpu_spills_total", {}),
    "prefetches": ("jupyter_vgpu_prefetches_total", {"outcome": "granted"}),
}


def counts_from_metrics(text: str) -> dict[str, int]:
    """The run's pauses, suspends, spills and granted prefetches from the arbiter's
    ``/metrics`` page (Prometheus text format, read by ``prometheus_client``'s parser):
    every one since the arbiter started, which its decision log (the last
    ``decisions.KEPT``) cannot say for a long run."""
    from prometheus_client.parser import text_string_to_metric_families

    counts = dict.fromkeys(COUNTERS, 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for what, (name, labels) in COUNTERS.items():
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    counts[what] += int(sample.value)
    return counts


def watermark_beside(watermark: float, card: int, ballast: int, total: int) -> float:
    """The arbiter's watermark on a card of ``total`` bytes where a ballast process holds
    ``ballast`` bytes, so that it stands where ``watermark`` stands on a card of ``card``
    bytes (the calibration's): the arbiter compares NVML's memory in use, the ballast's
    included, with the watermark's share of the whole card, so ``used - ballast <=
    watermark * card`` reads ``used <= (watermark * card + ballast) / total``.

    Raises:
        ValueError: ``total`` is not more than ``ballast``, or the result is not in (0, 1].
    """
    if total <= ballast:
        raise ValueError(f"a ballast of {ballast} bytes leaves nothing of a card of {total}")
    here = (watermark * card + ballast) / total
    if not 0 < here <= 1:
        raise ValueError(f"watermark {watermark} of {card} bytes beside {ballast} of {total}: {here:.3f}")
    return here


@contextlib.contextmanager
def ballasts(uuids: list[str], nbytes: int):
    """A process outside every server on each card of ``uuids`` holding ``nbytes`` bytes
    of it, its CUDA context included (a first process's context is measured and taken off
    what the ballast allocates), until the block ends (``--card-cap ballast``); yields
    what NVML shows each holding, bytes, in the order of ``uuids``.

    Raises:
        AssertionError: a card could not give the ballast its bytes
            (:func:`jupyter_vgpu.testing.card_holder.hold`).
        RuntimeError: NVML shows no per-process figure for the ballast.
    """
    held: list[subprocess.Popen] = []
    try:
        figures = []
        for uuid in uuids:
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid}
            probe = card_holder.hold(PROBE_BYTES, env=env)
            try:
                context = nvml.process_memory(uuid).get(probe.pid, PROBE_BYTES) - PROBE_BYTES
            finally:
                probe.stdin.close()
                probe.wait(30)
            held.append(card_holder.hold(max(0, nbytes - context), env=env))
            figures.append(nvml.process_memory(uuid).get(held[-1].pid, 0))
            if not figures[-1]:  # the arbiter's books need NVML's per-process figures as much
                raise RuntimeError(f"NVML shows no memory of the ballast's process on {uuid}")
        yield figures
    finally:
        for process in held:
            process.stdin.close()
            process.wait(30)


def start_arbiter(directory: Path, args, watermark: float | None = None) -> ArbiterProcess:
    """An arbiter with the run's settings, its Prometheus counters served on a free port
    of 127.0.0.1 (``metrics_port`` on the returned process); ``watermark``: its watermark
    where it is not ``args.watermark`` (:func:`watermark_beside`)."""
    with socket.socket() as s:  # a port free now; the arbiter binds it as it starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = [
        "--ArbiterApp.poll_seconds=0.25",
        f"--ArbiterApp.watermark={args.watermark if watermark is None else watermark}",
        f"--ArbiterApp.suspend_after={args.suspend_after}",
        f"--ArbiterApp.metrics_port={port}",
    ]
    if args.host_memory_limit:
        settings.append(f"--ArbiterApp.host_memory_limit={args.host_memory_limit}")
    if args.card_reserve:
        settings.append(f"--ArbiterApp.card_reserve={args.card_reserve}")
    settings.append(f"--ArbiterApp.share_pieces={args.share_pieces}")
    settings.append(f"--ArbiterApp.room_ahead={args.room_ahead == 'on'}")
    settings.append(f"--ArbiterApp.room_held_seconds={args.room_held_seconds}")
    settings.append(f"--ArbiterApp.trim_before_spill={args.trim_before_spill == 'on'}")
    settings.append(f"--ArbiterApp.even_contexts={args.node_even_contexts}")
    settings.append(f"--ArbiterApp.grant_on_demand={args.grant_on_demand}")
    settings.append(f"--ArbiterApp.grant_margin={args.grant_margin}")
    settings.append(f"--ArbiterApp.suspend_wait={args.suspend_wait}")
    settings.append(f"--ArbiterApp.turn_wait={args.turn_wait}")
    settings.append(f"--ArbiterApp.release_first={args.release_first}")
    # every decision of a run in its row (benchmarks/sessions_tail.py reads them all)
    settings.append(f"--ArbiterApp.decisions_kept={DECISIONS_KEPT}")
    # this run's cards alone: runs on other cards of the host (--first-gpu) are not its own
    settings += [f"--ArbiterApp.managed_gpus={uuid}" for uuid in args.gpu_uuids]
    arbiter = ArbiterProcess(directory, *settings).start()
    arbiter.metrics_port = port
    return arbiter


def arbiter_counts(arbiter: ArbiterProcess) -> dict[str, int]:
    """:func:`counts_from_metrics` of the arbiter's page now."""
    with urllib.request.urlopen(f"http://127.0.0.1:{arbiter.metrics_port}/metrics", timeout=10) as r:
        return counts_from_metrics(r.read().decode())


def process_figures(books: dict) -> dict:
    """Each kernel process's own host memory from the arbiter's books (its ``process``
    figures: read from /proc by the arbiter every ``process_memory_seconds``, not said by
    the kernel): ``{"kernels": measured, "pss_bytes": {"mean", "max", "sum"},
    "anon_bytes": {...}, "rss_bytes": {...}}``. PSS summed is what the kernels take from
    the host together (their shared library pages counted once); RSS summed counts those
    pages in every kernel. Each is None when no kernel was measured."""
    seen = [k["process"] for k in books["kernels"] if k.get("process")]
    out: dict = {"kernels": len(seen)}
    for key in ("pss_bytes", "anon_bytes", "rss_bytes"):
        values = [p[key] for p in seen if p.get(key) is not None]
        out[key] = (
            {"mean": sum(values) // len(values), "max": max(values), "sum": sum(values)} if values else None
        )
    return out


def run_sessions(n: int, args, slices: list[Slice], solo_steps: int, together: int) -> dict:
    """N sessions, session i on card ``i % len(slices)`` with that card's slice; ``together``
    of them set up at once."""
    on = args.gpu_uuids if args.ballast else []  # --card-cap ballast: each card kept to the calibration's
    with tempfile.TemporaryDirectory() as tmp, ballasts(on, args.ballast) as held:
        tmp = Path(tmp)
        watermark = None
        if held:  # the arbiter's watermark where it is on the calibration's card
            # the ballast is the card less the calibration's: the two make the whole card
            watermark = watermark_beside(args.watermark, args.card, held[0], args.card + args.ballast)
        arbiter = start_arbiter(tmp, args, watermark)
        socket = str(arbiter.socket)
        sessions: list[Session] = []
        daemons = contextlib.ExitStack()  # --isolation mps: the cards' MPS daemons
        try:
            pipes = daemons.enter_context(mps_daemons(args, socket, [s.gpu_uuid for s in slices]))
            started: queue.Queue[Session] = queue.Queue()
            failed: queue.Queue[str] = queue.Queue()

            def start(i: int, tries: int = 3) -> None:
                # Kernels started at once can pick the same free TCP port (jupyter_client
                # finds one, the kernel binds it later): such a kernel dies before its
                # kernel_info reply, and a new start picks new ports.
                log = args.logs / f"kernel-{i}.log" if args.logs else None
                for left in range(tries - 1, -1, -1):
                    try:
                        slice_ = slices[i % len(slices)]
                        more_env = mps_environment(slice_, pipes)
                        started.put(
                            Session(i, tmp, socket, slice_.gpu_uuid, log, kernel_settings(args), more_env)
                        )
                        return
                    except RuntimeError as e:
                        if left == 0:
                            failed.put(f"session {i}: {e}")

            starters = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(n)]
            for t in starters:
                t.start()
            # each start is bounded (three tries of 120 s for its kernel_info reply): one
            # still going well past that is stuck, and says where before the run gives up
            deadline = time.monotonic() + START_SECONDS
            for t in starters:
                t.join(max(0.0, deadline - time.monotonic()))
            stuck = [t for t in starters if t.is_alive()]
            if stuck:
                faulthandler.dump_traceback(all_threads=True)
                raise RuntimeError(
                    f"{len(stuck)} of {n} kernel starts still going after {START_SECONDS:.0f} s"
                )
            sessions = sorted(started.queue, key=lambda s: s.index)
            if len(sessions) < n:
                raise RuntimeError(f"{n - len(sessions)} of {n} kernels did not start: {list(failed.queue)}")
            with arbiter.control() as control:
                for s in sessions:
                    control.register(s.pid, f"user{s.index}", "", slices[s.index % len(slices)])
            setup = (KERNEL_LOG if args.logs else "") + setup_code(args)
            failures: list[bool] = []
            stalls: list[dict] = []

            def set_up(s: Session) -> None:
                start = time.time()
                try:
                    failures.append(s.timed(setup, timeout=STALL_SECONDS)[2])
                except Stalled as e:  # no cells for it: they would queue behind this one
                    stalls.append(stall_of(s, None, start, arbiter, args.logs, e.said))

            # as many at a time as fit beside every session's CUDA context: each setup is a
            # cell that asks for room (more at once would have the arbiter suspend kernels
            # to free contexts before the first cell)
            done_setups: list[Session] = []
            for batch in range(0, n, together):
                if stalls:  # the node made no room for a setup: later ones would wait as long
                    break
                setups = [
                    threading.Thread(target=set_up, args=(s,)) for s in sessions[batch : batch + together]
                ]
                for t in setups:
                    t.start()
                for t in setups:
                    t.join()
                done_setups.extend(sessions[batch : batch + together])
                if batch == 0 and not stalls:
                    first_pause(sessions[0], arbiter, args.share_pieces)
            ooms = sum(failures)
            evened = None
            if args.even_contexts:
                from jupyter_vgpu.host import checkpoint

                evened = even_contexts([s.pid for s in done_setups], checkpoint)
                print(f"contexts evened: {evened}", flush=True)
            cells: queue.Queue[dict] = queue.Queue()
            errors: list[str] = []
            working = {s.index for s in done_setups} - {st["session"] for st in stalls}
            cell = (
                f"_t = time.perf_counter()\ntrain({solo_steps})\n"
                "print('inner', time.perf_counter() - _t, 'steps', *step_seconds)"
            )

            def state_of(pid: int) -> str:
                return next((k["state"] for k in arbiter.books()["kernels"] if k["pid"] == pid), "unknown")

            edit = min(args.edit_before, args.think)
            phases = random.Random(args.seed)  # the same seed, the same first sends
            first = {s.index: phases.uniform(0, args.think + args.cell_seconds) for s in sessions}

            def duty(s: Session) -> None:
                if s.index not in working:
                    return
                time.sleep(first[s.index])
                for cycle in range(args.cycles):
                    if cycle:
                        time.sleep(args.think - edit)
                    at_edit = None
                    if edit:  # the user clicks into the cell and types: JupyterLab asks ahead
                        at_edit = state_of(s.pid)
                        s.server.prefetch(s.id)
                        time.sleep(edit)
                    before = state_of(s.pid)
                    start = time.time()
                    try:
                        seconds, out, failed = s.timed(cell, timeout=STALL_SECONDS)
                    except Stalled as e:  # its next cells would queue behind this one
                        stalls.append(stall_of(s, cycle, start, arbiter, args.logs, e.said))
                        return
                    if failed:
                        errors.append(out[-500:])
                    else:
                        inner, steps = out.split("inner")[-1].split("steps")
                        cells.put({
                            "session": s.index, "start": start, "state_at_edit": at_edit,
                            "state_before": before, "cell_s": seconds, "inner_s": float(inner),
                            "step_s": [float(v) for v in steps.split()],
                        })  # fmt: skip

            threads = [threading.Thread(target=duty, args=(s,)) for s in sessions]
            t0 = time.time()
            host = HostMemory().start()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            host.stop()
            detail = list(cells.queue)
            latencies = sorted(c["cell_s"] for c in detail)
            books = arbiter.books()
            counted = arbiter_counts(arbiter)
            outside: dict[str, list[float]] = {}
            for c in detail:  # time outside the cell's own code: waiting for room, resuming
                outside.setdefault(c["state_before"], []).append(c["cell_s"] - c["inner_s"])
            away = ("paused", "suspended")
            return {
                "sessions": n,
                "workload": args.workload,
                "edit_before_s": edit,
                "cells": len(latencies),
                "p50_cell_s": percentile_or_none(latencies, 50),
                "p95_cell_s": percentile_or_none(latencies, 95),
                "p99_cell_s": percentile_or_none(latencies, 99),
                "prefetched": sum(
                    c["state_at_edit"] in away and c["state_before"] not in away for c in detail
                ),
                "prefetches": counted["prefetches"],
                "p50_inner_s": percentile_or_none((c["inner_s"] for c in detail), 50),
                "p50_outside_s_by_state_before": {k: percentile(v, 50) for k, v in outside.items()},
                "cells_by_state_before": {k: len(v) for k, v in outside.items()},
                "ooms": ooms + sum("OutOfMemory" in e or "MemoryError" in e for e in errors),
                "errors": errors[:5],
                # cells with no reply in STALL_SECONDS: each session's first (it did no more)
                "stalls": stalls,
                # sessions whose setup ended in time; once one stalls, no more are set up
                "sessions_set_up": len(working),
                "wall_s": time.time() - t0,
                "pauses": counted["pauses"],
                "suspends": counted["suspends"],
                "spills": counted["spills"],
                "releases": counted["releases"],  # --release-first: caches given back instead
                # within the decisions the arbiter kept (decisions_kept, the latest)
                # releases that gave back nothing: a kernel's cached figure past what
                # empty_cache frees (306 of 374 at f922f59, before the figure was mended)
                "releases_empty": sum(
                    d["what"] == "release" and not d.get("released") for d in books["decisions"]
                ),
                "queued": sum(d["what"] == "queued" for d in books["decisions"]),
                "trims": sum(d["what"] == "trim" for d in books["decisions"]),
                "decisions_kept": len(books["decisions"]),
                "counted": "pauses, suspends, spills, releases, prefetches: the arbiter's Prometheus "
                "counters over the whole run, setups included; releases_empty, queued, trims: in "
                "decisions_kept",
                "host_used_peak_bytes": host.peak_used,
                "host_total_bytes": host.total,
                # each kernel process's own host memory at the end, by the arbiter's books
                "kernel_processes": process_figures(books),
                # the node's paused pieces held once at the end (issue 42): what the
                # kernels reference, what is held, and the node's host use counting each once
                "shared_pieces": {k: v for k, v in books["shared_pieces"].items() if k != "by_pid"},
                "node_host_used_bytes": books["node"]["host_used"],
                "even_contexts": evened,  # --even-contexts: each kernel's context cycled once
                # --node-even-contexts: the arbiter's own, from its decisions (all kept)
                "node_even_contexts": node_evened(books["decisions"]) if args.node_even_contexts else None,
                # --grant-on-demand: the cells' requests to grow the arbiter granted
                "grown": grown(books["decisions"]) if args.grant_on_demand else None,
                # --suspend-wait: the cells that waited for a running cell instead of suspends
                "waited_for_a_cell": waited_for_a_cell(books["decisions"]) if args.suspend_wait else None,
                # --turn-wait: the cells that waited their turn, and how long (in decisions_kept)
                "turns": turns_taken(books["decisions"]) if args.turn_wait else None,
                # --card-cap ballast: what each card's ballast held (NVML), the watermark beside it
                "card_cap": args.card_cap,
                "ballast_bytes": held or None,
                "watermark_here": watermark,
                "cells_detail": sorted(detail, key=lambda c: c["start"]),
                "decisions": [
                    d for d in books["decisions"] if d["what"] not in ("kernel joined", "kernel left")
                ],
            }
        finally:
            if args.logs:  # where two kernels' own host memory goes, mapping by mapping
                for s in sessions[:1] + sessions[len(sessions) // 2 :][:1]:
                    with contextlib.suppress(OSError):
                        shutil.copy(f"/proc/{s.pid}/smaps", args.logs / f"smaps-kernel-{s.index}.txt")
            for s in sessions:
                s.shutdown()
            daemons.close()
            arbiter.stop()
            if args.logs:
                shutil.copy(arbiter.log_path, args.logs / f"arbiter-{n}.log")


class PauseBroken(RuntimeError):
    """The first session set up could not be paused, or offered none of its pieces with
    sharing on: every later figure of the run would measure that, not the node."""


def even_contexts(pids: list[int], checkpoint) -> dict:
    """Checkpoint and restore each process of ``pids`` once, one after the other, through
    the driver (``checkpoint``: :mod:`jupyter_vgpu.host.checkpoint`), behind the arbiter's
    back: ``--even-contexts``, an experiment, not something the node does. Every context
    on the card is then of the kind the driver restored, which the steps of the eighth to
    eleventh tries found taking about three quarters of the card beside one that never
    left it (``sessions_tail.py``, ``steps_by_pair``; docs/design.md, the eleventh try).
    A process the driver refuses (the arbiter moving it at that moment, say) stays as it
    was: ``checkpoint.suspend`` restores and unlocks what it locked before it raises.

    Returns:
        ``{"cycled": count, "refused": [message, ...], "seconds": total}``.
    """
    t0 = time.monotonic()
    cycled, refused = 0, []
    for pid in pids:
        try:
            checkpoint.suspend(pid)
            checkpoint.restore(pid)
            cycled += 1
        except checkpoint.CheckpointError as e:
            refused.append(f"{pid}: {e}")
    return {"cycled": cycled, "refused": refused, "seconds": round(time.monotonic() - t0, 3)}


def node_evened(decisions: list[dict]) -> dict:
    """What the arbiter's ``even_contexts`` did in a run, from its decisions: how many
    contexts went through the driver and back (``evened``, with the seconds each took at
    the median, :data:`RULE`), how many the driver refused, how many were left suspended
    for their next cell (``restore_waits``)."""
    seconds = [d["seconds"] for d in decisions if d["what"] == "evened"]
    return {
        "evened": len(seconds),
        "p50_s": percentile_or_none(seconds, 50),
        "refused": sum(d["what"] == "even refused" for d in decisions),
        "restore_waits": sum(d["what"] == "even: restore waits" for d in decisions),
    }


def grown(decisions: list[dict]) -> dict:
    """What growth granted on demand took in a run, from the arbiter's decisions: how many
    requests of running cells to grow it granted (``grown``), the seconds each waited for
    its room at the median and at the most (:data:`RULE`), and the bytes asked for in all."""
    seconds = [d["seconds"] for d in decisions if d["what"] == "grown"]
    return {
        "grown": len(seconds),
        "p50_s": percentile_or_none(seconds, 50),
        "max_s": max(seconds, default=None),
        "bytes": sum(d["bytes"] for d in decisions if d["what"] == "grown"),
    }


#: What the arbiter says of a cell that waits for a running cell rather than suspending
#: paused kernels (``ArbiterApp.suspend_wait``; :class:`jupyter_vgpu.node.room._ForACell`)
WAITED_FOR_A_CELL = "running cell(s) to end"


def waited_for_a_cell(decisions: list[dict]) -> dict:
    """The cells of a run that waited for a running cell to end rather than have paused
    kernels suspended for their room (``--suspend-wait``), from the arbiter's ``queued``
    decisions: how many, and whose (their servers, in order; each cell's time outside its
    code is in ``cells_detail``)."""
    servers = [d["server"] for d in decisions if d["what"] == "queued" and WAITED_FOR_A_CELL in d["message"]]
    return {"cells": len(servers), "servers": servers}


def turns_taken(decisions: list[dict]) -> dict:
    """The cells of a run that waited their turn (``--turn-wait``), from the arbiter's
    ``turn`` decisions: how many, how many then ran beside running cells (their wait ran
    out, or the cells running turned long), and their waits at p50 and p95 (seconds,
    NumPy's rule; None without any)."""
    turns = [d for d in decisions if d["what"] == "turn"]
    waits = [d["seconds"] for d in turns]
    return {
        "cells": len(turns),
        "ran_beside": sum(
            "wait ran out" in d["message"] or "runs beside them" in d["message"] for d in turns
        ),
        "p50_s": percentile_or_none(waits, 50),
        "p95_s": percentile_or_none(waits, 95),
    }


def first_pause(s: Session, arbiter: ArbiterProcess, share_pieces: str) -> None:
    """Pause session ``s`` (the first set up) by ``%vgpu pause`` before the run goes on,
    and, with ``share_pieces`` not ``off``, wait for its pieces to be offered to the node;
    its first cell brings it back as any paused session's does. A run of 44 sessions once
    spent 9 minutes of a GPU on pauses that all failed (`KeyError`, undone) and offered no
    piece; this finds that in a minute.

    Raises:
        PauseBroken: not paused in 60 s (with the arbiter's and the kernel's last word on
            it), or, sharing on, no piece offered in 120 s (with the kernel's figures).
    """
    s.timed("%vgpu pause")
    try:
        wait_for(lambda: s.report().get("state") == "paused", 60, f"session {s.index} paused by %vgpu pause")
    except AssertionError as e:
        said = [d for d in arbiter.books()["decisions"] if d.get("pid") == s.pid and "refused" in d["what"]]
        raise PauseBroken(f"{e}; the arbiter: {said[-1:]}; the kernel: {s.report().get('pause')}") from None
    if share_pieces == "off":
        return
    try:
        wait_for(
            lambda: s.report().get("pause", {}).get("shared", {}).get("offered", 0) > 0,
            120,
            f"session {s.index}'s paused pieces offered to the node",
        )
    except AssertionError as e:
        raise PauseBroken(f"{e}; the kernel: {s.report().get('pause', {}).get('shared')}") from None


#: Seconds a run waits for a cell's reply before it counts a stall.
STALL_SECONDS = 180.0
#: Decisions the run's arbiter keeps for its books, so that a row holds the whole run's:
#: with the arbiter's default of 200, 48 sessions at 12x lost their first cells' decisions
#: (``cells_not_covered`` 13 and 7 in ``benchmarks/results/cell-tails-h100.json``, 52d113a).
DECISIONS_KEPT = 5000
#: Seconds the sessions' kernels may take to start, all of them at once.
START_SECONDS = 600.0


def stall_of(
    s: Session, cycle: int | None, start: float, arbiter: ArbiterProcess, logs: Path | None, said: str = ""
) -> dict:
    """What a stalled cell (no reply in :data:`STALL_SECONDS`) left to see: its cycle
    (None: the session's setup), the session's state by the arbiter's books and by its own
    report, whether its process lives, the last line the cell printed (why it waits, where
    it waits for room), and (with ``--logs``) the stacks of its threads and the arbiter's
    and the arbiter's log so far, in files there."""
    entry = arbiter.kernel(s.pid) or {}
    report = s.report()
    stacks = None
    if logs:
        stacks = [dump_stacks(pid, logs / f"stacks-{who}.txt") for pid, who in
                  ((s.pid, f"kernel-{s.index}"), (arbiter.process.pid, f"arbiter-at-{s.index}"))]  # fmt: skip
        shutil.copy(arbiter.log_path, logs / f"arbiter-at-{s.index}.log")  # the run may never end
    lines = [line for line in said.replace("\r", "\n").splitlines() if line.strip()]
    return {
        "session": s.index,
        "cycle": cycle,
        "said": lines[-1][-500:] if lines else None,
        "sent_at": start,
        "arbiter_state": entry.get("state"),
        "kernel_state": report.get("state"),
        "alive": s.manager.is_alive(),
        "stacks": stacks,
    }


def dump_stacks(pid: int, path: Path) -> str:
    """Every thread's stack of process ``pid`` into ``path``: Python and native frames by
    ``py-spy dump --native`` where it is installed, and each thread's name, state and
    kernel wait channel from /proc (``man 5 proc``) in any case. Returns ``path``'s name."""
    lines = []
    for task in sorted(Path(f"/proc/{pid}/task").glob("*")):
        try:
            stat = (task / "stat").read_text()
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :]
        lines.append(f"{task.name} {name!r} state {rest.split()[0]} wchan {wchan}")
    spy = shutil.which("py-spy")
    if spy:
        done = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        lines += [done.stdout, done.stderr]
    path.write_text("\n".join(lines))
    return path.name


def kernel_settings(args) -> tuple[str, ...]:
    """The kernels' command-line settings of this run (``--local-memory``)."""
    return (f"--VGPUKernel.give_back_local_memory={args.local_memory}",)


@contextlib.contextmanager
def mps_daemons(args, socket: str, uuids: list[str]):
    """With ``--isolation mps``, the MPS control daemon of each card of ``uuids`` where the
    arbiter on ``socket`` keeps it (:class:`jupyter_vgpu.node.mps.MPSDaemons`), started
    before any kernel of the run makes its CUDA context (the arbiter, starting one in the
    background as a kernel's ``mps`` slice registers, finds it answering) and stopped
    after the block (daemons outlive their arbiter). Yields ``{uuid: pipe directory}``,
    empty without ``--isolation mps``. Raises MPSUnavailable (a daemon did not start)."""
    if args.isolation != "mps":
        yield {}
        return
    daemons = MPSDaemons(socket)
    try:
        for uuid in dict.fromkeys(uuids):
            daemons.ensure(uuid)
        yield {uuid: str(daemons.directories(uuid)[0]) for uuid in uuids}
    finally:
        for uuid in list(daemons.started):
            daemons.stop(uuid)


def mps_environment(slice_: Slice, pipes: dict[str, str]) -> dict[str, str]:
    """A kernel's environment for ``slice_`` beyond :class:`Session`'s own, as the spawner
    gives a server of an ``mps`` slice: its daemon's pipe directory
    (``CUDA_MPS_PIPE_DIRECTORY``) and MPS's client limits from the slice
    (:meth:`Slice.environment`); empty where ``pipes`` (:func:`mps_daemons`) is."""
    if not pipes:
        return {}
    limits = {k: v for k, v in slice_.environment().items() if k.startswith("CUDA_MPS_")}
    return {**limits, "CUDA_MPS_PIPE_DIRECTORY": pipes[slice_.gpu_uuid]}


@contextlib.contextmanager
def solo_session(args, gpu):
    """One session alone on ``gpu``, its slice the whole card, its working set built
    (``--workload``): yields the session; its arbiter and kernel end after."""
    card = gpu.memory_total
    probe = Slice(
        gpu.uuid, gpu.index, gpu.name, card, card, 100, placement="binpack", isolation=args.isolation
    )
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        tmp = Path(tmp)
        arbiter = start_arbiter(tmp, args)
        stack.callback(arbiter.stop)  # after the daemons: their clients end first
        pipes = stack.enter_context(mps_daemons(args, str(arbiter.socket), [gpu.uuid]))
        s = Session(
            0,
            tmp,
            str(arbiter.socket),
            gpu.uuid,
            args=kernel_settings(args),
            more_env=mps_environment(probe, pipes),
        )
        try:
            with arbiter.control() as control:
                control.register(s.pid, "solo", "", probe)
            s.timed(setup_code(args))
            yield s
        finally:
            s.shutdown()


def solo_here(args, gpu, steps: int) -> dict:
    """Five solo cells of ``steps`` steps on this machine's card, with a calibration made
    on another (an H200 standing in for the H100): what a cell takes alone here, beside
    the calibration's figure the runs are judged against. Returns ``gpu`` (its name),
    ``solo_cells_s`` (sorted, seconds) and ``solo_p50_cell_s``."""
    with solo_session(args, gpu) as s:
        s.timed(f"train({steps})")  # warm, as the calibration's
        cells = sorted(s.timed(f"train({steps})")[0] for _ in range(5))
    return {"gpu": gpu.name, "solo_cells_s": cells, "solo_p50_cell_s": percentile(cells, 50)}


def calibrate(args, gpu) -> dict:
    """The solo cell on the empty card: steps for about ``--cell-seconds``, its latency,
    the session's peak and working set, and the static count they give."""
    card = gpu.memory_total
    with solo_session(args, gpu) as s:
        seconds, _, _ = s.timed("train(4)")
        steps = max(1, round(4 * args.cell_seconds / seconds))
        s.timed(f"train({steps})")
        solo = sorted(s.timed(f"train({steps})")[0] for _ in range(5))
        peak = nvml.process_memory(gpu.uuid).get(s.pid, 0)
        code = "c = torch.cuda\nprint(c.max_memory_reserved(), c.memory_reserved(), c.memory_allocated())"
        _, out, _ = s.timed(code)
        max_reserved, idle_reserved, allocated = (int(v) for v in out.split())
        # the first pause, once the idle kernel has pinned its host memory ahead
        # (VGPUKernel.prepare_pinned, after prepare_after seconds idle)
        t = time.perf_counter()
        wait_for(
            lambda: s.report().get("pause", {}).get("pinned_bytes", 0) >= allocated,
            300,
            "the idle session to pin its working set's host memory ahead",
        )
        ahead = time.perf_counter() - t
        cold = pause_seconds(s)
        s.timed("train(1)")  # back
        warm = pause_seconds(s)
    context = peak - idle_reserved  # CUDA context, cuBLAS workspaces: outside PyTorch's pools
    session_peak = max_reserved + context
    return {
        "card_bytes": card,
        "working_set_bytes": allocated,
        "session_peak_bytes": session_peak,
        "context_bytes": context,
        "static_sessions": int(card // session_peak),
        "budget_bytes": min(card, max_reserved + (1 << 30)),
        "solo_cell_s": percentile(solo, 50),
        "solo_cells_s": solo,
        "steps_per_cell": steps,
        "model": model_of(args),
        "cold_pause": {"gpu_bytes": cold[1], "cold_s": cold[0], "warm_s": warm[0], "pinned_ahead_s": ahead},
    }


def pause_seconds(s: Session) -> tuple[float, int]:
    """``(seconds, bytes released)`` of the kernel's pause after a ``%vgpu pause`` cell, by
    its own report."""
    s.timed("%vgpu pause")
    wait_for(lambda: s.report().get("state") == "paused", 300, f"session {s.index} paused by %vgpu pause")
    pause = s.report()["pause"]
    return pause["last_pause_seconds"], pause["paused_bytes"]


def main() -> None:
    # ``kill -USR1`` prints every thread's stack to stderr: a run that hangs says where
    # (seed 11 beside two others on one host once stopped with its 48 kernels started)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1, help="cards of this host to share (sessions spread)")
    parser.add_argument(
        "--first-gpu",
        type=int,
        default=0,
        help="the first of them, by NVML index (runs side by side on one host, each on its own cards: "
        "its arbiter manages only these; the host's memory and cores are shared)",
    )
    parser.add_argument("--workload", choices=("mlp", "transformer"), default="mlp")
    parser.add_argument("--tune", choices=("lora", "full"), default="lora", help="the transformer's steps")
    parser.add_argument("--tokens", type=int, default=2048, help="the transformer's tokens per step")
    parser.add_argument(
        "--same-checkpoint",
        action="store_true",
        help="the transformer: every session loads the same base weights from one checkpoint",
    )
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=61440, help="tokens per step")
    parser.add_argument(
        "--think", type=float, help="idle seconds between two cells (default 90, or the calibration's)"
    )
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--sessions", default="", help="N to try, e.g. 6,12,24 (default: --multiples)")
    parser.add_argument(
        "--multiples", default="1,2,3,4", help="N to try as multiples of the static partitioning's count"
    )
    parser.add_argument("--cell-seconds", type=float, default=1.0, help="length of a cell on an empty card")
    parser.add_argument("--idle-seconds", type=float, default=5.0, help="the slice's idle_seconds")
    parser.add_argument(
        "--watermark", type=float, default=0.6, help="the arbiter's background-pause watermark"
    )
    parser.add_argument(
        "--room-ahead",
        choices=("on", "off"),
        default="on",
        help="the arbiter's room_ahead: a prefetch makes its cell's room too (on, its default)",
    )
    parser.add_argument(
        "--room-held-seconds",
        type=float,
        default=0.0,
        help="the arbiter's room_held_seconds: how long a prefetch holds its cell's room (default 0: none)",
    )
    parser.add_argument(
        "--trim-before-spill",
        choices=("on", "off"),
        default="on",
        help="the arbiter's trim_before_spill: warm slabs go before paused data moves to disk (default on)",
    )
    parser.add_argument(
        "--even-contexts",
        action="store_true",
        help="an experiment: once every session is set up, checkpoint and restore each kernel's "
        "process through the driver, so that every context on the card is of the kind a "
        "suspend's restore leaves (the row's even_contexts says how many and how long)",
    )
    parser.add_argument(
        "--grant-on-demand",
        action="store_true",
        help="the arbiter's grant_on_demand: a starting cell is granted what its kernel holds and "
        "brings back plus --grant-margin, the rest made when it grows (the row's grown says how often)",
    )
    parser.add_argument(
        "--suspend-wait",
        type=float,
        default=ArbiterApp.suspend_wait.default_value,
        help="the arbiter's suspend_wait: seconds a cell whose room would need paused kernels "
        "suspended waits for a running cell on its card to end first (default: the "
        "arbiter's, %(default)s; 0: it does not)",
    )
    parser.add_argument(
        "--turn-wait",
        type=float,
        default=ArbiterApp.turn_wait.default_value,
        help="the arbiter's turn_wait: seconds a cell waits for the cells running on its card to "
        "end before it starts beside them (default: the arbiter's, %(default)s; 0: off); where not 0 "
        "the row carries compute_share_turns, the model with cells taking turns so",
    )
    parser.add_argument(
        "--release-first",
        action=argparse.BooleanOptionalAction,
        default=ArbiterApp.release_first.default_value,
        help="the arbiter's release_first: idle kernels give back their cached free blocks for "
        "a cell's room where those cover it, before anyone is paused (the row's releases say how "
        "often; default: the arbiter's, %(default)s)",
    )
    parser.add_argument(
        "--isolation",
        choices=("time-slicing", "mps"),
        default="time-slicing",
        help="the slices' isolation backend: mps makes every kernel a client of its card's MPS "
        "daemon (started by the run where the arbiter keeps it; kernels' steps then share the "
        "card without the driver's switches between contexts, benchmarks/time_slicing.py --mps)",
    )
    parser.add_argument(
        "--local-memory",
        action="store_true",
        help="the kernels' give_back_local_memory: a pause gives back the CUDA context's "
        "local memory too, a resume takes it back first",
    )
    parser.add_argument(
        "--card-cap",
        choices=["reserve", "ballast"],
        default=None,
        help="how a calibration's smaller card is kept on a larger one: in the arbiter's books "
        "(reserve; the default) or by a process holding the rest for real (ballast; the default "
        "with --grant-on-demand, whose cells ask to grow only where the driver refuses them)",
    )
    parser.add_argument(
        "--grant-margin", default="1G", help="the arbiter's grant_margin, with --grant-on-demand (default 1G)"
    )
    parser.add_argument(
        "--node-even-contexts",
        action="store_true",
        help="the arbiter's even_contexts: it takes each paused kernel's context through the "
        "driver's checkpoint and back once, while idle (the node's own way to what "
        "--even-contexts does behind its back once the sessions are set up)",
    )
    parser.add_argument(
        "--suspend-after",
        type=float,
        default=3600.0,
        help="the arbiter's suspend_after (default: not in a run)",
    )
    parser.add_argument(
        "--edit-before",
        type=float,
        default=0.0,
        help="seconds a user edits a cell before running it, asking a prefetch as the edit begins (0: none)",
    )
    parser.add_argument(
        "--share-pieces",
        choices=("off", "same-user", "all"),
        default="off",
        help="the arbiter's share_pieces: paused pieces held once across kernels (default off "
        "here, as in the rows before the arbiter's default became all, so they compare)",
    )
    parser.add_argument(
        "--host-memory-limit",
        default="",
        help="the arbiter's host_memory_limit, e.g. 96G (default: its own, half of the host's memory)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sessions' first send times: runs compared replay one schedule (default: random)",
    )
    parser.add_argument("--calibration", help="an earlier output: reuse its calibration, append to its runs")
    parser.add_argument(
        "--solo-here",
        action="store_true",
        help="with --calibration: measure five solo cells on this machine's card too, each run's "
        "`solo_here` (the runs are still judged against the calibration's solo cell)",
    )
    parser.add_argument(
        "--time-slicing",
        help="benchmarks/time_slicing.py's output for this card: each run also carries "
        "`compute_share_sliced`, the model with those measured speeds",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--logs",
        type=Path,
        help="a directory for the arbiter's log, each kernel's output and, for a cell that "
        "stalls, its threads' stacks (default: none kept)",
    )
    args = parser.parse_args()
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    if args.same_checkpoint and args.workload != "transformer":
        parser.error("--same-checkpoint is the transformer's: add --workload transformer")
    if args.solo_here and not args.calibration:
        parser.error("--solo-here times this card beside a --calibration made on another")
    try:
        rates = load_rates(args.time_slicing) if args.time_slicing else None
    except (OSError, ValueError) as e:
        parser.error(f"--time-slicing: {e}")
    require_gpu(parser)
    record = provenance.record()
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    # one checkpoint for every session of every run (removed when the benchmark ends)
    checkpoint = tempfile.TemporaryDirectory(prefix="vgpu-checkpoint-") if args.same_checkpoint else None
    args.checkpoint = write_checkpoint(Path(checkpoint.name)) if checkpoint else None

    gpus = nvml.list_gpus()[args.first_gpu : args.first_gpu + args.gpus]
    if len(gpus) < args.gpus:
        parser.error(
            f"--first-gpu {args.first_gpu} --gpus {args.gpus}: this machine has {len(nvml.list_gpus())}"
        )
    args.gpu_uuids = [g.uuid for g in gpus]
    gpu = gpus[0]  # the calibration's card (the cards of one host are alike)
    args.card_reserve = args.ballast = 0  # a calibration measures the whole card
    if args.calibration:
        result = json.loads(Path(args.calibration).read_text())
        model = result["model"]
        args.workload = model.get("workload", "mlp")
        if args.workload == "transformer":
            args.tune, args.tokens = model["tune"], model["tokens"]
            args.same_checkpoint = model.get("same_checkpoint", False)
        else:
            args.width, args.layers, args.batch = (model[k] for k in ("width", "layers", "batch"))
        args.think = result["think_s"] if args.think is None else args.think
        result = provenance.stamped(result, record)  # the calibration's record moves to its history
        here = solo_here(args, gpu, result["steps_per_cell"]) if args.solo_here else None
    else:
        args.think = 90.0 if args.think is None else args.think
        result = {**record, **calibrate(args, gpu), "think_s": args.think, "runs": []}
        here = None
    result["percentiles"] = RULE
    # a calibration of a smaller card (an H100's on an H200): the rest of each card is kept
    # out of reach (--card-cap), so that cells and the arbiter meet the card the
    # calibration's static count and slices were measured on
    smaller = max(0, gpu.memory_total - result["card_bytes"])
    if args.card_cap is None:
        args.card_cap = "ballast" if args.grant_on_demand else "reserve"
    args.card = result["card_bytes"]
    args.card_reserve = smaller if args.card_cap == "reserve" else 0
    args.ballast = smaller if args.card_cap == "ballast" else 0
    result["arbiter"] = {
        "card_reserve_bytes": args.card_reserve or None,
        "idle_seconds": args.idle_seconds,
        "watermark": args.watermark,
        "suspend_after": args.suspend_after,
        "room_ahead": args.room_ahead == "on",
        "room_held_seconds": args.room_held_seconds,
        "trim_before_spill": args.trim_before_spill == "on",
        "even_contexts": args.node_even_contexts,
        "grant_on_demand": args.grant_on_demand,
        "grant_margin": args.grant_margin,
        "suspend_wait": args.suspend_wait,
        "turn_wait": args.turn_wait,
        "release_first": args.release_first,
        "poll_seconds": 0.25,
        "decisions_kept": DECISIONS_KEPT,
    }
    card = result["card_bytes"]
    static = result["static_sessions"] * len(gpus)  # static partitioning of every card
    result["gpus"] = len(gpus)
    slices = [
        Slice(
            g.uuid,
            g.index,
            g.name,
            card,
            result["budget_bytes"],
            100,
            placement="binpack",
            overcommit_ratio=8.0,
            idle_seconds=args.idle_seconds,
            isolation=args.isolation,
        )
        for g in gpus
    ]
    print(
        f"card {card / GiB:.1f} GiB, session peak {result['session_peak_bytes'] / GiB:.2f} GiB, working set "
        f"{result['working_set_bytes'] / GiB:.2f} GiB, static {static} on {len(gpus)} GPU(s), "
        f"solo cell {result['solo_cell_s']:.3f} s ({result['steps_per_cell']} steps), think {args.think} s",
        flush=True,
    )
    with open(args.out, "w") as f:  # the calibration alone: a later call may go on from it
        json.dump(result, f, indent=2)
    multiples = [float(v) for v in args.multiples.split(",")]
    wanted = (
        [int(v) for v in args.sessions.split(",")]
        if args.sessions
        else [round(m * static) for m in multiples]
    )
    for n in wanted:
        # setups at once: on each card, what it holds beside the contexts of its sessions
        # (the fullest card's: session i is on card i mod N), at most the static count;
        # a batch of k x N consecutive sessions is k on every card. Counted over the whole
        # host instead, 13 at once on four H200s put 4 on one card and the arbiter
        # suspended paused kernels there for their contexts (81 first cells came back from
        # a suspend, sessions-h200x4.json; 3 on two cards, sessions-h200x2.json).
        fullest = -(-n // len(gpus))  # sessions on the fullest card
        beside = card - fullest * result["context_bytes"]
        per_card = max(1, min(result["static_sessions"], int(beside // result["session_peak_bytes"])))
        together = per_card * len(gpus)
        began = provenance.run_record()  # a file that later calls add to: each run its own
        row = run_sessions(n, args, slices, result["steps_per_cell"], together)
        row.update(began)
        row["gpus"] = len(gpus)
        row["first_gpu"] = args.first_gpu
        row["setups_at_once"] = together
        row["host_memory_limit"] = args.host_memory_limit or None  # None: the arbiter's default
        row["card_reserve_bytes"] = args.card_reserve or None  # of each card, out of the arbiter's reach
        row["arbiter"] = result["arbiter"]  # each run its settings: a file may hold runs of several
        row["solo_p50_cell_s"] = result["solo_cell_s"]
        if here is not None:
            row["solo_here"] = here
        row["seed"] = args.seed
        row["local_memory"] = args.local_memory  # the kernels' give_back_local_memory
        row["isolation"] = args.isolation  # the slices' backend: the kernels MPS clients or not
        row["same_checkpoint"] = args.same_checkpoint
        row["share_pieces"] = args.share_pieces
        row["percentiles"] = RULE  # each run says its rule: a file may hold runs of several
        if row["cells_detail"]:  # had memory cost nothing: the floor of this run's latencies
            row["compute_share"] = of_cells(row["cells_detail"], len(gpus), result["solo_cell_s"])
            if here is not None:  # the same model with this card's own solo cell
                row["compute_share_here"] = of_cells(row["cells_detail"], len(gpus), here["solo_p50_cell_s"])
            if rates is not None:  # with time-slicing's own cost, as measured on this card
                row["compute_share_sliced"] = of_cells(
                    row["cells_detail"], len(gpus), result["solo_cell_s"], rates
                )
                row["time_slicing"] = {"file": args.time_slicing, "rates": rates}
            if args.turn_wait:  # cells taking turns, as the arbiter had them (with the rates given)
                row["compute_share_turns"] = of_cells(
                    row["cells_detail"], len(gpus), result["solo_cell_s"], rates, turn_wait=args.turn_wait
                )
        row["think_s"], row["cycles"] = args.think, args.cycles
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every N: a larger one may not finish
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
