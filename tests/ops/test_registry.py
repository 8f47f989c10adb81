"""kernels/registry.py: every op's backends declared once; "auto" picks the same backend as the
per-op policies it replaced (pinned here on the CPU by running each op, and for the CUDA branches
by asking the choice for the same inputs' facts on a CUDA device, with the verdicts faked: nothing
runs there); a backend named by the caller that cannot take the call says why; each choice is
logged once."""
import dataclasses
import itertools
import logging

import pytest
import torch

from megatron_ext.kernels import backends, registry
from megatron_ext.kernels.fused import ops as fused
from megatron_ext.kernels.selfcheck import decay_inputs, delta_rule_inputs

CUDA = torch.device("cuda", 0)
RECURRENCES = ("gated_delta_rule", "decay_linear_attention", "dplr_delta_rule")
FUSED = ("short_conv", "gate", "gated_rms_norm", "rms_norm", "cross_entropy", "rope")


def test_every_op_is_declared_with_its_backends():
    declared = {name: (list(op.backends), op.auto) for name, op in registry.ops().items()}
    recurrence = (["reference", "chunked", "triton", "fla"], ("triton", "chunked"))
    assert declared == {
        "gated_delta_rule": recurrence, "decay_linear_attention": recurrence,
        "dplr_delta_rule": (["reference", "chunked"], ("chunked",)),
        **{name: (["reference", "triton"], ("triton", "reference")) for name in FUSED},
    }


def spy(monkeypatch, op):
    """Record which backend of ``op`` runs (each backend's function wrapped in the registry)."""
    ran = []
    declared = registry.get(op).backends
    for name, backend in list(declared.items()):
        def function(*args, _name=name, _function=backend.function, **kwargs):
            ran.append(_name)
            return _function(*args, **kwargs)
        monkeypatch.setitem(declared, name, dataclasses.replace(backend, function=function))
    return ran


def _dplr_inputs(form):
    """RWKV-7-like inputs of dplr_delta_rule: a = -kappa, b = kappa * alpha."""
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 9, 2, 8, generator=generator) for _ in range(2))
    kappa = torch.nn.functional.normalize(torch.randn(1, 9, 4, 8, generator=generator), dim=-1)
    g = -torch.rand(1, 9, 4, 8, generator=generator) if form == "rwkv7" else None
    return dict(q=q, k=k, v=torch.randn(1, 9, 4, 12, generator=generator), a=-kappa, b=0.5 * kappa, g=g)


def recurrence_calls():
    """(op, function, keyword arguments) of representative calls of each recurrence op: every
    input form, fp32 and bf16, and packed sequences."""
    from megatron_ext.kernels import decay_linear_attention, dplr_delta_rule, gated_delta_rule

    for form, dtype in itertools.product(("deltanet", "gated_deltanet", "kda", "gdn2"),
                                         (torch.float32, torch.bfloat16)):
        yield "gated_delta_rule", gated_delta_rule, delta_rule_inputs(form, dtype=dtype)
    for form, dtype in itertools.product(("none", "constant", "per_head", "per_channel"),
                                         (torch.float32, torch.bfloat16)):
        yield "decay_linear_attention", decay_linear_attention, decay_inputs(form, dtype=dtype)
    packed = delta_rule_inputs("kda", batch=1, num_states=2)
    yield "gated_delta_rule", gated_delta_rule, dict(packed, cu_seqlens=torch.tensor([0, 9, 37]))
    packed = decay_inputs("per_channel", batch=1, num_states=2)
    yield "decay_linear_attention", decay_linear_attention, dict(packed, cu_seqlens=torch.tensor([0, 9, 37]))
    for form in ("rwkv7", "none"):
        yield "dplr_delta_rule", dplr_delta_rule, _dplr_inputs(form)


@pytest.mark.parametrize("index", range(len(list(recurrence_calls()))))
def test_auto_runs_chunked_on_the_cpu(monkeypatch, index):
    op, function, inputs = list(recurrence_calls())[index]
    ran = spy(monkeypatch, op)
    function(**inputs)
    assert ran == ["chunked"]


def _old_recurrence_auto(op, facts, passed):
    """The policy before the registry (backends.auto_backend with the op's declined reason)."""
    declined = backends._dims_reason(facts.key_dim, facts.value_dim)
    if op == "decay_linear_attention" and declined is None:
        declined = backends._decay_declined(facts.device, facts.dtype, facts.key_dim, facts.form)
    if op == "dplr_delta_rule":
        return "chunked"
    return "triton" if facts.device.type == "cuda" and declined is None and passed else "chunked"


@pytest.mark.parametrize("passed", [True, False])
def test_auto_on_cuda_matches_the_old_policy(monkeypatch, passed):
    """For the recurrences' calls above in every dtype the kernels take and at head dims in and
    out of TRITON_HEAD_DIMS, the choice on a CUDA device with a passing or failing self-check."""
    jobs_asked = []

    def verdict(op, device, jobs=None):
        jobs_asked.append((op, jobs))
        return {"passed": passed, "reason": "faked"}

    monkeypatch.setattr(backends, "triton_verdict", verdict)
    checked = 0
    for op, _, inputs in recurrence_calls():
        for key_dim, value_dim, dtype in itertools.product((8, 32, 64), (12, 128),
                                                          (torch.float32, torch.bfloat16, torch.float16)):
            shaped = dict(inputs)
            shaped["q"] = torch.zeros(*inputs["q"].shape[:3], key_dim, dtype=dtype)
            shaped["k"] = torch.zeros(*inputs["k"].shape[:3], key_dim, dtype=dtype)
            shaped["v"] = torch.zeros(*inputs["v"].shape[:3], value_dim, dtype=dtype)
            facts = dataclasses.replace(registry.get(op).facts(**shaped), device=CUDA)
            assert registry.choose(op, "auto", facts) == _old_recurrence_auto(op, facts, passed), (
                op, facts)
            checked += 1
    assert checked == len(list(recurrence_calls())) * 18
    # the self-check jobs asked are those of the call's form and dtype (and packing)
    assert ("gated_delta_rule", (("kda", "bfloat16"), ("kda_packed", "bfloat16"))) in jobs_asked


def test_fp64_on_cuda_runs_chunked():
    """The one change: fp64 inputs, which the Triton kernels refuse, ran into that refusal under
    "auto" on a GPU whose self-check passed; the registry's rule names the dtype, so chunked runs."""
    facts = registry.Facts(device=CUDA, dtype=torch.float64, key_dim=64, value_dim=64, form="kda")
    assert registry.choose("gated_delta_rule", "auto", facts) == "chunked"


def fused_calls():
    """(op, arguments, whether the old policy's input condition held) of each fused op, with
    inputs the kernels take and inputs they do not."""
    x = torch.randn(2, 9, 3 * 16)
    yield "short_conv", (x, torch.randn(48, 4), None, 16), True
    yield "short_conv", (x, torch.randn(48, 4), None, 12), False  # a group of 12 channels
    yield "short_conv", (x, torch.randn(48, 5), None, None), False  # five taps
    yield "gate", (x,), True
    yield "gate", (x.transpose(1, 2),), False  # a strided channel dim
    o = torch.randn(2, 9, 3, 16)
    yield "gated_rms_norm", (o, torch.ones(16), o, 1e-6), True
    yield "gated_rms_norm", (o[..., :12], torch.ones(12), o[..., :12], 1e-6), False
    yield "gated_rms_norm", (o, torch.ones(16), o.transpose(-1, -2).contiguous().transpose(-1, -2), 1e-6), False
    yield "rms_norm", (x, torch.ones(48), 1e-5), True
    yield "cross_entropy", (torch.randn(9, 2, 50), torch.randint(0, 50, (9, 2))), True
    angles = torch.randn(9, 1, 1, 16)
    yield "rope", (torch.randn(9, 2, 3, 16), angles), True
    yield "rope", (torch.randn(9, 2, 3, 12), torch.randn(9, 1, 1, 12)), False


@pytest.mark.parametrize("index", range(len(list(fused_calls()))))
def test_fused_auto_runs_the_reference_on_the_cpu(monkeypatch, index):
    op, args, _ = list(fused_calls())[index]
    ran = spy(monkeypatch, op)
    getattr(fused, op)(*args)
    assert ran == ["reference"]


@pytest.mark.parametrize("passed", [True, False])
def test_fused_auto_on_cuda_matches_the_old_policy(monkeypatch, passed):
    """On a CUDA device: triton where the old condition held and the first-use check passed."""
    checks = []
    monkeypatch.setattr(fused, "first_use_check", lambda device, dtype: checks.append(dtype) or passed)
    for op, args, fits in fused_calls():
        for dtype in (torch.float32, torch.bfloat16):
            facts = dataclasses.replace(registry.get(op).facts(*args), device=CUDA, dtype=dtype)
            assert registry.choose(op, "auto", facts) == ("triton" if fits and passed else "reference"), op
    assert len(checks) == 2 * sum(fits for _, _, fits in fused_calls())  # only where the kernels fit


def test_named_backends_say_why_they_cannot_run():
    from megatron_ext.kernels import gated_delta_rule

    inputs = {name: t.detach() for name, t in delta_rule_inputs("kda").items()}  # K = 8, V = 12
    for error in (ValueError, RuntimeError):
        with pytest.raises(error, match="gated_delta_rule: backend 'triton' cannot run K = 8, V = 12"):
            gated_delta_rule(**inputs, backend="triton")
    with pytest.raises(ValueError, match="gated_delta_rule: unknown backend 'nope'; known backends: "
                                         "'auto', 'reference', 'chunked', 'triton', 'fla'"):
        gated_delta_rule(**inputs, backend="nope")
    with pytest.raises(registry.BackendUnavailable, match="backend 'fla' cannot run kda: "):
        registry.choose("gated_delta_rule", "fla", device="cpu", form="kda")
    with pytest.raises(registry.BackendUnavailable, match="rope: backend 'triton' cannot run t "):
        fused.rope(torch.randn(9, 2, 3, 12), torch.randn(9, 1, 1, 12), backend="triton")
    assert registry.choose("gated_delta_rule", "reference", device="cpu") == "reference"


def test_each_choice_is_logged_once(caplog):
    facts = registry.Facts(device=torch.device("cuda", 5), dtype=torch.float32, key_dim=8, value_dim=8)
    with caplog.at_level(logging.INFO, logger="megatron_ext.kernels"):
        for _ in range(3):
            assert registry.choose("gated_delta_rule", "auto", facts) == "chunked"
        registry.choose("gated_delta_rule", "auto", device="meta")
    assert [r.getMessage() for r in caplog.records] == [
        "megatron-ext: backend='auto' runs gated_delta_rule as 'chunked' on cuda:5 in float32 (not "
        "'triton': K = 8, V = 8: the Triton kernels take head dims 16, 32, 64, 128, 256)",
        "megatron-ext: backend='auto' runs gated_delta_rule as 'chunked' on meta in any dtype (not "
        "'triton': it runs on CUDA devices here, not 'meta')"]
    assert caplog.records[0].levelname == "WARNING" and caplog.records[1].levelname == "INFO"


def test_the_kernels_import_nothing_of_their_callers():
    """kernels/ imports no megatron_ext module outside it, and the registry no op package."""
    import pathlib
    import re

    root = pathlib.Path(registry.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) megatron_ext(?!\.kernels)", text, re.M), path
    assert not re.search(r"^\s*from \.(\w+)? import|^\s*import megatron_ext",
                         (root / "registry.py").read_text(), re.M)
