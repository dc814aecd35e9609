"""Bytes held by tensors in a namespace: the "used" figure of a simulated GPU."""

import pytest

pytest.importorskip("torch", reason="needs PyTorch (scripts/install brings its CPU build)")

import torch

from jupyter_vgpu.kernel import usage

MiB = 2**20


def test_views_count_once_and_modules_count_their_parameters_and_buffers():
    x = torch.zeros(MiB // 4)  # 1 MiB of float32
    model = torch.nn.BatchNorm1d(1024)  # weight, bias, running mean and var (4 KiB each), count
    ns = {"x": x, "view": x[:10], "alias": x, "model": model, "n": 3}
    module_bytes = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
    assert usage.tensor_bytes(ns) == MiB + module_bytes


def test_nested_tensors_are_found_by_the_walk():
    ns = {"batch": {"inputs": [torch.ones(MiB // 4)]}}
    assert usage.tensor_bytes(ns) == MiB


def test_an_empty_namespace_holds_nothing():
    assert usage.tensor_bytes({}) == 0
