"""The server's usage sample over the cards of a slice of several: a kernel's bytes on
each card add up, its SM share is its busiest card's, and the card figures stay each
card's own."""

from jupyter_vgpu import contracts
from jupyter_vgpu.server.sampler import merge_cards

GiB = 2**30


def card(used: int, processes: dict[int, int], process_sm: dict[int, float]) -> dict:
    return {
        "memory_used": used,
        "memory_total": 80 * GiB,
        "sm_percent": 50.0,
        "processes": processes,
        "process_sm": process_sm,
    }


def test_a_kernel_on_two_cards_is_counted_on_both():
    first = card(30 * GiB, {100: 24 * GiB, 200: 6 * GiB}, {100: 40.0})
    second = card(26 * GiB, {100: 24 * GiB, 300: 2 * GiB}, {100: 70.0, 300: 5.0})
    merged = merge_cards([first, second])
    assert merged["processes"] == {100: 48 * GiB, 200: 6 * GiB, 300: 2 * GiB}
    assert merged["process_sm"] == {100: 70.0, 300: 5.0}
    assert merged["memory_used"] == 30 * GiB  # the first card's figure, as before
    assert merge_cards([first]) == first


def test_the_usage_document_takes_the_other_cards():
    gpu = {
        "index": 1,
        "uuid": "GPU-b",
        "name": "H100",
        "memory_total": 80 * GiB,
        "memory_used": None,
        "sm_percent": None,
    }
    document = {
        "version": 1,
        "slice": None,
        "simulated": True,
        "pressure": False,
        "timestamp": 1.0,
        "gpu": {**gpu, "index": 0, "uuid": "GPU-a"},
        "more_gpus": [gpu],
        "totals": {"used": 0, "reserved": 0, "offloaded": 0, "offloaded_compressed": 0},
        "kernels": [],
    }
    contracts.validate("usage", document)
    del document["more_gpus"]  # a server of an earlier release
    contracts.validate("usage", document)
