"""kernels/sparse/flash.py on the CPU: the sink and its gradients around the FlashAttention
kernels, the two kernel calls of chosen blocks (MoBA, NSA) merged by their log-sum-exps, and the
first-use check, with the kernels replaced by flash_emulation.py's PyTorch emulation, against
the fp32 reference, in fp64. The kernels themselves run in tests/ops/test_sparse_flash.py.
"""
import functools

import pytest
import torch
import flash_emulation
from flash_emulation import allow_flash, emulate, emulate_cudnn, emulated_forward

from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import flash, routing, triton
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.sparse.reference import moba_attention_reference, softmax_attention_reference


@pytest.fixture
def emulated(monkeypatch):
    emulate(monkeypatch)


def _leaves(seed, batch, seq_len, kv_heads=2, sink=True):
    """fp64 q ``[B, T, 4, 8]``, k and v with ``kv_heads`` heads, the sink, and an output grad."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    leaves = {"q": randn(batch, seq_len, 4, 8), "k": randn(batch, seq_len, kv_heads, 8),
              "v": randn(batch, seq_len, kv_heads, 8)}
    if sink:
        leaves["sink"] = randn(4)
    return leaves, randn(batch, seq_len, 4, 8)


def _assert_equal(run, reference, leaves, grad, **options):
    """run's output and gradients equal the reference's (which computes in fp32)."""
    def outputs_and_grads(function):
        inputs = {name: x.clone().requires_grad_() for name, x in leaves.items()}
        out = function(inputs["q"], inputs["k"], inputs["v"], sink=inputs.get("sink"), **options)
        return [out, *torch.autograd.grad(out, list(inputs.values()), grad)]

    for name, a, b in zip(["o", *leaves], outputs_and_grads(run), outputs_and_grads(reference)):
        assert relative_error(a, b) < 1e-6, name


CALLS = [
    dict(batch=2, seq_len=45, causal=True, window=None, sink=True),
    dict(batch=2, seq_len=45, causal=True, window=(6, 0), sink=True),
    dict(batch=1, seq_len=45, causal=False, window=(5, 3), sink=True),
    dict(batch=1, seq_len=45, causal=False, window=None, sink=False),
    dict(batch=1, seq_len=50, causal=True, window=(7, 0), sink=True, cu_seqlens=[0, 13, 13, 50]),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sink_and_gradients_equal_the_reference(emulated, call):
    leaves, grad = _leaves(0, call["batch"], call["seq_len"], sink=call["sink"])
    cu_seqlens = call.get("cu_seqlens")
    _assert_equal(flash.flash_attention, softmax_attention_reference, leaves, grad,
                  causal=call["causal"], window=call["window"],
                  cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))


MOBA_CALLS = [
    dict(batch=2, seq_len=150, block_size=32, top_k=3, kv_heads=2, sink=True),  # partial last block
    dict(batch=1, seq_len=128, block_size=32, top_k=4, kv_heads=4, sink=False),  # every earlier block
    dict(batch=2, seq_len=100, block_size=32, top_k=1, kv_heads=1, sink=True),  # own block only
    dict(batch=2, seq_len=130, block_size=16, top_k=3, kv_heads=1, sink=True),  # 4 heads on 1
    dict(batch=1, seq_len=20, block_size=32, top_k=1, kv_heads=2, sink=True),  # one partial block
]


@pytest.mark.parametrize("call", MOBA_CALLS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_moba_equals_the_reference(emulated, call):
    leaves, grad = _leaves(2, call["batch"], call["seq_len"], call["kv_heads"], call["sink"])
    _assert_equal(flash.moba_attention, moba_attention_reference, leaves, grad,
                  block_size=call["block_size"], top_k=call["top_k"])


@pytest.mark.parametrize("call", [c for c in MOBA_CALLS if c["seq_len"] % c["block_size"] == 0]
                         + [dict(batch=2, seq_len=96, block_size=32, top_k=2, kv_heads=2, sink=True),
                            dict(batch=1, seq_len=64, block_size=16, top_k=3, kv_heads=1, sink=True)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_moba_with_own_blocks_on_cudnn_equals_the_reference(monkeypatch, call):
    """With every block full the own blocks go to cuDNN (emulated, in its [N, H, L, D] layout
    with a log-sum-exp [N, H, L]); the merge and the backward's shared log-sum-exp still give the
    reference's output and gradients."""
    emulate_cudnn(monkeypatch)
    calls, forward = [], flash._cudnn_forward
    monkeypatch.setattr(flash, "_cudnn_forward",
                        lambda *args: calls.append(args[0].shape) or forward(*args))
    leaves, grad = _leaves(2, call["batch"], call["seq_len"], call["kv_heads"], call["sink"])
    _assert_equal(flash.moba_attention, moba_attention_reference, leaves, grad,
                  block_size=call["block_size"], top_k=call["top_k"])
    blocks = call["batch"] * call["seq_len"] // call["block_size"]
    assert calls == [(blocks, 4, call["block_size"], 8)]


@pytest.mark.parametrize("selection_heads", [2, 4], ids=["per key/value head", "per query head"])
def test_block_selection_equals_the_reference(emulated, selection_heads):
    leaves, grad = _leaves(3, 2, 100, kv_heads=2)
    generator = torch.Generator().manual_seed(4)
    block_size, num_blocks = 16, 7
    chosen = torch.rand(2, selection_heads, 100, num_blocks, generator=generator) < 0.4
    own = torch.arange(100) // block_size
    chosen[:, :, torch.arange(100), own] = True
    chosen &= torch.arange(num_blocks)[None, :] <= own[:, None]
    heads_of = torch.arange(4) // (4 // selection_heads)
    allowed = chosen[:, heads_of][..., own] & torch.ones(100, 100, dtype=torch.bool).tril()
    _assert_equal(functools.partial(flash.block_selection_attention, chosen=chosen,
                                    block_size=block_size, top_k=num_blocks),
                  functools.partial(softmax_attention_reference, allowed=allowed), leaves, grad)


def test_nsa_on_flash_equals_the_reference(emulated, monkeypatch):
    allow_flash(monkeypatch)
    leaves, grad = _leaves(5, 2, 150, kv_heads=2)
    generator = torch.Generator().manual_seed(6)
    gates = torch.rand(2, 150, 4, 3, generator=generator, dtype=torch.float64)
    k_weights, v_weights = (torch.rand(2, 16, generator=generator, dtype=torch.float64)
                            for _ in range(2))
    sizes = dict(compress_block=16, compress_stride=8, select_block=32, select_top_k=3, window=40)

    def nsa(backend):
        return lambda q, k, v, sink: sparse.nsa_attention(q, k, v, gates, k_weights, v_weights,
                                                          sink=sink, backend=backend, **sizes)

    _assert_equal(nsa("flash"), nsa("reference"), leaves, grad)


def test_auto_runs_nsa_on_flash_from_its_minimum_length(emulated, monkeypatch):
    """Under "auto", NSA's selected and window branches go to flash.py from
    ``NSA_FLASH_MIN_LEN`` tokens (where it runs and passed its check), and equal the reference."""
    allow_flash(monkeypatch)
    monkeypatch.setattr(flash, "checked", lambda device, dtype: True)
    monkeypatch.setattr(sparse.nsa, "NSA_FLASH_MIN_LEN", 100)
    calls, run = [], flash.block_selection_attention
    monkeypatch.setattr(flash, "block_selection_attention",
                        lambda *args, **kwargs: calls.append(1) or run(*args, **kwargs))
    sizes = dict(compress_block=16, compress_stride=8, select_block=32, select_top_k=3, window=40)
    for seq_len, expected in ((99, 0), (100, 1)):
        leaves, grad = _leaves(7, 1, seq_len, kv_heads=2)
        generator = torch.Generator().manual_seed(8)
        gates = torch.rand(1, seq_len, 4, 3, generator=generator, dtype=torch.float64)
        weights = torch.rand(2, 16, generator=generator, dtype=torch.float64)

        def nsa(backend):
            return lambda q, k, v, sink: sparse.nsa_attention(q, k, v, gates, weights, weights,
                                                              sink=sink, backend=backend, **sizes)

        _assert_equal(nsa("auto"), nsa("reference"), leaves, grad)
        assert len(calls) == expected, seq_len


def _plan_example():
    chosen = torch.zeros(1, 2, 5, 3, dtype=torch.bool)  # B = 1, Hq = 2, T = 5, blocks of 2
    chosen[0, :, torch.arange(5), torch.arange(5) // 2] = True  # own blocks
    chosen[0, 0, 4, 0] = chosen[0, 1, 3, 0] = chosen[0, 1, 4, 1] = True
    return chosen


def test_selection_plan_lists_the_selected_earlier_blocks():
    plan = flash._selection_plan(_plan_example(), block_size=2, top_k=2, kv_heads=2)
    assert plan.own_cu.tolist() == [0, 2, 4, 5] and plan.block_len == 2
    # (head 0, block 0): token 4; (head 1, block 0): token 3; (head 1, block 1): token 4
    assert plan.rows.tolist() == [4 * 2 + 0, 3 * 2 + 1, 4 * 2 + 1]
    assert plan.pairs_cu.tolist() == [0, 1, 1, 1, 2, 3, 3] and plan.pairs_of_row is None
    assert plan.keys_cu.tolist() == [0, 2, 4, 5, 7, 9, 10]
    assert plan.max_pairs == 3  # tokens 2..4 may all choose block 0


def test_selection_plan_shares_a_key_value_head_among_its_selection_heads():
    """Both selection heads on one key/value head: one sequence per (key/value head, block),
    holding the rows of both heads, against keys listed once."""
    plan = flash._selection_plan(_plan_example(), block_size=2, top_k=2, kv_heads=1)
    # block 0: (head 0, token 4), (head 1, token 3); block 1: (head 1, token 4)
    assert plan.rows.tolist() == [4 * 2 + 0, 3 * 2 + 1, 4 * 2 + 1]
    assert plan.pairs_cu.tolist() == [0, 2, 3, 3]
    assert plan.keys_cu.tolist() == [0, 2, 4, 5]
    assert plan.max_pairs == 6  # tokens 2..4 of both heads may all choose block 0


def test_a_sink_of_minus_infinity_is_plain_softmax(emulated):
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 30, 2, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    sink = torch.full((2,), float("-inf"), dtype=torch.float64, requires_grad=True)
    out = flash.flash_attention(q, k, v, sink=sink)
    (d_sink,) = torch.autograd.grad(out.sum(), sink)
    torch.testing.assert_close(out, flash.flash_attention(q, k, v), rtol=0, atol=0)
    assert torch.equal(d_sink, torch.zeros_like(d_sink))


def test_flash_refuses_what_it_does_not_cover():
    def qkv(dtype=torch.bfloat16, dim=16, keys=10):
        return (torch.zeros(1, 10, 2, dim, dtype=dtype), torch.zeros(1, keys, 2, dim, dtype=dtype),
                torch.zeros(1, keys, 2, dim, dtype=dtype))

    def refusal(*tensors, **options):
        return routing.flash_refusal(routing.attention_facts(*tensors, **options))

    assert "fp16 or bf16" in refusal(*qkv(torch.float32))
    assert "multiples of 8" in refusal(*qkv(dim=12))
    assert "not as long" in refusal(*qkv(keys=11))
    assert "extra mask" in refusal(*qkv(), allowed=True)
    assert refusal(*qkv()) == "FlashAttention runs on CUDA only"
    with pytest.raises(ValueError, match="softmax_attention: backend 'flash' cannot run FlashAttention runs on "
                                         "CUDA only"):
        sparse.softmax_attention(*qkv(), backend="flash")


def test_first_use_check_passes_faithful_kernels_and_catches_a_wrong_scale(emulated, monkeypatch):
    errors = flash.check(torch.device("cpu"), torch.bfloat16)
    assert set(errors) == {"o", "grad_q", "grad_k", "grad_v", "grad_sink"}
    assert max(errors.values()) <= flash.CHECK_TOLERANCE, errors
    flash.checked.cache_clear()
    assert flash.checked(torch.device("cpu"), torch.bfloat16)

    def wrong_scale(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        return emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right,
                                1.1 * q.shape[-1] ** -0.5)

    monkeypatch.setattr(flash, "_kernel_forward", wrong_scale)
    assert max(flash.check(torch.device("cpu"), torch.bfloat16).values()) > flash.CHECK_TOLERANCE
    flash.checked.cache_clear()
    assert not flash.checked(torch.device("cpu"), torch.bfloat16)
    flash.checked.cache_clear()


def test_cudnn_check_passes_faithful_calls_and_a_failure_keeps_flash_attention(monkeypatch):
    """cuDNN's own first-use check (MoBA with full blocks, the own blocks on cuDNN, emulated)
    passes faithful calls and fails a cuDNN backward that reads its log-sum-exp in another
    layout; block selections then run every block on FlashAttention-2 (still exact), and the
    FlashAttention check, which runs nothing on cuDNN, still passes."""
    checked = flash.cudnn_checked
    emulate_cudnn(monkeypatch)
    monkeypatch.setattr(flash, "cudnn_checked", checked)
    device = torch.device("cpu")
    errors = flash.check_cudnn(device, torch.bfloat16)
    assert set(errors) == {"o", "grad_q", "grad_k", "grad_v", "grad_sink"}
    assert max(errors.values()) <= flash.CHECK_TOLERANCE, errors
    checked.cache_clear()
    assert checked(device, torch.bfloat16)

    def misread_backward(d_out, q, k, v, out, lse, state, scale, causal=True, bias=None):
        n, heads, length = lse.shape
        lse = lse.reshape(n, length, heads).transpose(1, 2)  # [N, L, H] read as [N, H, L]
        return flash_emulation.emulated_cudnn_backward(d_out, q, k, v, out, lse, state, scale,
                                                       causal, bias)

    monkeypatch.setattr(flash, "_cudnn_backward", misread_backward)
    assert max(flash.check_cudnn(device, torch.bfloat16).values()) > flash.CHECK_TOLERANCE
    checked.cache_clear()
    assert not checked(device, torch.bfloat16)
    assert not checked(device, torch.float64)  # the dtype of the call below
    calls, forward = [], flash._cudnn_forward
    monkeypatch.setattr(flash, "_cudnn_forward",
                        lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    leaves, grad = _leaves(2, 2, 96, kv_heads=2)
    _assert_equal(flash.moba_attention, moba_attention_reference, leaves, grad, block_size=32,
                  top_k=2)
    assert not calls
    assert max(flash.check(device, torch.bfloat16).values()) <= flash.CHECK_TOLERANCE
    checked.cache_clear()


def _causal_selection(seed, batch, seq_len, top_k, twice=True):
    """``[B, T, K]`` int32: K keys at or before each query at random (all of them, then -1,
    where it has fewer), a key listed twice (where ``twice``), and a query (t = 20) with
    none."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.rand(batch, seq_len, seq_len, generator=generator).tril().topk(top_k).indices
    selected = torch.where(keys <= torch.arange(seq_len)[:, None], keys, -1).int()
    if twice:
        selected[0, 30, 1] = selected[0, 30, 0]
    selected[:, 20] = -1
    return selected


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("sink", [True, False])
def test_causal_selection_on_cudnn_equals_the_reference(monkeypatch, kv_heads, sink):
    """DSA's attention on cuDNN with the selection as a bias (emulated), T = 37, 7 keys a query
    (a query with none: no output, and no gradient reaches any key through it), with and
    without a sink, MHA and groups of 2, against the reference."""
    emulate_cudnn(monkeypatch)
    leaves, grad = _leaves(4, 2, 37, kv_heads=kv_heads, sink=sink)
    selected = _causal_selection(5, 2, 37, 7)
    _assert_equal(flash.causal_selection_attention, sparse.reference.dsa_attention_reference,
                  leaves, grad, selected=selected)
    out, lse = flash.causal_selection_attention(leaves["q"], leaves["k"], leaves["v"], selected,
                                                sink=leaves.get("sink"), return_lse=True)
    assert torch.equal(out[:, 20], torch.zeros_like(out[:, 20]))
    # the log-sum-exp the indexer loss's target may reuse: +inf for the query with no key
    # (without a sink), no gradient
    want = triton.reference_lse(leaves["q"], leaves["k"], selected, leaves.get("sink"))
    assert not lse.requires_grad
    torch.testing.assert_close(lse.float(), want, rtol=1e-5, atol=1e-5)
    assert sink or torch.isposinf(lse[:, 20]).all()


def test_dsa_attention_takes_cudnn_for_causal_selections(monkeypatch):
    """``causal=True`` drops the listed keys after their query (so does every backend), and
    then "flash" (and "auto", once cuDNN passed its check) runs the cuDNN form; without it
    "flash" refuses and "auto" keeps its other backends."""
    emulate_cudnn(monkeypatch)
    allow_flash(monkeypatch, cudnn=True)
    calls, forward = [], flash._cudnn_forward
    monkeypatch.setattr(flash, "_cudnn_forward",
                        lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    leaves, _ = _leaves(6, 2, 37)
    x = [leaves[name] for name in ("q", "k", "v")]
    selected = _causal_selection(7, 2, 37, 7, twice=False)  # (the backends may differ there)
    later = selected.clone()
    later[:, 3, -1] = 30  # a key after query 3
    want = sparse.dsa_attention(*x, selected, sink=leaves["sink"], backend="reference")
    assert not torch.allclose(want, sparse.dsa_attention(*x, later, sink=leaves["sink"],
                                                         backend="reference"))
    for backend in ("reference", "gathered", "flash", "auto"):
        got = sparse.dsa_attention(*x, later, sink=leaves["sink"], causal=True, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(calls) == 2  # flash and auto
    with pytest.raises(ValueError, match="causal selections only"):
        sparse.dsa_attention(*x, selected, backend="flash")
    sparse.dsa_attention(*x, selected, backend="auto")
    assert len(calls) == 2
    # a bias (2 x 37 x 37 values of 8 bytes here) over the limit: "auto" keeps the others
    monkeypatch.setattr(sparse.dsa, "CAUSAL_SELECTION_MAX_BIAS", 2 * 37 * 37 * 8 - 1)
    sparse.dsa_attention(*x, selected, causal=True, backend="auto")
    assert len(calls) == 2
    monkeypatch.setattr(sparse.dsa, "CAUSAL_SELECTION_MAX_BIAS", 2 * 37 * 37 * 8)
    sparse.dsa_attention(*x, selected, causal=True, backend="auto")
    assert len(calls) == 3


def test_first_use_under_inference_mode_runs_the_check(emulated):
    """A first call in an evaluation under torch.inference_mode runs the check as any other
    (its tensors would otherwise be inference tensors, which autograd refuses, and the failed
    check would turn the kernels off for the process)."""
    flash.checked.cache_clear()
    with torch.inference_mode():
        assert flash.checked(torch.device("cpu"), torch.bfloat16)
    flash.checked.cache_clear()


RATE = 4


def _entries(k, v):
    """CSA-like entries of blocks of RATE tokens, different from every raw key and value."""
    count = k.shape[1] // RATE
    return k[:, RATE - 1::RATE][:, :count] + v[:, :count * RATE:RATE], v[:, RATE - 1::RATE] * 0.5


def _compressed_selection(seed, batch, seq_len, top_k):
    """``[B, T, K]``: up to K entries complete at each query at random (-1 where fewer), and a
    query (t = 20) with none."""
    generator = torch.Generator().manual_seed(seed)
    complete = torch.arange(RATE - 1, seq_len, RATE) <= torch.arange(seq_len)[:, None]
    scores = torch.rand(batch, seq_len, complete.shape[1], generator=generator)
    picked = scores.masked_fill(~complete, -1.0).topk(top_k)
    selected = torch.where(picked.values >= 0, picked.indices, -1).int()
    selected[:, 20] = -1
    return selected


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize("query_chunk", [3, 16, None])
def test_csa_on_flash_and_cudnn_equals_the_reference(monkeypatch, kv_heads, sink, query_chunk):
    """CSA's attention with its window on FlashAttention-2 and its selected entries on cuDNN
    (both emulated), merged by their log-sum-exps: T = 45 in blocks of 4 (11 entries), a window
    of 5, 4 entries a query (a query with none), in one chunk of queries or in chunks of 16 or
    of 3 (the first of which sees no entry and is skipped), MHA and groups of 2, with and
    without a sink, against the reference, forward and backward (the entries' gradients reach
    k and v)."""
    emulate_cudnn(monkeypatch)
    leaves, grad = _leaves(8, 2, 45, kv_heads=kv_heads, sink=sink)
    selected = _compressed_selection(9, 2, 45, 4)

    def ours(q, k, v, sink=None):
        return flash.compressed_selection_attention(q, k, v, *_entries(k, v), selected, window=5,
                                                    rate=RATE, sink=sink, query_chunk=query_chunk)

    def reference(q, k, v, sink=None):
        return sparse.reference.csa_attention_reference(q, k, v, *_entries(k, v), selected,
                                                        window=5, sink=sink)

    _assert_equal(ours, reference, leaves, grad)
    # the log-sum-exp over the entries and the sink that CSA's indexer loss may reuse: +inf for
    # the query with no entry (without a sink), no gradient
    q, k, v = (leaves[name] for name in ("q", "k", "v"))
    compressed_k, compressed_v = _entries(k, v)
    _, lse = flash.compressed_selection_attention(
        q, k, v, compressed_k, compressed_v, selected, window=5, rate=RATE,
        sink=leaves.get("sink"), query_chunk=query_chunk, return_lse=True)
    assert not lse.requires_grad
    want = triton.reference_lse(q, compressed_k, selected, leaves.get("sink"))
    torch.testing.assert_close(lse, want.to(lse.dtype), rtol=1e-6, atol=1e-6)
    assert sink or torch.isposinf(lse[:, 20]).all()


def test_csa_attention_drops_early_entries_and_takes_flash(monkeypatch):
    """With ``rate``, an entry listed before it is complete is dropped on every backend; then
    "flash" (and "auto", both kernels checked) runs the FlashAttention-2 + cuDNN form, equal to
    the others; without ``rate`` "flash" refuses and "auto" runs another backend."""
    emulate_cudnn(monkeypatch)
    allow_flash(monkeypatch, cudnn=True)
    monkeypatch.setattr(flash, "checked", lambda device, dtype: True)
    calls, forward = [], flash._cudnn_forward
    monkeypatch.setattr(flash, "_cudnn_forward",
                        lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    leaves, _ = _leaves(10, 2, 45)
    x = [leaves[name] for name in ("q", "k", "v")]
    entries = _entries(x[1], x[2])
    selected = _compressed_selection(11, 2, 45, 4)
    early = selected.clone()
    early[:, 9, -1] = 5  # entry 5 (tokens 20-23) at query 9
    options = dict(window=5, sink=leaves["sink"])
    want = sparse.csa_attention(*x, *entries, selected, backend="reference", **options)
    assert not torch.allclose(want, sparse.csa_attention(*x, *entries, early,
                                                         backend="reference", **options))
    for backend in ("reference", "gathered", "flash", "auto"):
        got = sparse.csa_attention(*x, *entries, early, backend=backend, rate=RATE, **options)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert len(calls) == 2  # flash and auto, one chunk of queries each
    with pytest.raises(ValueError, match="compression rate"):
        sparse.csa_attention(*x, *entries, selected, backend="flash", **options)
    sparse.csa_attention(*x, *entries, selected, backend="auto", **options)
    assert len(calls) == 2


def test_csa_on_flash_and_cudnn_with_packed_sequences_equals_the_reference(monkeypatch):
    """Packed sequences (``cu_seqlens``, one of them empty, one shorter than a block): the
    window stays in each sequence, and every chunk of queries runs against all the entries
    (those of other sequences are not selected), against the reference."""
    emulate_cudnn(monkeypatch)
    leaves, grad = _leaves(12, 1, 50)
    cu_seqlens = torch.tensor([0, 13, 13, 16, 50])
    entries = sparse.compressed_entries(50, RATE, cu_seqlens)
    count = len(entries)
    tokens = torch.arange(50)[:, None]
    sees = entries.sees(0, 0, tokens, torch.arange(count)[None, :])  # [T, N]
    scores = torch.rand(1, 50, count, generator=torch.Generator().manual_seed(13))
    picked = scores.masked_fill(~sees, -1.0).topk(3)
    selected = torch.where(picked.values >= 0, picked.indices, -1).int()
    assert (selected >= 0).any()

    def entries_of(k, v):
        return k[:, :count] * 0.5 + v[:, 1:count + 1], v[:, :count]

    def run(backend):
        def call(q, k, v, sink=None):
            return sparse.csa_attention(q, k, v, *entries_of(k, v), selected, window=5, sink=sink,
                                        cu_seqlens=cu_seqlens, backend=backend, rate=RATE)
        return call

    allow_flash(monkeypatch, cudnn=True)
    monkeypatch.setattr(flash, "CSA_QUERY_CHUNK", 16)
    _assert_equal(run("flash"), run("reference"), leaves, grad)
