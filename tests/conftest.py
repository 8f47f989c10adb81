"""Shared pytest setup: this folder's helpers (harness, triton_interpreter, flash_emulation) on
the path for the tests of every component folder, GPU skips, and one-process gloo and NCCL
worlds."""

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
    import harness

    harness.use_cpu()
    harness.init_single_process("gloo")
    yield


@pytest.fixture(scope="module")
def megatron_on_cuda():
    """A one-process NCCL world with Megatron's parallel state (TP = PP = 1) on GPU 0."""
    import harness
    import torch

    torch.cuda.set_device(0)
    harness.init_single_process("nccl")
    yield
    harness.destroy_parallel()


@pytest.fixture
def unit_scale(monkeypatch):
    """DSA's indexer-loss gradient scale is process-wide (as Megatron sets it); start from 1."""
    from megatron_ext.mixers.dsa import IndexerLoss

    monkeypatch.setattr(IndexerLoss, "scale", None)


@pytest.fixture
def indexer_losses(monkeypatch):
    """The DSA indexer losses the test computes (``sparse.dsa_indexer_loss``), as floats, in
    order."""
    from megatron_ext.kernels import sparse

    losses, indexer_loss = [], sparse.dsa_indexer_loss

    def recording(*args, **kwargs):
        loss = indexer_loss(*args, **kwargs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(sparse, "dsa_indexer_loss", recording)
    return losses
