"""Shared pytest setup: the CPU harness on the path, GPU skips, and a one-process gloo world."""

import os
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def megatron_single_process():
    """A gloo world of one process with Megatron's parallel state (TP = PP = 1)."""
    import torch.distributed as dist

    import harness

    harness.use_cpu()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(harness._free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    harness.init_parallel()
    yield


@pytest.fixture
def unit_scale(monkeypatch):
    """DSA's indexer-loss gradient scale is process-wide (as Megatron sets it); start from 1."""
    from megatron_ext.mixers.dsa import IndexerLoss

    monkeypatch.setattr(IndexerLoss, "scale", None)
