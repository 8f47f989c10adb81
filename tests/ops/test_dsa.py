"""DSA ops (megatron_ext.kernels.sparse): the lightning indexer's top-k selection, the attention
over the selected keys and the indexer's KL loss, gathered by chunks of queries against the
dense fp32 reference, forward and backward; causality, packed sequences, grouped heads, a
top-k that covers every key, a hand-computed loss, ties; the indexer loss split into query
shares (context parallelism's), by processes that each hold some of the heads (threads here).

The length (37) is a multiple of no chunk size: the default chunks hold the whole sequence,
``MAX_SCORES = 256`` cuts it into chunks of one to a few queries. fp32 throughout; both paths
sum the same products in a different order and agree to ~1e-6 (1e-4 relative / 1e-5 absolute
still catches a wrong key, an error of order 1e-1).
"""
import math
import threading

import pytest
import torch

import harness
from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import gathered, reference

B, T, HQ, HKV, D, HI, DI = 2, 37, 4, 2, 8, 3, 5
TOP_K = 6
CU_SEQLENS = torch.tensor([0, 11, 30, T])


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = dict(q=(B, T, HQ, D), k=(B, T, HKV, D), v=(B, T, HKV, D), sink=(HQ,),
                  index_q=(B, T, HI, DI), index_k=(B, T, DI), index_weights=(B, T, HI))
    return {name: torch.randn(shape, generator=g).requires_grad_()
            for name, shape in shapes.items()}


# name -> (batch rows used, extra arguments of the ops)
CASES = {
    "top-k": (B, dict(top_k=TOP_K)),
    "top-k+sink": (B, dict(top_k=TOP_K, sink=True)),
    "packed+sink": (1, dict(top_k=TOP_K, sink=True, cu_seqlens=CU_SEQLENS)),
    "top-k beyond T": (B, dict(top_k=50)),
}


def _case(name, inputs):
    rows, options = CASES[name]
    x = {n: t if n == "sink" else t[:rows] for n, t in inputs.items()}
    sink = x["sink"] if options.get("sink") else None
    return x, options["top_k"], sink, options.get("cu_seqlens")


def _select(x, top_k, cu_seqlens, backend):
    return sparse.dsa_select(x["index_q"], x["index_k"], x["index_weights"], top_k=top_k,
                             cu_seqlens=cu_seqlens, backend=backend)


_grads, _assert_same = harness.projected_grads, harness.assert_same_output_and_grads


@pytest.fixture(params=["one chunk", "many chunks"])
def chunks(request, monkeypatch):
    if request.param == "many chunks":
        monkeypatch.setattr(gathered, "MAX_SCORES", 256)


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_selection_matches_reference(case, chunks):
    x, top_k, _, cu_seqlens = _case(case, _inputs())
    expected = _select(x, top_k, cu_seqlens, "reference")
    assert expected.shape[-1] == min(top_k, T)
    got = _select(x, top_k, cu_seqlens, "gathered")  # the same keys, in any order
    torch.testing.assert_close(got.sort(-1).values, expected.sort(-1).values)


@pytest.mark.parametrize("case", list(CASES))
def test_gathered_attention_matches_reference(case, chunks):
    inputs = _inputs()
    x, top_k, sink, cu_seqlens = _case(case, inputs)
    selected = _select(x, top_k, cu_seqlens, "reference")
    results = []
    for backend in ("reference", "gathered"):
        out = sparse.dsa_attention(x["q"], x["k"], x["v"], selected, sink=sink, backend=backend)
        results += [out.detach(), _grads(out, inputs)]
    assert set(results[1]) == {"q", "k", "v"} | ({"sink"} if sink is not None else set())
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("case", list(CASES))
def test_gathered_indexer_loss_matches_reference(case, stage, chunks):
    """The loss's gradient reaches the indexer's q, k and weights only: the main attention's
    q, k and sink are its (detached) target."""
    inputs = _inputs()
    x, top_k, sink, cu_seqlens = _case(case, inputs)
    selected = _select(x, top_k, cu_seqlens, "reference") if stage == "sparse" else None
    results = []
    for backend in ("reference", "gathered"):
        loss = sparse.dsa_indexer_loss(
            x["q"], x["k"], x["index_q"], x["index_k"], x["index_weights"], selected=selected,
            cu_seqlens=cu_seqlens, sink=sink, backend=backend)
        results += [loss.detach(), _grads(loss, inputs)]
    assert results[0] > 0
    assert set(results[1]) == {"index_q", "index_k", "index_weights"}
    _assert_same(results[2], results[3], results[0], results[1])


@pytest.mark.parametrize("case", ["top-k", "packed+sink"])
def test_selection_is_causal_within_each_sequence(case):
    x, top_k, _, cu_seqlens = _case(case, _inputs())
    selected = _select(x, top_k, cu_seqlens, "gathered")
    allowed = reference.causal_mask(T, cu_seqlens)
    chosen = reference.selected_mask(selected, T)
    assert not (chosen & ~allowed).any()
    # Every query keeps min(top_k, its causal keys) distinct keys.
    torch.testing.assert_close(chosen.sum(-1), allowed.sum(-1).clamp(max=top_k).expand_as(
        chosen[..., 0]))


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("case", list(CASES))
def test_future_tokens_do_not_change_earlier_outputs(case, backend):
    first_changed = 21
    inputs = {name: t.detach() for name, t in _inputs().items()}

    def run(tensors):
        x, top_k, sink, cu_seqlens = _case(case, tensors)
        selected = _select(x, top_k, cu_seqlens, backend)
        return sparse.dsa_attention(x["q"], x["k"], x["v"], selected, sink=sink, backend=backend)

    before = run(inputs)
    for name in ("q", "k", "v", "index_q", "index_k", "index_weights"):
        inputs[name] = inputs[name].clone()
        inputs[name][:, first_changed:] += 3 * torch.randn_like(inputs[name][:, first_changed:])
    after = run(inputs)
    torch.testing.assert_close(after[:, :first_changed], before[:, :first_changed], rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(after[:, first_changed:], before[:, first_changed:])


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("case", ["top-k+sink", "packed+sink"])
def test_top_k_covering_every_key_is_causal_attention(case, backend):
    """With top_k >= T each query keeps all its causal keys: dense causal softmax attention
    (and the sparse loss is the dense one)."""
    inputs = {name: t.detach() for name, t in _inputs().items()}
    x, _, sink, cu_seqlens = _case(case, inputs)
    selected = _select(x, T, cu_seqlens, backend)
    out = sparse.dsa_attention(x["q"], x["k"], x["v"], selected, sink=sink, backend=backend)
    dense = sparse.softmax_attention(x["q"], x["k"], x["v"], sink=sink, cu_seqlens=cu_seqlens,
                                     backend="reference")
    torch.testing.assert_close(out, dense, rtol=1e-4, atol=1e-5)
    losses = [sparse.dsa_indexer_loss(x["q"], x["k"], x["index_q"], x["index_k"],
                                      x["index_weights"], selected=chosen, sink=sink,
                                      cu_seqlens=cu_seqlens, backend=backend)
              for chosen in (selected, None)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def run_processes(processes: int, work):
    """``work(rank, reduce_scatter)`` in ``processes`` threads that stand for processes, whose
    ``reduce_scatter(x [R, ...])`` returns the sum over the processes of their ``x[rank]``
    (``sparse.QueryShares``' contract); what each returned."""
    barrier = threading.Barrier(processes)
    sent, results, errors = [None] * processes, [None] * processes, []

    def reduce_scatter(rank):
        def call(x):
            sent[rank] = x
            barrier.wait()
            out = sum(sent[r][rank] for r in range(processes))
            barrier.wait()
            return out
        return call

    def run(rank):
        try:
            results[rank] = work(rank, reduce_scatter(rank))
        except BaseException as error:  # noqa: BLE001  (re-raised below)
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def assert_shares_sum_to_the_loss(loss_of, inputs, head_inputs, seq_len, seed=3):
    """Two processes, each with half of the heads (of ``head_inputs``: the sink and q, k or the
    entries' keys, split by key/value group) and every token, each the loss of half of the
    queries, in no order (``sparse.QueryShares``): their losses and indexer gradients sum to
    ``loss_of(inputs, None)``, the one-process loss of every head. ``loss_of(tensors,
    shares)`` takes the process's tensors (index_q and index_weights: its queries' rows)."""
    processes = 2
    indexer = [inputs[name] for name in ("index_q", "index_k", "index_weights")]
    expected = loss_of(inputs, None)
    expected_grads = torch.autograd.grad(expected, indexer)
    positions = torch.randperm(seq_len, generator=torch.Generator().manual_seed(seed))
    positions = positions.view(processes, -1)

    def work(rank, reduce_scatter):
        mine = positions[rank]
        tensors = dict(inputs, index_q=inputs["index_q"][:, mine],
                       index_weights=inputs["index_weights"][:, mine])
        for name in head_inputs:  # the head dim: 0 of the sink, 2 of the others
            dim = 0 if inputs[name].dim() == 1 else 2
            tensors[name] = inputs[name].chunk(processes, dim)[rank]
        loss = loss_of(tensors, sparse.QueryShares(positions, rank, reduce_scatter))
        return loss.detach(), torch.autograd.grad(loss, indexer)

    results = run_processes(processes, work)
    torch.testing.assert_close(sum(loss for loss, _ in results), expected.detach(), rtol=1e-5,
                               atol=1e-6)
    for i, name in enumerate(("index_q", "index_k", "index_weights")):
        torch.testing.assert_close(sum(grads[i] for _, grads in results), expected_grads[i],
                                   rtol=1e-4, atol=1e-5, msg=f"grad of {name}")


@pytest.mark.parametrize("backend", ["reference", "gathered"])
@pytest.mark.parametrize("stage", ["dense_warmup", "sparse"])
@pytest.mark.parametrize("packed", [False, True])
def test_indexer_loss_shares_sum_to_the_loss(packed, stage, backend, chunks):
    """Context parallelism's split of the loss: :func:`assert_shares_sum_to_the_loss`, with a
    sink, over the first 36 tokens (two shares of 18)."""
    seq_len = 36
    rows = 1 if packed else B
    cu_seqlens = torch.tensor([0, 11, 30, seq_len]) if packed else None
    x = {name: (t if name == "sink" else t[:rows, :seq_len]).detach().requires_grad_()
         for name, t in _inputs().items()}
    selected = _select(x, TOP_K, cu_seqlens, "reference") if stage == "sparse" else None

    def loss_of(t, shares):
        return sparse.dsa_indexer_loss(t["q"], t["k"], t["index_q"], t["index_k"],
                                       t["index_weights"], selected=selected,
                                       cu_seqlens=cu_seqlens, sink=t["sink"], shares=shares,
                                       backend=backend)

    assert_shares_sum_to_the_loss(loss_of, x, ("q", "k", "sink"), seq_len)


def test_indexer_loss_by_hand():
    """Two tokens, one head each: query 0 sees only itself (KL 0); query 1 has main
    probabilities p = softmax(q1 k_s / sqrt(2)) and indexer scores I_s = w relu(iq . ik_s)."""
    q = torch.tensor([[0.5, -1.0], [1.0, 2.0]]).view(1, 2, 1, 2)
    k = torch.tensor([[1.0, 0.5], [-0.5, 1.0]]).view(1, 2, 1, 2)
    index_q = torch.tensor([[0.3], [2.0]]).view(1, 2, 1, 1)
    index_k = torch.tensor([[1.5], [-1.0]]).view(1, 2, 1)
    index_weights = torch.tensor([[1.0], [0.7]]).view(1, 2, 1)
    z = [(1.0 * 1.0 + 2.0 * 0.5) / math.sqrt(2), (1.0 * -0.5 + 2.0 * 1.0) / math.sqrt(2)]
    p = [math.exp(zi) / sum(math.exp(zj) for zj in z) for zi in z]
    scores = [0.7 * max(2.0 * 1.5, 0.0), 0.7 * max(2.0 * -1.0, 0.0)]
    log_q = [si - math.log(sum(math.exp(sj) for sj in scores)) for si in scores]
    expected = sum(pi * (math.log(pi) - lqi) for pi, lqi in zip(p, log_q)) / 2
    for backend in ("reference", "gathered"):
        loss = sparse.dsa_indexer_loss(q, k, index_q, index_k, index_weights, backend=backend)
        assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("backend", ["reference", "gathered"])
def test_ties_go_to_the_earlier_key(backend):
    """An indexer that scores every key alike (here: all ReLUs dead) keeps the first keys."""
    x = {name: t.detach() for name, t in _inputs().items()}
    index_q = -x["index_q"].abs()
    index_k = x["index_k"].abs()
    selected = sparse.dsa_select(index_q, index_k, x["index_weights"], top_k=3, backend=backend)
    first = torch.arange(3).expand(T, 3)
    expected = torch.where(first <= torch.arange(T)[:, None], first, -1)
    torch.testing.assert_close(selected.sort(-1).values,
                               expected.int().sort(-1).values.expand(B, T, 3))


def test_top_k_keys_equals_a_stable_sort(monkeypatch):
    """``top_k_keys`` against the set its contract names, the first K of a stable descending
    sort: many ties, -0.0 beside +0.0, negative scores, -inf (not choosable), K beyond S; and
    rows without ties (random scores). The rows where a tie crosses the threshold, and those
    alone, take the exact int64 order (best first)."""
    redone = []
    ordered = reference._ordered_top_k
    monkeypatch.setattr(reference, "_ordered_top_k",
                        lambda scores, count: redone.append(scores) or ordered(scores, count))
    g = torch.Generator().manual_seed(3)
    for key_len, top_k in ((1, 1), (5, 9), (64, 7), (257, 64), (300, 300)):
        ties = torch.randint(-4, 4, (2, 9, key_len), generator=g).float() / 2
        for scores in (ties, torch.randn(2, 9, key_len, generator=g)):
            scores[torch.rand(scores.shape, generator=g) < 0.25] = float("-inf")
            scores[0, 0] = -0.0
            scores[0, 1, ::2] = 0.0
            scores[0, 1, 1::2] = -0.0
            order = scores.sort(dim=-1, descending=True, stable=True)
            count = min(top_k, key_len)
            expected = order.indices[..., :count].int().masked_fill(
                order.values[..., :count] == float("-inf"), -1)
            threshold = order.values[..., count - 1:count]
            tied = (threshold > float("-inf")) & ((scores >= threshold).sum(-1, keepdim=True)
                                                 > count)
            redone.clear()
            got = reference.top_k_keys(scores, top_k)
            torch.testing.assert_close(got.sort(-1).values, expected.sort(-1).values, rtol=0,
                                       atol=0)
            assert sum(len(rows) for rows in redone) == int(tied.sum())
            torch.testing.assert_close(got[tied.squeeze(-1)], expected[tied.squeeze(-1)],
                                       rtol=0, atol=0)


def _near_selection(seq_len, key_len, generator):
    """``[2, T, 6]``: keys up to 11 before query + 8 (so that far blocks hold none), some -1,
    all -1 in row 5, one key listed twice in row 3."""
    back = torch.randint(0, 12, (2, seq_len, 6), generator=generator)
    selected = (torch.arange(seq_len)[:, None] + 8 - back).int().masked_fill(back == 0, -1)
    selected[:, 5] = -1
    selected[:, 3, 1] = selected[:, 3, 0].clamp(min=0)
    return selected.clamp(max=key_len - 1)


@pytest.mark.parametrize("chunk_values", [2**26, 1], ids=["one chunk", "a row each"])
def test_key_selection_layout_marks_exactly_the_listed_keys(chunk_values, monkeypatch):
    """The bitmap layout of FlexAttention's DSA/CSA path (layout.key_selection_layout): its
    token rule is true exactly at the listed (query, key) pairs (-1 slots and a key listed twice
    included), and a block pair is visited exactly when it holds one. T and S are multiples of
    neither the blocks nor 32."""
    from megatron_ext.kernels.sparse import layout

    monkeypatch.setattr(layout, "_BITS_CHUNK_VALUES", chunk_values)
    seq_len, key_len, q_block, kv_block = 37, 45, 16, 32
    selected = _near_selection(seq_len, key_len, torch.Generator().manual_seed(4))
    result = layout.key_selection_layout(selected, key_len, q_block, kv_block)
    listed = reference.selected_mask(selected, key_len)  # [B, T, S]
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(seq_len), torch.arange(key_len),
                              indexing="ij")
    assert torch.equal(result.mask_mod(b, 0, q, kv), listed)
    padded = torch.nn.functional.pad(listed, (0, 64 - key_len, 0, 48 - seq_len))
    blocks = padded.view(2, 3, q_block, 2, kv_block).any(-1).any(2)
    assert torch.equal(result.active, blocks[:, None])
    assert not blocks.all()
    with pytest.raises(ValueError, match="multiple of 32 keys"):
        layout.key_selection_layout(selected, key_len, q_block, 16)


@pytest.mark.parametrize("case", ["top-k", "top-k+sink"])
def test_flex_forward_matches_reference(case):
    """Backend "flex" (the bitmap layout through FlexAttention) forward on the CPU against the
    reference; its backward runs on CUDA only (tests/ops/test_sparse_triton.py)."""
    x, top_k, sink, _ = _case(case, {n: t.detach() for n, t in _inputs().items()})
    q, k, v = (torch.cat([t, t], dim=-1) for t in (x["q"], x["k"], x["v"]))  # D = 16
    selected = _select(x, top_k, None, "reference")
    selected[:, ::5] = -1
    got = sparse.dsa_attention(q, k, v, selected, sink=sink, backend="flex")
    want = sparse.dsa_attention(q, k, v, selected, sink=sink, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gathered_bf16_is_close_to_fp32_reference():
    x = {name: t.detach() for name, t in _inputs().items()}
    low = {name: t.bfloat16() for name, t in x.items()}
    selected = _select(low, TOP_K, None, "gathered")
    out = sparse.dsa_attention(low["q"], low["k"], low["v"], selected, sink=low["sink"])
    expected = sparse.dsa_attention(*(low[n].float() for n in ("q", "k", "v")), selected,
                                    sink=low["sink"].float(), backend="reference")
    assert out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() < 2e-2


def test_bad_arguments_fail_clearly():
    x = {name: t.detach() for name, t in _inputs().items()}
    with pytest.raises(ValueError, match="top_k=0 must be >= 1"):
        sparse.dsa_select(x["index_q"], x["index_k"], x["index_weights"], top_k=0)
    with pytest.raises(ValueError, match=r"index_k \[B, T, DI\].*got .*index_k \(2, 37, 4\)"):
        sparse.dsa_select(x["index_q"], x["index_k"][..., :4], x["index_weights"], top_k=2)
    with pytest.raises(ValueError, match=r"selected has shape \(2, 36, 3\)"):
        sparse.dsa_attention(x["q"], x["k"], x["v"], torch.zeros(2, 36, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="dsa_indexer_loss: unknown backend 'flash'"):
        sparse.dsa_indexer_loss(x["q"], x["k"], x["index_q"], x["index_k"],
                                x["index_weights"], backend="flash")
    shares = sparse.QueryShares(torch.arange(36).view(2, 18), 0, lambda mass: mass[0])
    with pytest.raises(ValueError, match=r"shares.positions has shape \(2, 18\)"):
        sparse.dsa_indexer_loss(x["q"], x["k"], x["index_q"], x["index_k"],
                                x["index_weights"], shares=shares)
    shares = sparse.QueryShares(torch.arange(T).view(1, T), 0, lambda mass: mass[0])
    with pytest.raises(ValueError, match=r"index_q \[B, n, HI, DI\].*n = 37"):
        sparse.dsa_indexer_loss(x["q"], x["k"], x["index_q"][:, :5], x["index_k"],
                                x["index_weights"][:, :5], shares=shares)
