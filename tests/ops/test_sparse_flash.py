"""CUDA checks (skipped without a GPU) of the "flash" backend of softmax_attention,
moba_attention and nsa_attention (kernels/sparse/flash.py: torch's FlashAttention-2 kernels,
the sink through their log-sum-exp) against the fp32 reference, forward and backward (q, k, v
and the sink), in bf16 and fp16: causal, causal with a window, a two-sided window without
causality, packed sequences (one empty, one across the window), grouped heads, and lengths of
1, 63, 64, 65 and 1000 tokens; MoBA with partial last blocks or full ones (the own blocks then
on cuDNN, also compared with them on FlashAttention-2; from blocks of 128 the earlier blocks on
cuDNN in chunks, compared likewise), top-k of 1 to 8; NSA (its
selected and window branches on the kernels) against the gathered path; DSA's attention over
a causal selection on cuDNN with the selection as a bias (odd lengths, a query with no key, a
key listed twice, with and without a sink); CSA's attention with its window on
FlashAttention-2 and its selected entries on cuDNN (one chunk of queries or several); a sink
of -inf; the first-use checks (the path's
and its cuDNN calls'); and "auto" choosing it on a GPU.

Tolerance: relative error (Frobenius norm) 2e-2 on the output and each gradient, the first-use
check's (flash.CHECK_TOLERANCE): the kernels round q, k, v, P and o to 16 bits (about 2^-8
each); a window one token off or a scale 10% off gives 0.08 to 0.19 (flash.py).
"""
import pytest
import torch

from megatron_ext.kernels import registry, sparse
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.sparse import flash, routing, triton

pytestmark = pytest.mark.gpu

HQ, HKV, D = 4, 2, 64
OPTIONS = {
    "causal": dict(causal=True),
    "causal+window": dict(causal=True, window=(150, 0)),
    "two-sided window": dict(causal=False, window=(40, 25)),
    "full": dict(causal=False),
}
PACKED = [0, 37, 37, 300, 1000]
# The log-sum-exp of DSA's attention on cuDNN in bf16 against the fp32 reference's on the same
# rounded q and k, largest absolute difference: measured 9.5e-7 on an H200; a
# scale 1% off moves it by 3e-2 (fp32, on the CPU, T = 1000, 100 keys a query)
LSE_TOLERANCE = 1e-5


def _run(backend, leaves, grad, dtype, op=sparse.softmax_attention, **options):
    inputs = {name: (x.to(dtype) if name != "sink" else x).detach().requires_grad_()
              for name, x in leaves.items()}
    out = op(inputs["q"], inputs["k"], inputs["v"], sink=inputs.get("sink"), backend=backend,
             **options)
    grads = torch.autograd.grad(out.float(), list(inputs.values()), grad)
    return {"o": out.float(), **{f"grad_{n}": g.float() for n, g in zip(inputs, grads)}}


def _leaves(batch, seq_len, sink=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = {"q": torch.randn(batch, seq_len, HQ, D, device="cuda", generator=g),
         "k": torch.randn(batch, seq_len, HKV, D, device="cuda", generator=g),
         "v": torch.randn(batch, seq_len, HKV, D, device="cuda", generator=g)}
    if sink:
        x["sink"] = torch.randn(HQ, device="cuda", generator=g)
    grad = torch.randn(batch, seq_len, HQ, D, device="cuda", generator=g)
    return x, grad


def _compare(leaves, grad, dtype, against=("reference", torch.float32), **options):
    # The reference gets the same rounded q, k, v (MoBA's choice of blocks depends on them).
    leaves = {name: x if name == "sink" else x.to(dtype).float() for name, x in leaves.items()}
    got = _run("flash", leaves, grad, dtype, **options)
    want = _run(against[0], leaves, grad, against[1], **options)
    errors = {name: relative_error(got[name], want[name]) for name in want}
    over = {name: f"{e:.2e}" for name, e in errors.items() if not e <= flash.CHECK_TOLERANCE}
    assert not over, f"{dtype} {options}: {over}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("seq_len", [1, 63, 64, 65, 1000])
def test_matches_reference(seq_len, options, dtype):
    leaves, grad = _leaves(2, seq_len)
    _compare(leaves, grad, dtype, **OPTIONS[options])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("seq_len", "block_size", "top_k"),
                         [(1000, 128, 3), (1000, 96, 8), (257, 64, 1), (64, 64, 1),
                          (1024, 128, 3), (576, 64, 4)])
def test_moba_matches_reference(seq_len, block_size, top_k, dtype):
    leaves, grad = _leaves(2, seq_len)
    _compare(leaves, grad, dtype, op=sparse.moba_attention, block_size=block_size, top_k=top_k)


def _cudnn_against_flash(monkeypatch, switch, seq_len, block_size, causal):
    """MoBA (top 3) in bf16 with cuDNN where ``flash.<switch>`` lets it run, then with that
    switch off (FlashAttention-2 there): cuDNN ran calls of the given causality in the first
    only, and the outputs and gradients agree to the check's tolerance."""
    calls, forward = [], flash._cudnn_forward
    monkeypatch.setattr(flash, "_cudnn_forward",
                        lambda *a, **kw: calls.append(kw.get("causal", True)) or forward(*a, **kw))
    leaves, grad = _leaves(2, seq_len)
    options = dict(op=sparse.moba_attention, block_size=block_size, top_k=3)
    with_cudnn = _run("flash", leaves, grad, torch.bfloat16, **options)
    assert causal in calls
    monkeypatch.setattr(flash, switch, lambda q, block_len: False)
    calls.clear()
    without = _run("flash", leaves, grad, torch.bfloat16, **options)
    assert causal not in calls
    errors = {name: relative_error(with_cudnn[name], without[name]) for name in without}
    assert max(errors.values()) <= flash.CHECK_TOLERANCE, errors


@pytest.mark.parametrize("block_size", [64, 128])
def test_own_blocks_on_cudnn_equal_flash_attention(monkeypatch, block_size):
    """With every block full, a block selection's own blocks run on cuDNN (causal calls)."""
    _cudnn_against_flash(monkeypatch, "_own_blocks_on_cudnn", 8 * block_size, block_size, True)


@pytest.mark.parametrize(("seq_len", "block_size", "chunk"),
                         [(1024, 128, None), (1000, 128, None), (2048, 256, 64), (1000, 128, 16)])
def test_earlier_blocks_on_cudnn_equal_flash_attention(monkeypatch, seq_len, block_size, chunk):
    """From blocks of flash.CUDNN_MIN_EARLIER_BLOCK, the earlier blocks run on cuDNN in chunks
    (not causal calls), also where the last block is partial (the own blocks then on
    FlashAttention-2), and in small chunks (most blocks' pairs then fill several)."""
    if chunk is not None:
        monkeypatch.setattr(flash, "CUDNN_CHUNK", chunk)
    _cudnn_against_flash(monkeypatch, "_earlier_blocks_on_cudnn", seq_len, block_size, False)


@pytest.mark.parametrize("options", list(OPTIONS))
def test_packed_sequences(options):
    leaves, grad = _leaves(1, PACKED[-1])
    _compare(leaves, grad, torch.bfloat16, cu_seqlens=torch.tensor(PACKED, device="cuda"),
             **OPTIONS[options])


def test_without_sink():
    leaves, grad = _leaves(2, 300, sink=False)
    _compare(leaves, grad, torch.bfloat16, causal=True, window=(100, 0))


def test_sink_of_minus_infinity_is_plain_softmax():
    leaves, _ = _leaves(2, 300)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    sink = torch.full((HQ,), float("-inf"), device="cuda")
    with_sink = sparse.softmax_attention(q, k, v, sink=sink, backend="flash")
    torch.testing.assert_close(with_sink, sparse.softmax_attention(q, k, v, backend="flash"),
                               rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_first_use_check_passes(dtype):
    device = torch.device("cuda", torch.cuda.current_device())
    flash.checked.cache_clear()
    assert flash.checked(device, dtype)
    flash.cudnn_checked.cache_clear()  # cuDNN's own check (on this GPU: it runs here)
    assert routing.cudnn_refusal(registry.Facts(device=device, dtype=dtype, key_dim=64)) is None
    assert flash.cudnn_checked(device, dtype)


def _spy(monkeypatch, name):
    """Calls of ``flash.<name>`` (still run) are counted in the list returned, from after the
    bf16 first-use checks (which call the kernels themselves)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert flash.checked(device, torch.bfloat16) and flash.cudnn_checked(device, torch.bfloat16)
    calls, run = [], getattr(flash, name)
    monkeypatch.setattr(flash, name, lambda *a, **kw: calls.append(kw) or run(*a, **kw))
    return calls


def test_auto_runs_flash_for_a_window_or_sink(monkeypatch):
    calls = _spy(monkeypatch, "flash_attention")
    leaves, _ = _leaves(2, 200)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    sparse.softmax_attention(q, k, v, window=(50, 0), sink=leaves["sink"], backend="auto")
    assert len(calls) == 1
    allowed = torch.ones(1, 1, 200, 200, dtype=torch.bool, device="cuda").tril()
    sparse.softmax_attention(q, k, v, sink=leaves["sink"], allowed=allowed, backend="auto")
    assert len(calls) == 1  # an extra mask goes to FlexAttention


@pytest.mark.parametrize("seq_len", [1000, 1024])  # 1024: the own blocks of 64 on cuDNN
def test_nsa_matches_reference(seq_len):
    leaves, grad = _leaves(2, seq_len)
    g = torch.Generator(device="cuda").manual_seed(3)
    gates = torch.rand(2, seq_len, HQ, 3, device="cuda", generator=g)
    k_weights, v_weights = (torch.rand(HKV, 32, device="cuda", generator=g) for _ in range(2))

    def nsa(q, k, v, sink, backend):
        return sparse.nsa_attention(q, k, v, gates, k_weights, v_weights, compress_block=32,
                                    compress_stride=16, select_block=64, select_top_k=5,
                                    window=100, sink=sink, backend=backend)

    # Against the gathered path on the same bf16 inputs: NSA's choice of blocks depends on the
    # compressed keys, which the op keeps in the inputs' dtype (the reference in fp32).
    _compare(leaves, grad, torch.bfloat16, against=("gathered", torch.bfloat16), op=nsa)


def test_auto_runs_flash_for_moba_without_a_window(monkeypatch):
    calls = _spy(monkeypatch, "moba_attention")
    leaves, _ = _leaves(2, 256)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    sparse.moba_attention(q, k, v, block_size=64, top_k=2, backend="auto")
    assert len(calls) == 1
    sparse.moba_attention(q, k, v, block_size=64, top_k=2, window=(100, 0), backend="auto")
    assert len(calls) == 1  # a window goes to FlexAttention


def test_auto_runs_flash_for_nsa_from_its_minimum_length(monkeypatch):
    """NSA under "auto": its block layout below ``NSA_FLASH_MIN_LEN`` tokens, flash.py's
    selected and window calls from there on."""
    calls = _spy(monkeypatch, "block_selection_attention")
    monkeypatch.setattr(sparse.nsa, "NSA_FLASH_MIN_LEN", 300)
    for seq_len, expected in ((299, 0), (300, 1)):
        leaves, _ = _leaves(1, seq_len)
        q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
        gates = torch.full((1, seq_len, HQ, 3), 0.5, device="cuda")
        weights = torch.full((HKV, 32), 1 / 32, device="cuda")
        sparse.nsa_attention(q, k, v, gates, weights, weights, compress_block=32,
                             compress_stride=16, select_block=64, select_top_k=4, window=100,
                             backend="auto")
        assert len(calls) == expected, seq_len


def _causal_selection(batch, seq_len, top_k, seed=4):
    """``[B, T, K]`` int32 on the GPU: K keys at or before each query at random (all of them,
    then -1, where it has fewer), a key listed twice, and a query with none."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = torch.rand(batch, seq_len, seq_len, device="cuda", generator=g).tril().topk(top_k)
    position = torch.arange(seq_len, device="cuda")[:, None]
    selected = torch.where(keys.indices <= position, keys.indices, -1).int()
    selected[0, -1, 1] = selected[0, -1, 0]
    selected[:, seq_len // 2] = -1
    return selected


@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize(("seq_len", "top_k"), [(1000, 100), (1024, 300), (77, 8)])
def test_dsa_causal_selection_matches_reference(seq_len, top_k, sink):
    """dsa_attention(causal=True) on "flash" (cuDNN, the selection as a bias) in bf16 against
    the fp32 reference; the query with no key gives zeros; the log-sum-exp it returns
    (``return_lse``, fp32) against the reference's, and the indexer loss's target from the mass
    kernel given it against the reference's target."""
    leaves, grad = _leaves(2, seq_len, sink=sink)
    selected = _causal_selection(2, seq_len, top_k)

    def dsa(q, k, v, sink, backend):
        return sparse.dsa_attention(q, k, v, selected, sink=sink, causal=True, backend=backend)

    _compare(leaves, grad, torch.bfloat16, op=dsa)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    out, lse = sparse.dsa_attention(q, k, v, selected, sink=leaves.get("sink"), causal=True,
                                    backend="flash", return_lse=True)
    assert torch.equal(out[:, seq_len // 2], torch.zeros_like(out[:, seq_len // 2]))
    # the mass kernel takes rows without a key listed twice (the bias has that key once)
    once = selected.clone()
    once[0, -1, 1] = -1
    _check_lse_and_mass(lse, q, k, selected, leaves.get("sink"), mass_selected=once)


def _check_lse_and_mass(lse, q, keys, selected, sink, mass_selected=None):
    """The log-sum-exp an attention returned (``return_lse``) against the fp32 reference's,
    and the indexer loss's target from the mass kernel given it against the reference's target
    (over ``mass_selected``, by default ``selected``)."""
    want = triton.reference_lse(q.float(), keys.float(), selected, sink)
    assert lse.dtype == torch.float32 and lse.shape == want.shape
    assert torch.equal(lse.isposinf(), want.isposinf())
    error = (lse - want)[want.isfinite()].abs().max().item()
    print(f"lse: largest absolute difference {error:.2e}")
    assert error <= LSE_TOLERANCE
    mass_selected = selected if mass_selected is None else mass_selected
    mass = triton.selected_mass(q, keys, mass_selected, sink=sink, lse=lse)
    want = triton.reference_mass(q.float(), keys.float(), mass_selected, sink)
    assert relative_error(mass, want) <= 2e-2


def test_auto_runs_cudnn_for_causal_dsa_selections(monkeypatch):
    calls = _spy(monkeypatch, "causal_selection_attention")
    leaves, _ = _leaves(2, 200)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    selected = _causal_selection(2, 200, 16)
    sparse.dsa_attention(q, k, v, selected, sink=leaves["sink"], causal=True, backend="auto")
    assert len(calls) == 1
    sparse.dsa_attention(q, k, v, selected, sink=leaves["sink"], backend="auto")
    assert len(calls) == 1  # not declared causal: FlexAttention


def _compressed_selection(batch, seq_len, rate, top_k, seed=5):
    """``[B, T, K]`` on the GPU: up to K entries (blocks of ``rate``) complete at each query at
    random (-1 where fewer), and a query with none."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    complete = (torch.arange(rate - 1, seq_len, rate, device="cuda")
                <= torch.arange(seq_len, device="cuda")[:, None])
    scores = torch.rand(batch, seq_len, complete.shape[1], device="cuda", generator=g)
    picked = scores.masked_fill(~complete, -1.0).topk(min(top_k, complete.shape[1]))
    selected = torch.where(picked.values >= 0, picked.indices, -1).int()
    selected[:, seq_len // 2] = -1
    return selected


@pytest.mark.parametrize("sink", [True, False])
@pytest.mark.parametrize(("seq_len", "window", "top_k", "query_chunk"),
                         [(1000, 128, 64, None), (1000, 128, 64, 256), (77, 5, 8, 32)])
def test_csa_on_flash_and_cudnn_matches_reference(monkeypatch, seq_len, window, top_k,
                                                  query_chunk, sink):
    """csa_attention on "flash" (the window on FlashAttention-2, the selected entries on cuDNN
    in chunks of queries, merged by their log-sum-exps) in bf16 against the fp32 reference:
    entries of blocks of 4 (k and v at each block's last token, plus v at its first: the
    gradients reach k and v through both), one chunk or several; the log-sum-exp over the
    entries and the sink it returns against the reference's, and the indexer loss's target
    from the mass kernel given it against the reference's target."""
    rate = 4
    if query_chunk is not None:
        monkeypatch.setattr(flash, "CSA_QUERY_CHUNK", query_chunk)
    leaves, grad = _leaves(2, seq_len, sink=sink)
    selected = _compressed_selection(2, seq_len, rate, top_k)

    def entries(k, v):
        count = seq_len // rate
        return (k[:, rate - 1::rate][:, :count] + v[:, :count * rate:rate],
                v[:, rate - 1::rate][:, :count])

    def csa(q, k, v, sink, backend):
        return sparse.csa_attention(q, k, v, *entries(k, v), selected, window=window, sink=sink,
                                    backend=backend, rate=rate)

    _compare(leaves, grad, torch.bfloat16, op=csa)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    compressed_k, compressed_v = entries(k, v)
    _, lse = sparse.csa_attention(q, k, v, compressed_k, compressed_v, selected, window=window,
                                  sink=leaves.get("sink"), backend="flash", rate=rate,
                                  return_lse=True)
    _check_lse_and_mass(lse, q, compressed_k, selected, leaves.get("sink"))


def test_auto_runs_flash_and_cudnn_for_csa_with_a_rate(monkeypatch):
    calls = _spy(monkeypatch, "compressed_selection_attention")
    leaves, _ = _leaves(2, 200)
    q, k, v = (leaves[n].bfloat16() for n in ("q", "k", "v"))
    ck, cv = k[:, 3::4], v[:, 3::4]
    selected = _compressed_selection(2, 200, 4, 16)
    sparse.csa_attention(q, k, v, ck, cv, selected, window=16, sink=leaves["sink"], rate=4)
    assert len(calls) == 1
    sparse.csa_attention(q, k, v, ck, cv, selected, window=16, sink=leaves["sink"])
    assert len(calls) == 1  # without the rate: another backend
