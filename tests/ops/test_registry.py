"""kernels/registry.py: every op's backends declared once; "auto" picks the same backend as the
per-op policies it replaced (pinned here on the CPU by running each op, and for the CUDA branches
by asking the choice for the same inputs' facts on a CUDA device, with the verdicts faked: nothing
runs there); a backend named by the caller that cannot take the call says why; each choice is
logged once."""
import dataclasses
import functools
import itertools
import logging

import pytest
import torch

from megatron_ext.kernels import backends, registry, sparse
from megatron_ext.kernels.fused import ops as fused
from megatron_ext.kernels.residual import efficient
from megatron_ext.kernels.selfcheck import decay_inputs, delta_rule_inputs

CUDA = torch.device("cuda", 0)
RECURRENCES = ("gated_delta_rule", "decay_linear_attention", "dplr_delta_rule")
FUSED = ("short_conv", "gate", "gated_rms_norm", "rms_norm", "cross_entropy", "rope")
LAYOUT = ["reference", "gathered", "flex"]


def test_every_op_is_declared_with_its_backends():
    declared = {name: (list(op.backends), op.auto) for name, op in registry.ops().items()}
    recurrence = (["reference", "chunked", "triton", "fla"], ("triton", "chunked"))
    assert declared == {
        "gated_delta_rule": recurrence, "decay_linear_attention": recurrence,
        "dplr_delta_rule": (["reference", "chunked", "triton"], ("triton", "chunked")),
        **{name: (["reference", "triton"], ("triton", "reference")) for name in FUSED},
        "softmax_attention": (LAYOUT + ["flash"], ("flash", "flex", "gathered", "reference")),
        "moba_attention": (LAYOUT + ["flash"], ("flash", "flex", "gathered")),
        "nsa_attention": (LAYOUT + ["flash"], ("flash", "flex", "gathered")),
        "compressed_attention": (LAYOUT, ("flex", "gathered")),
        "block_layout": (["gathered", "flex"], ("flex", "gathered")),
        **{name: (LAYOUT + ["triton", "flash"], ("flash", "flex", "triton", "gathered"))
           for name in ("dsa_attention", "csa_attention")},
        **{name: (LAYOUT + ["triton"], ("triton", "gathered")) for name in ("dsa_indexer_loss", "csa_indexer_loss")},
        **{name: (LAYOUT + ["triton"], ("gathered",)) for name in ("dsa_select", "csa_select", "compress_kv")},
        **{name: (["pytorch", "triton"], ("triton", "pytorch"))
           for name in ("block_choice", "selection_words", "moba_selection", "nsa_selection", "index_scores",
                        "sinkhorn", "mhc", "depth_attention", "add_into_last_slot")},
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
    """The policy before the registry (backends.auto_backend with the op's declined reason), and
    dplr_delta_rule's since it has a triton backend."""
    declined = backends._dims_reason(facts.key_dim, facts.value_dim)
    if op == "decay_linear_attention" and declined is None:
        declined = backends._decay_declined(facts.device, facts.dtype, facts.key_dim, facts.form)
    if op == "gated_delta_rule" and declined is None:
        declined = backends._delta_declined(facts.device, facts.compute_dtype, facts.value_dim, facts.form)
    if op == "dplr_delta_rule":  # its kernels see no value dim: K alone is what they tile
        declined = None if facts.key_dim in backends.TRITON_HEAD_DIMS else "K"
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
    assert ("gated_delta_rule", (("kda", "bfloat16"), ("kda_packed", "bfloat16"),
                                 ("kda_segmented", "bfloat16"))) in jobs_asked


@pytest.mark.parametrize("form", ["deltanet", "gated_deltanet", "kda", "gdn2"])
def test_delta_rule_per_channel_decay_below_v128_runs_chunked_on_cuda(monkeypatch, form):
    """A per-channel decay (KDA, GDN-2) at V < 128 in 16 bits is declined on a GPU (NaN gradients
    at K = V = 64 in bf16 on an H100): auto runs chunked there, triton named refuses saying why;
    the other forms, fp32 and V = 128 still run triton."""
    monkeypatch.setattr(backends, "triton_verdict", lambda op, device, jobs=None: {"passed": True, "reason": ""})
    per_channel = form in ("kda", "gdn2")
    for value_dim, dtype in itertools.product((32, 64, 128), (torch.float32, torch.bfloat16, torch.float16)):
        facts = registry.Facts(device=CUDA, dtype=dtype, compute_dtype=dtype, key_dim=64, value_dim=value_dim,
                               form=form)
        declined = per_channel and value_dim < 128 and dtype != torch.float32
        assert registry.choose("gated_delta_rule", "auto", facts) == ("chunked" if declined else "triton")
        if declined:
            with pytest.raises(registry.BackendUnavailable, match=f"per-channel decay at V = {value_dim}"):
                registry.choose("gated_delta_rule", "triton", facts)


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


# ---------------------------------------------------------------------------------------------
# The sparse ops (kernels/sparse): "auto" as the per-op policy it replaced (flash.py's, cuDNN's
# and triton.py's rules and first-use gates, routing's flex/gathered choice, the selections'
# device types), pinned for the facts of calls on meta tensors put on a CUDA device with the
# capability, cuDNN and the verdicts faked, and on the CPU by running the ops.
# ---------------------------------------------------------------------------------------------

HALF = (torch.float16, torch.bfloat16)


def _old_flash(q, k, v, allowed=False):
    """flash.unavailable_reason(q, k, v, allowed=...) is None (CUDA, capability 9.0)."""
    return (q.dtype in HALF and q.dtype == k.dtype == v.dtype and not q.shape[-1] % 8
            and q.shape[-1] <= 256 and k.shape[1] == q.shape[1] and not allowed)


def _old_triton(q, k, v):
    """triton.unavailable_reason(q, k, v) is None on CUDA."""
    return (q.dtype in (torch.float32, *HALF) and q.dtype == k.dtype == v.dtype
            and q.shape[-1] <= 256 and k[0].numel() < 2**31)


def _old_layout(q):
    return "flex" if q.shape[-1] >= 16 else "gathered"


def _old_sparse_auto(op, q, k, v, options, passed):
    """The policy before the registry, on CUDA with every first-use check ``passed`` or not."""
    from megatron_ext.kernels.sparse import dsa, nsa

    flash, cudnn = _old_flash(q, k, v, options.get("allowed", False)), q.shape[-1] <= 128
    if op == "softmax_attention":
        if flash and not options.get("log_forget") and passed:
            return "flash"
        name = _old_layout(q)
        return "reference" if options.get("log_forget") and name == "gathered" else name
    if op == "moba_attention":
        return "flash" if flash and not options.get("window") and passed else _old_layout(q)
    if op == "nsa_attention":
        return "flash" if q.shape[1] >= nsa.NSA_FLASH_MIN_LEN and flash and passed else _old_layout(q)
    if op == "compressed_attention":
        return _old_layout(q)
    keys = k.shape[1] + options.get("entries", 0)
    if op == "dsa_attention":
        bias = q.shape[0] * q.shape[1] * k.shape[1] * q.element_size()
        if flash and cudnn and options.get("causal") and bias <= dsa.CAUSAL_SELECTION_MAX_BIAS and passed:
            return "flash"
    if op == "csa_attention" and flash and cudnn and options.get("rate") is not None and passed:
        return "flash"
    if q.shape[-1] >= 16 and keys <= dsa.SELECTED_FLEX_MAX_KEYS:
        return "flex"
    wide = torch.empty(k.shape[0], keys, *k.shape[2:], device="meta", dtype=k.dtype)
    return "triton" if _old_triton(q, wide, wide) and passed else "gathered"


def _old_loss_auto(q, k, index_q, index_k, passed):
    from megatron_ext.kernels.sparse import triton_indexer as kernels

    indexer = (index_q.dtype in (torch.float32, *HALF) and index_q.shape[2] <= kernels.MAX_HEADS
               and index_q.shape[3] <= kernels.MAX_DIM and index_k[0].numel() < 2**31)
    return "triton" if _old_triton(q, k, k) and indexer and passed else "gathered"


def sparse_calls():
    """(op, q, k, v, options) on meta tensors: dtypes the kernels take and not, head dims in and
    out of each kernel's, keys shorter than the queries, masks, forget gates, windows, lengths
    around NSA_FLASH_MIN_LEN, causal selections with small and large biases, many keys."""
    def qkv(dtype, dim, seq_len=64, keys=None, batch=2, other=None):
        keys = seq_len if keys is None else keys
        return (torch.empty(batch, seq_len, 4, dim, device="meta", dtype=dtype),
                torch.empty(batch, keys, 2, dim, device="meta", dtype=other or dtype),
                torch.empty(batch, keys, 2, dim, device="meta", dtype=dtype))

    for dtype, dim in itertools.product((torch.float32, torch.bfloat16, torch.float16), (8, 12, 64, 160, 512)):
        for other in (None, torch.float32):
            tensors = qkv(dtype, dim, other=other)
            for options in ({}, {"allowed": True}, {"log_forget": True}):
                yield "softmax_attention", *tensors, options
            for options in ({}, {"window": True}):
                yield "moba_attention", *tensors, options
            yield "compressed_attention", *tensors, {}
            for causal in (False, True):
                yield "dsa_attention", *tensors, {"causal": causal}
            for rate in (None, 4):
                yield "csa_attention", *tensors, {"rate": rate, "entries": 16}
        yield "softmax_attention", *qkv(dtype, dim, keys=40), {}
        for seq_len in (8191, 8192):
            yield "nsa_attention", *qkv(dtype, dim, seq_len=seq_len), {}
        yield "dsa_attention", *qkv(dtype, dim, seq_len=32768, batch=4), {"causal": True}
        yield "dsa_attention", *qkv(dtype, dim, seq_len=70000, batch=1), {"causal": True}
        yield "csa_attention", *qkv(dtype, dim, seq_len=65536, batch=1), {"rate": None, "entries": 8}


def _sparse_facts(op, q, k, v, options):
    from megatron_ext.kernels.sparse import routing

    if op in ("dsa_attention",):
        return registry.get(op).facts(q, k, v, causal=options["causal"])
    if op == "csa_attention":
        entries = torch.empty(k.shape[0], options["entries"], *k.shape[2:], device="meta", dtype=k.dtype)
        return registry.get(op).facts(q, k, v, entries, rate=options["rate"])
    if op == "softmax_attention":
        return registry.get(op).facts(q, k, v, allowed=True if options.get("allowed") else None,
                                      log_forget=True if options.get("log_forget") else None)
    if op == "moba_attention":
        return registry.get(op).facts(q, k, v, window=(8, 0) if options.get("window") else None)
    return routing.attention_facts(q, k, v)


def fake_cuda(monkeypatch, passed):
    """CUDA facts without a GPU: capability 9.0, cuDNN's SDPA enabled, every first-use check
    answering ``passed``; returns the checks asked."""
    from megatron_ext.kernels.sparse import flash, routing, triton

    asked = []
    monkeypatch.setattr(routing, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(routing, "_cudnn_enabled", lambda: True)
    for module, name in ((flash, "checked"), (flash, "cudnn_checked"), (triton, "checked")):
        monkeypatch.setattr(module, name, lambda device, dtype, _name=name: asked.append(_name) or passed)
    return asked


@pytest.mark.parametrize("passed", [True, False])
def test_sparse_auto_on_cuda_matches_the_old_policy(monkeypatch, passed):
    asked = fake_cuda(monkeypatch, passed)
    checked = 0
    for op, q, k, v, options in sparse_calls():
        facts = dataclasses.replace(_sparse_facts(op, q, k, v, options), device=CUDA)
        assert registry.choose(op, "auto", facts) == _old_sparse_auto(op, q, k, v, options, passed), (
            op, q.dtype, k.dtype, q.shape, k.shape, options)
        checked += 1
        if op == "nsa_attention":  # its compressed branch beside flash: auto's block layout
            assert registry.choose("block_layout", "auto", facts) == _old_layout(q)
    assert checked == 15 * (2 * 10 + 6) and asked


@pytest.mark.parametrize("passed", [True, False])
def test_indexer_loss_auto_on_cuda_matches_the_old_policy(monkeypatch, passed):
    fake_cuda(monkeypatch, passed)
    for dtype, dim, index_dtype, heads, index_dim in itertools.product(
            (torch.float32, torch.bfloat16, torch.float64), (64, 512), (torch.bfloat16, torch.float64),
            (8, 256), (64, 512)):
        q = torch.empty(2, 64, 4, dim, device="meta", dtype=dtype)
        k = torch.empty(2, 64, 2, dim, device="meta", dtype=dtype)
        index_q = torch.empty(2, 64, heads, index_dim, device="meta", dtype=index_dtype)
        index_k = torch.empty(2, 64, index_dim, device="meta", dtype=index_dtype)
        for op in ("dsa_indexer_loss", "csa_indexer_loss"):
            facts = dataclasses.replace(registry.get(op).facts(q, k, index_q, index_k), device=CUDA)
            assert registry.choose(op, "auto", facts) == _old_loss_auto(q, k, index_q, index_k, passed)


def test_sparse_selection_kernels_auto_on_cuda(monkeypatch):
    """The selections' and the indexer scores' kernels: Triton on CUDA where they take the call
    (fp32 scores of at most MAX_BLOCKS blocks; dense rows of q; the indexer's tensors) and, for
    MoBA's and NSA's, once their first-use checks passed; PyTorch on the CPU."""
    from megatron_ext.kernels.sparse import routing, triton_select

    verdict = {"moba_checked": True, "importance_checked": False}
    for name, passed in verdict.items():
        monkeypatch.setattr(triton_select, name, lambda device, dtype, _passed=passed: _passed)
    fp32, bf16 = torch.float32, torch.bfloat16
    cases = [("block_choice", fp32, dict(scores=True, blocks=1024), "triton"),
             ("block_choice", fp32, dict(scores=True, blocks=1025), "pytorch"),
             ("block_choice", bf16, dict(scores=True, blocks=8), "pytorch"),
             ("selection_words", torch.int32, {}, "triton"),
             ("moba_selection", bf16, dict(blocks=8, dense_rows=True), "triton"),
             ("moba_selection", bf16, dict(blocks=8, dense_rows=False), "pytorch"),
             ("moba_selection", bf16, dict(blocks=2048, dense_rows=True), "pytorch"),
             ("nsa_selection", bf16, {}, "pytorch"),
             ("index_scores", bf16, routing.indexer_facts(torch.empty(1, 4, 8, 64), torch.empty(1, 4, 64)), "triton"),
             ("index_scores", bf16, routing.indexer_facts(torch.empty(1, 4, 8, 1024), torch.empty(1, 4, 1024)),
              "pytorch")]
    for op, dtype, extra, expected in cases:
        for device, choice in ((CUDA, expected), (torch.device("cpu"), "pytorch")):
            facts = registry.Facts(device=device, dtype=dtype, extra=extra)
            assert registry.choose(op, "auto", facts) == choice, (op, device, extra)


def test_sparse_auto_on_the_cpu(monkeypatch):
    """On the CPU every sparse op runs its gathered form (forget gates: the reference), as
    before; the ops ask the registry (spied here) and nothing else."""
    chosen, choose = [], registry.choose
    monkeypatch.setattr(registry, "choose", lambda op, *args, **kwargs: chosen.append(
        (op, choose(op, *args, **kwargs))) or chosen[-1][1])
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, heads, 16, generator=generator) for heads in (4, 2, 2))
    sparse.softmax_attention(q, k, v, window=(8, 0), sink=torch.zeros(4))
    sparse.softmax_attention(q, k, v, log_forget=-torch.rand(1, 40, 4, generator=generator))
    sparse.moba_attention(q, k, v, block_size=8, top_k=2)
    weights = torch.full((2, 8), 1 / 8)
    sparse.nsa_attention(q, k, v, torch.full((1, 40, 4, 3), 0.5), weights, weights, compress_block=8,
                         compress_stride=4, select_block=8, select_top_k=3, window=8)
    selected = torch.randint(0, 40, (1, 40, 4)).sort(-1).values.clamp(max=torch.arange(40)[:, None])
    sparse.dsa_attention(q, k, v, selected, causal=True)
    ck, cv = k[:, 3::4], v[:, 3::4]
    sparse.compressed_attention(q, k, v, ck, cv, rate=4, window=8)
    sparse.csa_attention(q, k, v, ck, cv, torch.randint(0, 10, (1, 40, 3)), window=8, rate=4)
    ops = {op: name for op, name in chosen}
    assert ops == {"softmax_attention": "reference", "moba_attention": "gathered",
                   "nsa_attention": "gathered", "dsa_attention": "gathered",
                   "compressed_attention": "gathered", "csa_attention": "gathered",
                   "block_choice": "pytorch", "moba_selection": "pytorch",
                   "nsa_selection": "pytorch"}, chosen
    assert ("softmax_attention", "gathered") in chosen  # without forget gates


def test_sparse_named_backends_say_why_they_cannot_run():
    q, k, v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 1, 16), torch.randn(1, 5, 1, 16)
    with pytest.raises(registry.BackendUnavailable, match="moba_attention: backend 'flash' cannot run "
                                                          "FlashAttention takes fp16 or bf16"):
        sparse.moba_attention(q, k, v, block_size=2, top_k=2, backend="flash")
    with pytest.raises(ValueError, match="compressed_attention: unknown backend 'flash'; known backends: "
                                         "'auto', 'reference', 'gathered', 'flex'"):
        sparse.compressed_attention(q, k, v, k[:, 1::2], v[:, 1::2], rate=2, window=2, backend="flash")
    facts = registry.Facts(device=CUDA, dtype=torch.bfloat16, key_dim=8)
    with pytest.raises(registry.BackendUnavailable, match="nsa_attention: backend 'flex' cannot run a head "
                                                          "dim of 8 on CUDA"):
        registry.choose("nsa_attention", "flex", facts)


# ---------------------------------------------------------------------------------------------
# The residual ops (kernels/residual/efficient.py): the Triton kernels where the Backend has
# them on, on CUDA, where they take the call and passed their first-use check; else the bodies.
# ---------------------------------------------------------------------------------------------

def _old_residual_auto(op, backend, args, passed):
    """The policy before the registry (efficient's _triton_*_for with the kernels' own
    unsupported_reason), on CUDA, every first-use check answering ``passed``."""
    on = backend.triton and (backend.triton_mhc or op != "mhc")
    fp = (torch.float32, torch.bfloat16, torch.float16)
    if op == "sinkhorn":
        fits = 2 <= args[0].shape[-1] <= 8
    elif op == "mhc":
        streams, *update = args
        n, h = streams.shape[-2:]
        fits = 2 <= n <= 8 and h and not h % 16 and streams.dtype in fp
        if update:
            lead = streams.shape[:-2]
            fits = fits and tuple(t.shape for t in update) == (lead + (h,), lead + (n,), lead + (n, n))
    elif op == "depth_attention":
        query, groups, last_plus = args
        lead, h = groups[0].shape[:-2], groups[0].shape[-1]
        total = sum(g.shape[-2] for g in groups)
        fits = (1 <= len(groups) <= 4 and h and not h % 16 and tuple(query.shape) == (h,)
                and all(g.shape[:-2] == lead and g.shape[-1] == h and g.dtype == groups[0].dtype for g in groups)
                and groups[0].dtype in fp and 1 <= total <= 64
                and (last_plus is None
                     or (tuple(last_plus.shape) == (*lead, h) and last_plus.dtype == groups[0].dtype)))
    else:
        slots, addend = args
        fits = (slots.dtype in fp and addend.dtype == slots.dtype and not slots.shape[-1] % 16
                and slots.is_contiguous() and tuple(addend.shape) == (*slots.shape[:-2], slots.shape[-1]))
    return "triton" if on and fits and passed else "pytorch"


def residual_calls():
    meta = functools.partial(torch.empty, device="meta")
    for n in (1, 2, 4, 8, 9):
        yield "sinkhorn", (meta(5, n, n),)
    for n, h, dtype in itertools.product((1, 4, 9), (16, 24, 64), (torch.float32, torch.bfloat16, torch.float64)):
        streams = meta(5, n, h, dtype=dtype)
        yield "mhc", (streams,)
        yield "mhc", (streams, meta(5, h), meta(5, n), meta(5, n, n))
        yield "mhc", (streams, meta(1, h), meta(5, n), meta(5, n, n))  # broadcast y
    for h, dtype, last in itertools.product((16, 24), (torch.float32, torch.bfloat16, torch.float64), (False, True)):
        groups = [meta(5, 3, h, dtype=dtype), meta(5, 1, h, dtype=dtype)]
        plus = meta(5, h, dtype=dtype) if last else None
        yield "depth_attention", (meta(h), groups, plus)
        yield "depth_attention", (meta(h), [meta(5, 65, h, dtype=dtype)], plus)
        yield "depth_attention", (meta(h), [*groups, meta(1, 2, h, dtype=dtype)], plus)  # broadcast
        yield "depth_attention", (meta(h), groups * 3, plus)  # 6 groups
        yield "add_into_last_slot", (meta(5, 3, h, dtype=dtype), meta(5, h, dtype=dtype))
        yield "add_into_last_slot", (meta(5, 3, h, dtype=dtype), meta(5, h, dtype=torch.float16))
        yield "add_into_last_slot", (meta(5, 3, 2 * h, dtype=dtype)[..., :h], meta(5, h, dtype=dtype))


def _residual_facts(op, args):
    if op == "depth_attention":
        query, groups, plus = args
        return registry.get(op).facts(query, groups, last_plus=plus)
    return registry.get(op).facts(*args)


@pytest.mark.parametrize("passed", [True, False])
def test_residual_auto_on_cuda_matches_the_old_policy(monkeypatch, passed):
    monkeypatch.setattr(efficient, "_triton_checked", lambda label, check, device, *key: passed)
    checked = 0
    for op, args in residual_calls():
        facts = dataclasses.replace(_residual_facts(op, args), device=CUDA)
        for backend in (efficient.Backend(), efficient.Backend(triton_mhc=False), efficient.Backend(triton=False)):
            enabled = backend.triton and (backend.triton_mhc or op != "mhc")
            got = registry.choose(op, "auto" if enabled else "pytorch", facts)
            assert got == _old_residual_auto(op, backend, args, passed), (op, backend, facts)
            checked += 1
    assert checked == 3 * (5 + 27 * 3 + 12 * 7)


def test_residual_ops_run_their_bodies_on_the_cpu(monkeypatch):
    """On the CPU every residual op asks the registry, which runs the PyTorch bodies."""
    chosen, choose = [], registry.choose
    monkeypatch.setattr(registry, "choose", lambda op, *args, **kwargs: chosen.append(
        (op, choose(op, *args, **kwargs))) or chosen[-1][1])
    n, h = 4, 16
    streams = torch.randn(5, n, h)
    u, post, res = efficient.mhc_pre(streams, torch.randn(24, n * h) * 0.1, torch.randn(24), torch.randn(3))
    efficient.stream_update(streams, u, post, res)
    efficient.depth_attention(torch.randn(h), [torch.randn(5, 3, h)])
    efficient.add_into_last_slot(torch.randn(5, 3, h), torch.randn(5, h))
    assert dict(chosen) == {op: "pytorch" for op in efficient.OPS}
    with pytest.raises(ValueError, match="mhc: backend 'triton' cannot run triton mhc: needs 2 <= n <= 8"):
        registry.require("mhc", "triton", torch.zeros(3, 9, 16))


@pytest.fixture
def overrides():
    """registry.override, cleared afterwards."""
    yield registry.override
    registry.override({})


def test_overrides_name_the_backend_of_auto_calls(monkeypatch, overrides):
    """An op in the override table runs its backend where the call asks for "auto", as if
    named (refusing a call it cannot take, with the reason); calls naming a backend keep it;
    a table with an unknown op or backend is refused whole; {} clears it."""
    x = torch.randn(2, 8, 3, 16, requires_grad=True)
    ran, choose = [], registry.choose
    monkeypatch.setattr(registry, "choose", lambda *args, **kw: ran.append(choose(*args, **kw)) or ran[-1])
    sparse.softmax_attention(x, x, x, window=(4, 0))
    overrides({"softmax_attention": "reference"})
    sparse.softmax_attention(x, x, x, window=(4, 0))
    sparse.softmax_attention(x, x, x, window=(4, 0), backend="gathered")
    assert ran == ["gathered", "reference", "gathered"]
    assert registry.named("softmax_attention") == "reference"
    assert registry.named("softmax_attention", "gathered") == "gathered"

    overrides({"rope": "triton"})  # on the CPU a call it cannot take says why
    with pytest.raises(registry.BackendUnavailable, match="rope: backend 'triton' cannot run t "):
        fused.rope(torch.randn(9, 2, 3, 12), torch.randn(9, 1, 1, 12))
    for table, message in (({"short_conv": "reference", "nope": "reference"}, "no op 'nope'"),
                           ({"short_conv": "flex"}, "short_conv: unknown backend 'flex'")):
        with pytest.raises(ValueError, match=message):
            overrides(table)
        assert registry.named("rope") == "triton"  # the table before stands
    overrides({})
    assert registry.named("rope") == "auto"


def test_overrides_reach_the_per_token_ops(monkeypatch, overrides):
    """dsa_select picks its reference or its gathered form before the registry runs anything:
    the override table decides that too."""
    from megatron_ext.kernels.sparse import dsa

    calls = []
    monkeypatch.setattr(dsa, "dsa_select_reference", lambda *args, **kw: calls.append("reference"))
    monkeypatch.setattr(dsa, "select_keys", lambda *args, **kw: calls.append("gathered"))
    index = (torch.randn(1, 6, 2, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 2))
    sparse.dsa_select(*index, top_k=2)
    overrides({"dsa_select": "reference"})
    sparse.dsa_select(*index, top_k=2)
    assert calls == ["gathered", "reference"]
