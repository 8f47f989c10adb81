"""The residual-stream ops (megatron_ext.kernels.residual): the memory-lean autograd Functions
equal the plain-autograd definitions in value and gradient, Sinkhorn is (nearly) doubly
stochastic and recomputes its iterations instead of storing them, and the ops keep for backward
only what their docstrings say."""

import pytest
import torch

import harness
import triton_interpreter
from megatron_ext.kernels.residual import efficient, reference

N, H = 4, 16


def _leaf(*shape, scale=1.0):
    return (scale * torch.randn(*shape)).requires_grad_()


def _same_values_and_grads(make_inputs, fast, slow, atol=1e-5):
    torch.manual_seed(0)
    inputs = make_inputs()
    out_fast, out_slow = fast(*inputs), slow(*inputs)
    out_fast = out_fast if isinstance(out_fast, tuple) else (out_fast,)
    out_slow = out_slow if isinstance(out_slow, tuple) else (out_slow,)
    grads = [torch.randn_like(o) for o in out_slow]
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    for a, b in zip(out_fast, out_slow):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
    for a, b in zip(torch.autograd.grad(out_fast, leaves, grads),
                    torch.autograd.grad(out_slow, leaves, grads)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=atol)


def test_sinkhorn_is_doubly_stochastic():
    torch.manual_seed(0)
    logits = torch.randn(64, N, N)
    m = reference.sinkhorn(logits, iters=20)
    assert (m > 0).all()
    # The last pass normalises columns: exact up to eps. Rows converge with the iterations.
    torch.testing.assert_close(m.sum(-2), torch.ones(64, N), rtol=0, atol=1e-5)
    torch.testing.assert_close(m.sum(-1), torch.ones(64, N), rtol=0, atol=1e-3)
    converged = reference.sinkhorn(logits, iters=100)
    torch.testing.assert_close(converged.sum(-1), torch.ones(64, N), rtol=0, atol=1e-5)


def test_sinkhorn_recompute_backward_equals_autograd_through_iterations():
    _same_values_and_grads(lambda: (_leaf(3, 5, N, N, scale=2.0), 20),
                           efficient.sinkhorn, reference.sinkhorn)
    logits = _leaf(32, N, N)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        efficient.sinkhorn(logits, 20)
    assert saved == [logits.numel()]  # the input only, not 40 normalised matrices


def _mhc_pre_reference(streams, weight, bias, gate):
    mixes = reference.rms_project(streams.flatten(-2), weight)
    pre, post, res = reference.mhc_coefficients(mixes, bias, gate, N)
    return reference.stream_mix(streams, pre), post, res


@pytest.mark.parametrize("op", ["mhc_pre", "rms_project", "stream_mix", "stream_update",
                                "depth_attention"])
def test_efficient_op_equals_reference(op):
    width = (2 + N) * N
    inputs = {
        "mhc_pre": lambda: (_leaf(3, 5, N, H), _leaf(width, N * H, scale=0.1), _leaf(width),
                            _leaf(3, scale=0.5)),
        "rms_project": lambda: (_leaf(3, 5, N * H), _leaf(width, N * H, scale=0.05)),
        "stream_mix": lambda: (_leaf(3, 5, N, H), _leaf(3, 5, N)),
        "stream_update": lambda: (_leaf(3, 5, N, H), _leaf(3, 5, H), _leaf(3, 5, N),
                                  _leaf(3, 5, N, N)),
    }
    if op == "depth_attention":
        # Sources as the model passes them: a view into a packed state plus a separate tensor.
        packed, extra, query = _leaf(3, 5, 3 * H), _leaf(3, 5, H), _leaf(H)

        def call(fn):
            return lambda q, p, e: fn(q, [p.unflatten(-1, (3, H)), e.unsqueeze(-2)])

        _same_values_and_grads(lambda: (query, packed, extra), call(efficient.depth_attention),
                               call(reference.depth_attention))
        return
    slow = _mhc_pre_reference if op == "mhc_pre" else getattr(reference, op)
    _same_values_and_grads(inputs[op], getattr(efficient, op), slow)


def test_stream_ops_keep_the_stream_in_its_dtype_or_nothing():
    streams = torch.randn(8, 2, N, 64, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(8, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    post, res = torch.rand(8, 2, N, requires_grad=True), torch.rand(8, 2, N, N, requires_grad=True)
    small = post.nbytes + res.nbytes
    kept, _ = harness.saved_bytes(efficient.stream_update, streams, y, post, res)
    assert kept == streams.nbytes + y.nbytes + small  # no fp32 copy of the streams
    dropped, _ = harness.saved_bytes(efficient.stream_update, streams, y, post, res,
                                     recompute_input=lambda: streams.detach())
    assert dropped == y.nbytes + small


def test_depth_attention_reads_a_last_slot_plus_an_output_and_passes_its_input_on():
    """``last_plus`` reads the first group's last source as that slot plus a tensor, and
    ``pass_through`` also returns the first group as read (with ``last_plus``: a new tensor with
    it added), whose gradient from later uses is added to the op's own: as autograd through the
    sum, the copy and the sum of the two uses would give (each option alone and both together,
    as block AttnRes's FFN calls it)."""
    packed, plus, extra, query = _leaf(3, 5, 4 * H), _leaf(3, 5, H), _leaf(3, 5, H), _leaf(H)
    weight = torch.randn(4, H)

    def later_use(slots):  # any use of the passed-on state after the op
        return (slots * weight).sum(-1)

    def fused(q, p, e, a=None, pass_through=False):
        result = efficient.depth_attention(q, [p.unflatten(-1, (4, H)), e.unsqueeze(-2)],
                                           last_plus=a, pass_through=pass_through)
        return (result[0], later_use(result[1])) if pass_through else result

    def unfused(q, p, e, a=None, pass_through=False):
        slots = p.unflatten(-1, (4, H))
        read = slots if a is None else torch.cat([slots[..., :3, :],
                                                  (slots[..., 3, :] + a).unsqueeze(-2)], -2)
        out = reference.depth_attention(q, [read, e.unsqueeze(-2)])
        return (out, later_use(read)) if pass_through else out

    for inputs in ((query, packed, extra), (query, packed, extra, plus)):
        for pass_through in (False, True):
            _same_values_and_grads(lambda: inputs,
                                   lambda *x: fused(*x, pass_through=pass_through),
                                   lambda *x: unfused(*x, pass_through=pass_through))


def test_mhc_pre_passes_its_streams_on():
    """``pass_through`` also returns the streams, whose gradient from a later use (mHC's stream
    update) is added to the op's own inside its backward: as autograd's sum of the two uses."""
    width = (2 + N) * N
    y = torch.randn(3, 5, H)

    def inputs():
        return (_leaf(3, 5, N, H), _leaf(width, N * H, scale=0.1), _leaf(width),
                _leaf(3, scale=0.5))

    def fused(*x):
        u, post, res, passed = efficient.mhc_pre(*x, pass_through=True)
        return u, post, res, reference.stream_update(passed, y, post, res)

    def unfused(streams, *x):
        u, post, res = _mhc_pre_reference(streams, *x)
        return u, post, res, reference.stream_update(streams, y, post, res)

    _same_values_and_grads(inputs, fused, unfused)


def test_depth_attention_keeps_references_and_scalars():
    packed = torch.randn(8, 2, 5 * 64, requires_grad=True)
    query = torch.randn(64, requires_grad=True)
    kept, _ = harness.saved_bytes(efficient.depth_attention, query,
                                  [packed.unflatten(-1, (5, 64))])
    per_token_scalars = 3 * 8 * 2 * 5 * 4  # logits, inverse RMS, weights (fp32)
    assert kept == packed.nbytes + query.nbytes + per_token_scalars


def test_compiled_mhc_pre_bodies_hold_no_sinkhorn_iterations(monkeypatch):
    """The Sinkhorn runs between mhc_pre's compiled bodies (on CUDA in one Triton kernel each
    way, elsewhere in bodies of its own): the graphs Dynamo captures for the mHC bodies are the
    same for 1 and 20 iterations. Dynamo only (a backend that records the graphs), no Inductor."""
    captured = {}
    compile_ = torch.compile

    def recording_compile(fn, **kwargs):
        def backend(graph_module, example_inputs):
            captured.setdefault(fn.__name__, []).append(len(graph_module.graph.nodes))
            return graph_module.forward
        return compile_(fn, backend=backend, **kwargs)

    monkeypatch.setattr(torch, "compile", recording_compile)
    monkeypatch.setattr(efficient, "_compiled", {})
    monkeypatch.setattr(efficient, "_compile_failed", set())
    compiled = efficient.Backend(compiled=True)
    sizes = {}
    try:
        for iters in (1, 20):
            torch._dynamo.reset()
            efficient._compiled.clear()
            torch.manual_seed(0)
            width = (2 + N) * N
            streams, weight = _leaf(3, 5, N, H), _leaf(width, N * H, scale=0.1)
            u, post, res = efficient.mhc_pre(streams, weight, _leaf(width), _leaf(3), iters,
                                             backend=compiled)
            (u.sum() + post.sum() + (res * torch.randn_like(res)).sum()).backward()
            sizes[iters] = dict(captured)
            captured.clear()
        assert not efficient.compile_failures()
    finally:
        torch._dynamo.reset()
    for body in ("_mhc_pre_forward_body", "_mhc_pre_vjp"):
        assert sizes[1][body] == sizes[20][body], sizes
    # On the CPU the iterations are compiled on their own: their graphs grow with them.
    assert sizes[20]["sinkhorn"][0] > sizes[1]["sinkhorn"][0] + 100, sizes


def test_a_body_whose_compiled_form_fails_runs_eagerly_from_then_on(monkeypatch, caplog):
    """A compiled body that raises is run eagerly (the same values), logged once and not
    compiled again; the other bodies are still compiled."""
    tried = []

    def failing_compile(fn, **kwargs):
        def call(*args):
            tried.append(fn.__name__)
            if fn.__name__ == "_stream_mix_forward_body":
                raise RuntimeError("no compiler here")
            return fn(*args)
        return call

    monkeypatch.setattr(torch, "compile", failing_compile)
    monkeypatch.setattr(efficient, "_compiled", {})
    monkeypatch.setattr(efficient, "_compile_failed", set())
    compiled = efficient.Backend(compiled=True)
    streams, weights = _leaf(3, N, H), _leaf(3, N)
    with caplog.at_level("WARNING"):
        outs = [efficient.stream_mix(streams, weights, backend=compiled) for _ in range(2)]
    eager = efficient._stream_mix_forward_body(streams.detach(), weights.detach())
    for out in outs:
        torch.testing.assert_close(out, eager, rtol=0, atol=0)
    outs[0].sum().backward()
    assert caplog.text.count("_stream_mix_forward_body failed") == 1, caplog.text
    assert efficient.compile_failures() == ["_stream_mix_forward_body"]
    assert tried == ["_stream_mix_forward_body", "_stream_mix_vjp"]


def test_triton_sinkhorn_that_fails_its_check_is_not_used(monkeypatch, caplog):
    """Kernels that import but compute the wrong thing on this device (a miscompile) are caught
    by the first-use check and the PyTorch iterations run instead: simulated on the CPU with a
    stand-in module whose forward is off by 1%."""
    import types

    from megatron_ext.kernels.residual import efficient, reference

    wrong = types.SimpleNamespace(
        MIN_N=2, MAX_N=8,
        sinkhorn_forward=lambda logits, iters, eps: 1.01 * reference.sinkhorn(logits.float(), iters, eps),
        sinkhorn_backward=lambda logits, grad, iters, eps: efficient._sinkhorn_vjp(
            logits.float(), grad.float(), iters, eps))
    monkeypatch.setattr(efficient, "_triton_kernels", lambda: wrong)
    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    efficient._triton_checked.cache_clear()
    logits = torch.randn(7, 4, 4, requires_grad=True)
    with caplog.at_level("WARNING"):
        out = efficient.sinkhorn(logits, 20)
    efficient._triton_checked.cache_clear()
    torch.testing.assert_close(out, reference.sinkhorn(logits.detach(), 20))
    assert "failed their check" in caplog.text
