"""DeepSeek-V4's CSA and HCA ops (megatron_ext.kernels.sparse): the compression, HCA's attention
over every complete entry plus a window (block layout: gathered, and FlexAttention forward),
CSA's indexer selection over entries, its attention over the selected entries plus a window,
and its indexer loss, against the dense fp32 references, forward and backward; the visibility
rule, causality, packed sequences, grouped heads, closed forms; the indexer loss split into
query shares (context parallelism's), as DSA's is (test_dsa.py).

The length (37) is a multiple of no block size (CSA rate 4: 9 entries; HCA rate 8: 4 entries,
5 trailing tokens in none); ``MAX_SCORES = 256`` and 4 x 4 layout blocks cut the work into many
chunks. fp32 throughout; paths agree to ~1e-6, 1e-4 / 1e-5 catches a wrong key.
"""
import pytest
import torch

import harness
from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import gathered, reference

B, T, HQ, HKV, D, HI, DI = 2, 37, 4, 2, 8, 3, 5
CSA_RATE, HCA_RATE, CSA_WINDOW, HCA_WINDOW, TOP_K = 4, 8, 6, 9, 3
CU_SEQLENS = torch.tensor([0, 11, 30, T])  # CSA: 2 + 4 + 1 entries; HCA: 1 + 2 + 0


def _entries(rate, cu_seqlens=None):
    return len(sparse.compressed_entries(T, rate, cu_seqlens))


def _inputs(rate, cu_seqlens=None, seed=0):
    """Per-token q, k, v, indexer q and weights, and per-entry compressed keys / values and
    indexer keys, for the sequences of ``cu_seqlens`` (one batch row) or B rows."""
    g = torch.Generator().manual_seed(seed)
    rows = B if cu_seqlens is None else 1
    n = _entries(rate, cu_seqlens)
    shapes = dict(q=(rows, T, HQ, D), k=(rows, T, HKV, D), v=(rows, T, HKV, D), sink=(HQ,),
                  compressed_k=(rows, n, HKV, D), compressed_v=(rows, n, HKV, D),
                  index_q=(rows, T, HI, DI), index_k=(rows, n, DI), index_weights=(rows, T, HI))
    return {name: torch.randn(shape, generator=g).requires_grad_()
            for name, shape in shapes.items()}


_grads, _assert_same = harness.projected_grads, harness.assert_same_output_and_grads


def _run_both(fn, inputs, backends=("reference", "gathered")):
    """``[out, grads]`` per backend."""
    results = []
    for backend in backends:
        out = fn(inputs, backend)
        results += [out.detach(), _grads(out, inputs)]
    return results


@pytest.fixture(params=["one chunk", "many chunks"])
def chunks(request, monkeypatch):
    if request.param == "many chunks":
        monkeypatch.setattr(gathered, "MAX_SCORES", 256)
    return request.param


# ------------------------------------------------------------------------------ compression
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("overlap,rate", [(True, CSA_RATE), (False, HCA_RATE)])
def test_compression_matches_reference(overlap, rate, packed):
    g = torch.Generator().manual_seed(1)
    rows, channels = (1 if packed else B), (2 if overlap else 1) * D
    inputs = {"kv": torch.randn(rows, T, HKV, channels, generator=g).requires_grad_(),
              "gate": torch.randn(rows, T, HKV, channels, generator=g).requires_grad_(),
              "bias": torch.randn(HKV, rate, channels, generator=g).requires_grad_()}
    cu_seqlens = CU_SEQLENS if packed else None

    def run(x, backend):
        return sparse.compress_kv(x["kv"], x["gate"], x["bias"], rate=rate, overlap=overlap,
                                  cu_seqlens=cu_seqlens, backend=backend)

    results = _run_both(run, inputs, ("reference", "auto"))
    assert results[0].shape == (rows, _entries(rate, cu_seqlens), HKV, D)
    assert set(results[1]) == {"kv", "gate", "bias"}
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("overlap", [False, True])
def test_uniform_weights_give_block_means(overlap, backend):
    """With zero logits and biases every slot weighs alike: an HCA entry is the mean of its
    block; a CSA entry the mean of its block's a-series and the previous block's b-series (the
    first entry has no previous block: its own block's mean)."""
    rate, channels = 4, (2 if overlap else 1) * D
    kv = torch.randn(1, 13, HKV, channels, generator=torch.Generator().manual_seed(2))
    zeros = torch.zeros_like(kv)
    out = sparse.compress_kv(kv, zeros, torch.zeros(HKV, rate, channels), rate=rate,
                             overlap=overlap, backend=backend)
    blocks = kv[:, :12].unflatten(1, (3, rate))  # [1, 3, rate, H, C]
    own = blocks[..., -D:].mean(2)
    if overlap:
        lent = blocks[..., :D]
        expected = torch.cat([own[:, :1], (blocks[:, 1:, ..., -D:].sum(2) + lent[:, :-1].sum(2))
                              / (2 * rate)], dim=1)
    else:
        expected = own
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------- visibility, causality
def test_visibility_rule_by_hand():
    """Query t (position p in its sequence) sees entry i of its sequence iff
    (i + 1) * rate - 1 <= p: the last token of a block already sees that block's entry."""
    seen = reference.compressed_visibility(10, 4)
    assert seen.shape == (10, 2)
    assert seen[:, 0].tolist() == [False] * 3 + [True] * 7
    assert seen[:, 1].tolist() == [False] * 7 + [True] * 3
    packed = reference.compressed_visibility(11, 4, torch.tensor([0, 5, 11]))
    # Sequence 0: tokens 0-4, entry 0 (tokens 0-3); sequence 1: tokens 5-10, entry 1 (5-8).
    assert packed[:, 0].tolist() == [False] * 3 + [True] * 2 + [False] * 6
    assert packed[:, 1].tolist() == [False] * 8 + [True] * 3
    entries = sparse.compressed_entries(11, 4, torch.tensor([0, 5, 11]))
    t, i = torch.arange(11)[:, None], torch.arange(2)
    assert torch.equal(entries.sees(0, 0, t, i), packed)
    assert entries.positions.tolist() == [0, 0] and entries.has_previous.tolist() == [False] * 2


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("kind", ["hca", "csa"])
@pytest.mark.parametrize("packed", [False, True])
def test_an_entry_reaches_exactly_the_queries_that_see_it(kind, packed, backend):
    """Changing entry i's value changes the output of exactly the queries that see it (for
    CSA: with every entry selected), through the attention op itself."""
    rate = HCA_RATE if kind == "hca" else CSA_RATE
    cu_seqlens = CU_SEQLENS if packed else None
    x = {name: t.detach() for name, t in _inputs(rate, cu_seqlens).items()}
    n = x["compressed_k"].shape[1]
    if kind == "csa":
        selected = sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"], rate=rate,
                                     top_k=n, cu_seqlens=cu_seqlens)

    def run(values):
        options = dict(sink=x["sink"], cu_seqlens=cu_seqlens, backend=backend)
        if kind == "hca":
            return sparse.compressed_attention(x["q"], x["k"], x["v"], x["compressed_k"], values,
                                               rate=rate, window=HCA_WINDOW, **options)
        return sparse.csa_attention(x["q"], x["k"], x["v"], x["compressed_k"], values, selected,
                                    window=CSA_WINDOW, **options)

    before = run(x["compressed_v"])
    seen = reference.compressed_visibility(T, rate, cu_seqlens)
    for i in range(n):
        values = x["compressed_v"].clone()
        values[:, i] += 1.0
        changed = (run(values) - before).abs().amax(dim=(0, 2, 3)) > 0
        assert torch.equal(changed, seen[:, i]), i


def _pipeline(x, kind, cu_seqlens, backend):
    """Per-token inputs -> compressed entries (and CSA's indexer keys) -> attention."""
    rate = HCA_RATE if kind == "hca" else CSA_RATE
    overlap = kind == "csa"
    compress = dict(rate=rate, overlap=overlap, cu_seqlens=cu_seqlens, backend=backend)
    entries = sparse.compress_kv(x["kv"], x["gate"], x["bias"], **compress)
    options = dict(sink=x["sink"], cu_seqlens=cu_seqlens, backend=backend)
    if kind == "hca":
        return sparse.compressed_attention(x["q"], x["k"], x["v"], entries, entries, rate=rate,
                                           window=HCA_WINDOW, **options)
    index_k = sparse.compress_kv(x["index_kv"], x["index_gate"], x["index_bias"], **compress)
    selected = sparse.csa_select(x["index_q"], index_k[:, :, 0], x["index_weights"], rate=rate,
                                 top_k=TOP_K, cu_seqlens=cu_seqlens, backend=backend)
    return sparse.csa_attention(x["q"], x["k"], x["v"], entries, entries, selected,
                                window=CSA_WINDOW, **options)


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("kind", ["hca", "csa"])
@pytest.mark.parametrize("packed", [False, True])
def test_future_tokens_do_not_change_earlier_outputs(kind, packed, backend):
    """Perturb every per-token input from token 21 on (queries, keys, values, the compressor's
    values and logits, the indexer's): outputs before 21 stay, later ones move."""
    first_changed = 21
    cu_seqlens = CU_SEQLENS if packed else None
    rows, channels = (1 if packed else B), (2 if kind == "csa" else 1) * D
    rate = HCA_RATE if kind == "hca" else CSA_RATE
    g = torch.Generator().manual_seed(3)
    x = {name: t.detach() for name, t in _inputs(rate, cu_seqlens).items()}
    x.update(kv=torch.randn(rows, T, HKV, channels, generator=g),
             gate=torch.randn(rows, T, HKV, channels, generator=g),
             bias=torch.randn(HKV, rate, channels, generator=g),
             index_kv=torch.randn(rows, T, 1, 2 * DI, generator=g),
             index_gate=torch.randn(rows, T, 1, 2 * DI, generator=g),
             index_bias=torch.randn(1, rate, 2 * DI, generator=g))
    before = _pipeline(x, kind, cu_seqlens, backend)
    for name in ("q", "k", "v", "kv", "gate", "index_q", "index_weights", "index_kv",
                 "index_gate"):
        x[name] = x[name].clone()
        x[name][:, first_changed:] += 3 * torch.randn_like(x[name][:, first_changed:])
    after = _pipeline(x, kind, cu_seqlens, backend)
    torch.testing.assert_close(after[:, :first_changed], before[:, :first_changed], rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(after[:, first_changed:], before[:, first_changed:])


# ------------------------------------------------------------------- efficient == reference
# name -> (cu_seqlens, with sink, window or None for the default)
ATTENTION_CASES = {
    "plain": (None, False, None),
    "sink": (None, True, None),
    "packed+sink": (CU_SEQLENS, True, None),
    "window beyond T": (None, True, 50),
}


@pytest.mark.parametrize("layout_blocks", [None, (4, 4)])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_hca_attention_matches_reference(case, layout_blocks, chunks):
    cu_seqlens, with_sink, window = ATTENTION_CASES[case]
    inputs = _inputs(HCA_RATE, cu_seqlens)

    def run(x, backend):
        return sparse.compressed_attention(
            x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"], rate=HCA_RATE,
            window=window or HCA_WINDOW, sink=x["sink"] if with_sink else None,
            cu_seqlens=cu_seqlens, backend=backend, layout_blocks=layout_blocks)

    results = _run_both(run, inputs)
    expected_grads = {"q", "k", "v", "compressed_k", "compressed_v"} | (
        {"sink"} if with_sink else set())
    assert set(results[1]) == expected_grads
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("case", ["sink", "packed+sink"])
def test_hca_flex_forward_matches_reference(case):
    """FlexAttention runs forward only on the CPU; on CUDA "auto" picks it."""
    cu_seqlens, _, _ = ATTENTION_CASES[case]
    x = {name: t.detach() for name, t in _inputs(HCA_RATE, cu_seqlens).items()}
    out = {backend: sparse.compressed_attention(
        x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"], rate=HCA_RATE,
        window=HCA_WINDOW, sink=x["sink"], cu_seqlens=cu_seqlens, backend=backend,
        layout_blocks=(16, 16)) for backend in ("reference", "flex")}
    torch.testing.assert_close(out["flex"], out["reference"], rtol=1e-4, atol=1e-5)


def test_unpacked_layout_and_its_block_mask_are_made_once():
    """Without packed sequences HCA's layout depends on the shape alone: a second call reuses
    it, and the BlockMask FlexAttention made from it (no host work per call). Made first under
    inference mode, they still serve a training step."""
    sparse.compressed.tiled_compressed_layout.cache_clear()
    x = _inputs(HCA_RATE)
    with torch.inference_mode():
        sparse.compressed_attention(x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"],
                                    rate=HCA_RATE, window=HCA_WINDOW, backend="flex",
                                    layout_blocks=(16, 16))
    for backend in ("flex", "gathered"):  # gathered: a backward through the kept layout
        with torch.set_grad_enabled(backend == "gathered"):
            out = sparse.compressed_attention(
                x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"], rate=HCA_RATE,
                window=HCA_WINDOW, backend=backend, layout_blocks=(16, 16))
    out.sum().backward()
    assert x["q"].grad is not None
    assert sparse.compressed.tiled_compressed_layout.cache_info().hits == 2
    layout, _ = sparse.compressed.tiled_compressed_layout(T, HCA_RATE, HCA_WINDOW, 16, 16,
                                                          x["q"].device)
    padded = -(-T // 16) * 16  # the raw keys, padded to whole key blocks, then the entries
    assert list(layout.block_masks) == [(HQ, T, padded + _entries(HCA_RATE))]


@pytest.mark.parametrize("top_k", [TOP_K, 50])
@pytest.mark.parametrize("packed", [False, True])
def test_csa_selection_matches_reference(packed, top_k, chunks):
    cu_seqlens = CU_SEQLENS if packed else None
    x = {name: t.detach() for name, t in _inputs(CSA_RATE, cu_seqlens).items()}
    selected = {backend: sparse.csa_select(
        x["index_q"], x["index_k"], x["index_weights"], rate=CSA_RATE, top_k=top_k,
        cu_seqlens=cu_seqlens, backend=backend) for backend in ("reference", "gathered")}
    n = x["index_k"].shape[1]
    assert selected["reference"].shape[-1] == min(top_k, n)  # top_k beyond N is clamped
    torch.testing.assert_close(selected["gathered"].sort(-1).values,  # in any order
                               selected["reference"].sort(-1).values)
    # Only visible entries, min(top_k, visible) distinct ones per query.
    chosen = reference.selected_mask(selected["gathered"], n)
    seen = reference.compressed_visibility(T, CSA_RATE, cu_seqlens)
    assert not (chosen & ~seen).any()
    torch.testing.assert_close(chosen.sum(-1), seen.sum(-1).clamp(max=top_k).expand_as(
        chosen[..., 0]))


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_csa_attention_matches_reference(case, chunks):
    cu_seqlens, with_sink, window = ATTENTION_CASES[case]
    inputs = _inputs(CSA_RATE, cu_seqlens)
    selected = sparse.csa_select(inputs["index_q"], inputs["index_k"], inputs["index_weights"],
                                 rate=CSA_RATE, top_k=TOP_K, cu_seqlens=cu_seqlens)

    def run(x, backend):
        return sparse.csa_attention(
            x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"], selected,
            window=window or CSA_WINDOW, sink=x["sink"] if with_sink else None,
            cu_seqlens=cu_seqlens, backend=backend)

    results = _run_both(run, inputs)
    expected_grads = {"q", "k", "v", "compressed_k", "compressed_v"} | (
        {"sink"} if with_sink else set())
    assert set(results[1]) == expected_grads
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("packed", [False, True])
def test_csa_indexer_loss_matches_reference(packed, stage, chunks):
    """The gradient reaches the indexer's q, keys and weights only: q, the entries' keys and
    the sink are its detached target. Queries before the first complete block have no entry
    and add nothing (no NaN either)."""
    cu_seqlens = CU_SEQLENS if packed else None
    inputs = _inputs(CSA_RATE, cu_seqlens)
    selected = None
    if stage == "sparse":
        selected = sparse.csa_select(inputs["index_q"], inputs["index_k"],
                                     inputs["index_weights"], rate=CSA_RATE, top_k=TOP_K,
                                     cu_seqlens=cu_seqlens)

    def run(x, backend):
        return sparse.csa_indexer_loss(
            x["q"], x["compressed_k"], x["index_q"], x["index_k"], x["index_weights"],
            rate=CSA_RATE, selected=selected, cu_seqlens=cu_seqlens, sink=x["sink"],
            backend=backend)

    results = _run_both(run, inputs)
    assert results[0] > 0
    assert set(results[1]) == {"index_q", "index_k", "index_weights"}
    assert all(torch.isfinite(g).all() for g in results[3].values())
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("packed", [False, True])
def test_csa_indexer_loss_shares_sum_to_the_loss(packed, stage, backend, chunks):
    """Context parallelism's split of the loss (test_dsa.assert_shares_sum_to_the_loss): two
    processes with half of the heads each (of q, the entries' keys and the sink), each the
    loss of half of the queries; the first 36 tokens, whose entries are those of T's."""
    from test_dsa import assert_shares_sum_to_the_loss

    seq_len = 36
    cu_seqlens = torch.tensor([0, 11, 30, seq_len]) if packed else None
    inputs = _inputs(CSA_RATE, CU_SEQLENS if packed else None)
    assert _entries(CSA_RATE, CU_SEQLENS if packed else None) == len(
        sparse.compressed_entries(seq_len, CSA_RATE, cu_seqlens))
    x = {name: (t[:, :seq_len] if name in ("q", "index_q", "index_weights") else t)
         .detach().requires_grad_() for name, t in inputs.items()}
    selected = None
    if stage == "sparse":
        selected = sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"],
                                     rate=CSA_RATE, top_k=TOP_K, cu_seqlens=cu_seqlens)

    def loss_of(t, shares):
        return sparse.csa_indexer_loss(t["q"], t["compressed_k"], t["index_q"], t["index_k"],
                                       t["index_weights"], rate=CSA_RATE, selected=selected,
                                       cu_seqlens=cu_seqlens, sink=t["sink"], shares=shares,
                                       backend=backend)

    assert_shares_sum_to_the_loss(loss_of, x, ("q", "compressed_k", "sink"), seq_len)


# ------------------------------------------------------------------------------ closed forms
@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("window", [5, T])
@pytest.mark.parametrize("packed", [False, True])
def test_no_complete_block_is_windowed_attention_with_sink(packed, window, backend):
    """With a rate longer than every sequence there is no entry: HCA and CSA are softmax
    attention over the last ``window`` tokens with the sink (a window >= T: causal attention),
    and CSA's indexer loss is 0."""
    cu_seqlens = CU_SEQLENS if packed else None
    rate = 64
    x = {name: t.detach() for name, t in _inputs(rate, cu_seqlens).items()}
    assert x["compressed_k"].shape[1] == 0
    options = dict(sink=x["sink"], cu_seqlens=cu_seqlens, backend=backend)
    expected = sparse.softmax_attention(x["q"], x["k"], x["v"], window=(window - 1, 0),
                                        sink=x["sink"], cu_seqlens=cu_seqlens, backend="reference")
    hca = sparse.compressed_attention(x["q"], x["k"], x["v"], x["compressed_k"],
                                      x["compressed_v"], rate=rate, window=window, **options)
    selected = sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"], rate=rate,
                                 top_k=TOP_K, cu_seqlens=cu_seqlens, backend=backend)
    assert selected.shape[-1] == 0
    csa = sparse.csa_attention(x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"],
                               selected, window=window, **options)
    torch.testing.assert_close(hca, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(csa, expected, rtol=1e-4, atol=1e-5)
    loss = sparse.csa_indexer_loss(x["q"], x["compressed_k"], x["index_q"], x["index_k"],
                                   x["index_weights"], rate=rate, **options)
    assert loss.item() == 0


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("packed", [False, True])
def test_top_k_covering_every_entry_is_hca_attention(packed, backend):
    """CSA selecting every entry a query sees is HCA's attention over CSA's entries (its dense
    warm-up), and its sparse indexer loss is the dense one."""
    cu_seqlens = CU_SEQLENS if packed else None
    x = {name: t.detach() for name, t in _inputs(CSA_RATE, cu_seqlens).items()}
    n = x["compressed_k"].shape[1]
    selected = sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"], rate=CSA_RATE,
                                 top_k=n, cu_seqlens=cu_seqlens, backend=backend)
    options = dict(sink=x["sink"], cu_seqlens=cu_seqlens, backend=backend)
    csa = sparse.csa_attention(x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"],
                               selected, window=CSA_WINDOW, **options)
    dense = sparse.compressed_attention(x["q"], x["k"], x["v"], x["compressed_k"],
                                        x["compressed_v"], rate=CSA_RATE, window=CSA_WINDOW,
                                        **options)
    torch.testing.assert_close(csa, dense, rtol=1e-4, atol=1e-5)
    losses = [sparse.csa_indexer_loss(x["q"], x["compressed_k"], x["index_q"], x["index_k"],
                                      x["index_weights"], rate=CSA_RATE, selected=chosen,
                                      **options) for chosen in (selected, None)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_bf16_is_close_to_fp32_reference():
    x = {name: t.detach().bfloat16() for name, t in _inputs(HCA_RATE).items()}
    args = [x[n] for n in ("q", "k", "v", "compressed_k", "compressed_v")]
    out = sparse.compressed_attention(*args, rate=HCA_RATE, window=HCA_WINDOW, sink=x["sink"])
    expected = sparse.compressed_attention(*(a.float() for a in args), rate=HCA_RATE,
                                           window=HCA_WINDOW, sink=x["sink"].float(),
                                           backend="reference")
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() < 2e-2


def test_bad_arguments_fail_clearly():
    x = {name: t.detach() for name, t in _inputs(CSA_RATE).items()}
    qkv = (x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match=r"position_bias has shape \(2, 3, 16\), expected "
                                         r"\[H, rate, C\] = \[2, 4, 16\]"):
        sparse.compress_kv(torch.zeros(1, T, HKV, 16), torch.zeros(1, T, HKV, 16),
                           torch.zeros(HKV, 3, 16), rate=4, overlap=True)
    with pytest.raises(ValueError, match="C even when overlap=True"):
        sparse.compress_kv(torch.zeros(1, T, HKV, 7), torch.zeros(1, T, HKV, 7),
                           torch.zeros(HKV, 4, 7), rate=4, overlap=True)
    with pytest.raises(ValueError, match=r"compressed_k has shape \(2, 9, 2, 8\).*N = 4 \(one "
                                         r"per complete block of rate=8 tokens\)"):
        sparse.compressed_attention(*qkv, x["compressed_k"], x["compressed_v"], rate=8,
                                    window=HCA_WINDOW)
    with pytest.raises(ValueError, match=r"index_k \[B, N, DI\].*T = 37, N = 4"):
        sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"], rate=8, top_k=2)
    with pytest.raises(ValueError, match="CSA's top_k=0 must be >= 1"):
        sparse.csa_select(x["index_q"], x["index_k"], x["index_weights"], rate=4, top_k=0)
    with pytest.raises(ValueError, match="window=0 must be a positive integer"):
        sparse.compressed_attention(*qkv, x["compressed_k"], x["compressed_v"], rate=4,
                                    window=0)
    with pytest.raises(ValueError, match="packed sequences .* take B == 1; got B = 2"):
        sparse.compressed_attention(*qkv, x["compressed_k"], x["compressed_v"], rate=4,
                                    window=4, cu_seqlens=CU_SEQLENS)
    with pytest.raises(ValueError, match=r"selected has shape \(2, 36, 3\)"):
        sparse.csa_attention(*qkv, x["compressed_k"], x["compressed_v"],
                             torch.zeros(2, 36, 3, dtype=torch.long), window=4)
