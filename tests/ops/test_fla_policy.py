"""fla_unavailable_reason, the rules for when fla-core may serve an op, on a machine without a
GPU: fla-core and Triton are stand-ins (sys.modules) and the GPU's compute capability is
patched, so that every rule is exercised whether or not fla-core is installed here."""
import sys
import types

import pytest
import torch

from megatron_ext.kernels import decay_linear_attention, gated_delta_rule
from megatron_ext.kernels.backends import FLA_KINDS, fla_unavailable_reason
from megatron_ext.kernels.decay.fla import decay_fla_kind
from megatron_ext.kernels.delta_rule.fla import fla_kind

GATED_KINDS_REFUSED_ON_HOPPER = {"gdn", "simple_gla"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """fla-core 0.6.0 and Triton 3.6.0 "installed", and a CUDA device of compute capability 9.0
    (H100/H200); the fixture's value sets other versions and capabilities."""
    modules = {"fla": types.SimpleNamespace(__version__="0.6.0"),
               "triton": types.SimpleNamespace(__version__="3.6.0")}
    capability = {"value": (9, 0)}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])

    def configure(fla=None, triton=None, device_capability=None):
        if fla is not None:
            modules["fla"].__version__ = fla
        if triton is not None:
            modules["triton"].__version__ = triton
        if device_capability is not None:
            capability["value"] = device_capability

    return configure


def test_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # makes `import fla` raise ImportError
    reason = fla_unavailable_reason("kda", "cuda", requires_grad=True)
    assert reason.startswith("fla-core is not installed")


def test_too_old(fake_gpu):
    fake_gpu(fla="0.5.2")
    assert fla_unavailable_reason("kda", "cuda", requires_grad=False) == (
        "fla-core 0.5.2 is installed; the adapter needs fla-core>=0.6.0")


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu"), "meta"])
def test_needs_cuda(fake_gpu, device):
    reason = fla_unavailable_reason("deltanet", device, requires_grad=False)
    assert "need a CUDA device" in reason and repr(torch.device(device).type) in reason


@pytest.mark.parametrize("kind", list(FLA_KINDS))
def test_hopper_with_bad_triton_refuses_the_gated_backward(fake_gpu, kind):
    reason = fla_unavailable_reason(kind, "cuda", requires_grad=True)
    if kind in GATED_KINDS_REFUSED_ON_HOPPER:
        assert FLA_KINDS[kind] in reason and "Triton 3.6.0" in reason and "#640" in reason
    else:
        assert reason is None
    assert fla_unavailable_reason(kind, "cuda:0", requires_grad=False) is None  # forward runs


@pytest.mark.parametrize(("triton", "capability", "refused"), [
    ("3.3.1", (9, 0), False),
    ("3.4.0", (9, 0), True),
    ("3.7.0", (9, 0), True),
    ("3.7.1", (9, 0), False),
    ("3.8.0+git0123abc", (9, 0), False),
    ("3.6.0", (8, 0), False),  # A100
    ("3.6.0", (10, 0), False),  # B200
])
def test_known_bad_range_bounds(fake_gpu, triton, capability, refused):
    fake_gpu(triton=triton, device_capability=capability)
    assert (fla_unavailable_reason("gdn", "cuda", requires_grad=True) is not None) == refused


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"unknown kind 'mamba'; known kinds: 'deltanet', 'gdn'"):
        fla_unavailable_reason("mamba", "cuda", requires_grad=False)


def test_fla_kind_of_each_special_case():
    per_head, per_channel = torch.zeros(1, 3, 2), torch.zeros(1, 3, 2, 4)
    assert fla_kind(beta=per_head, g=None, erase=None, write=None) == "deltanet"
    assert fla_kind(beta=per_head, g=per_head, erase=None, write=None) == "gdn"
    assert fla_kind(beta=per_head, g=per_channel, erase=None, write=None) == "kda"
    assert fla_kind(beta=None, g=per_channel, erase=per_channel, write=per_channel) == "gdn2"
    assert fla_kind(beta=per_head, g=None, erase=per_channel, write=None) == "gdn2"


def test_decay_fla_kind_of_each_form():
    assert decay_fla_kind(None) == "linear"
    assert decay_fla_kind(torch.zeros(2)) == "simple_gla_gamma"
    assert decay_fla_kind(torch.zeros(1, 3, 2)) == "simple_gla"
    assert decay_fla_kind(torch.zeros(1, 3, 2, 4)) == "gla"


def test_decay_op_with_fla_backend_on_cpu_says_why():
    q = k = torch.randn(1, 5, 2, 4)
    v = torch.randn(1, 5, 2, 3)
    with pytest.raises(RuntimeError, match=r"backend 'fla' cannot run gla: .*(not installed|CUDA device)"):
        decay_linear_attention(q, k, v, g=-torch.rand(1, 5, 2, 4), backend="fla")


def test_fla_refuses_a_constant_decay_that_requires_grad():
    """fla-core takes RetNet's g_gamma as a constant: a decay that wants a gradient is refused
    (not left silently without one); the same decay without requires_grad gets past this rule."""
    q = k = torch.randn(1, 5, 2, 4)
    v = torch.randn(1, 5, 2, 3)
    decay = torch.log(1 - 2.0 ** (-5 - torch.arange(2.0)))
    with pytest.raises(RuntimeError, match=r"cannot run simple_gla_gamma: a decay that requires grad"):
        decay_linear_attention(q, k, v, g=decay.clone().requires_grad_(), backend="fla")
    with pytest.raises(RuntimeError, match=r"cannot run simple_gla_gamma: .*(not installed|CUDA device)"):
        decay_linear_attention(q, k, v, g=decay, backend="fla")


def test_op_with_fla_backend_on_cpu_says_why():
    q = k = torch.randn(1, 5, 2, 4)
    v = torch.randn(1, 5, 2, 3)
    with pytest.raises(RuntimeError, match=r"backend 'fla' cannot run kda: .*(not installed|CUDA device)"):
        gated_delta_rule(q, k, v, beta=torch.rand(1, 5, 2), g=-torch.rand(1, 5, 2, 4), backend="fla")
