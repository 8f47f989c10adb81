"""The Triton kernels of DSA's and CSA's selected attention (kernels/sparse/triton.py, backend
"triton" of ``dsa_attention`` and ``csa_attention``) against the fp32 reference, forward and
every gradient (q, k, v, the sink; CSA's entries too), on CUDA (skipped without a GPU); the
indexer loss's target from ``selected_mass`` (each DSA case), its KL from
``selected_indexer_kl`` (``KL_CASES``: indexer heads 3 to 64, dims 16 to 128, rows with no key
or no target, one key in every row), and the whole loss on them (``check_indexer_loss``);
their first-use check; and "auto" running flex, then them beyond flex's key limit. The
lightning indexer's scores in one kernel (triton_indexer.py's ``index_scores``,
``check_index_scores``), and DSA's and CSA's selections on it.

The same cases on backend "flex" (FlexAttention with the selection as a bitmap,
``layout.key_selection_layout``), at the same tolerances.

``CASES`` and ``check_case`` are shared with tests/ops/test_triton_interpret_selected.py, which
runs them on the CPU under Triton's interpreter, hence their small sizes; ``GPU_CASES`` adds
longer ones. The selections are random, distinct keys per row in random order:
    causal (DSA's shape)   each query picks among its own and earlier keys, so that the first
                           K - 1 tokens have fewer than K and their rows are padded with -1
                           (at random places in the row);
    ``keys=S``             T queries pick among S > T keys, with no causal structure;
    ``empty_rows``         every 7th row all -1 (with and without a sink: output and
                           gradients of those queries exactly 0);
    ``csa_rate``           CSA through ``csa_attention``: the last ``window`` raw tokens and
                           K entries among those complete at the query (S = T + T // rate
                           keys: raw keys, then entries), against ``csa_attention_reference``.
Sizes: K of 40 and 67 (not multiples of the kernels' 64-key blocks; 67 = one full block and a
partial one), T of 70 (not a multiple of 64), grouped heads (4 on 1, 4 on 2, 6 on 2: a group
of 3 padded to 4, 32 on 1: more rows than the 16 of a tile) and MHA (2 on 2), head dims 16, 48
(padded to 64), 64 and 128 (256 on the GPU), with and without a sink, fp32, bf16 and fp16,
int32 and int64 selections.

Tolerances, relative error (Frobenius norm) of the output and of each gradient against the
reference run in fp32 on the same rounded inputs: 1e-5 in fp32, where the kernels add the same
products in another order (measured on the interpreter: at most 5e-7); 2e-2 in bf16 and fp16,
the first-use check's and flash.py's: the kernels round o, p and ds to 16 bits (measured on the
interpreter, which truncates where a GPU rounds: at most 7e-3 in bf16). A key dropped from
each row or a scale 10% off gives 8e-2 to 0.8 on the output (4e-2 or more on each
gradient).
"""
import dataclasses
import zlib

import pytest
import torch

from megatron_ext.kernels import sparse
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.sparse import reference

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    seq_len: int = 70
    top_k: int = 67
    q_heads: int = 4
    kv_heads: int = 2
    dim: int = 64
    batch: int = 2
    sink: bool = True
    dtype: torch.dtype = torch.float32
    keys: int | None = None  # S keys picked without causality; None: causal, S = T
    empty_rows: bool = False  # every 7th row all -1
    csa_rate: int | None = None  # CSA: K of the T // rate entries plus the window's raw tokens
    window: int = 8
    int64: bool = False  # selected as int64 (else int32)

    def __str__(self) -> str:
        parts = [f"B{self.batch}", f"T{self.seq_len}", f"K{self.top_k}",
                 f"H{self.q_heads}on{self.kv_heads}", f"D{self.dim}", str(self.dtype)[6:]]
        if self.keys is not None:
            parts.append(f"S{self.keys}")
        if self.csa_rate is not None:
            parts.append(f"csa-rate{self.csa_rate}-window{self.window}")
        flags = ["sink"] * self.sink + ["empty-rows"] * self.empty_rows + ["int64"] * self.int64
        return "-".join(parts + flags)


CASES = [
    Case(batch=1, q_heads=4, kv_heads=1),
    Case(batch=1, q_heads=2, kv_heads=2, dim=128, top_k=40, sink=False, empty_rows=True),
    Case(seq_len=9, keys=100, q_heads=4, kv_heads=1, dim=48, empty_rows=True),
    Case(seq_len=6, keys=30, top_k=20, q_heads=32, kv_heads=1, dim=16, sink=False),
    Case(seq_len=10, keys=80, q_heads=6, kv_heads=2, dim=64),
    Case(csa_rate=4, top_k=10, kv_heads=1),
    Case(batch=1, q_heads=4, kv_heads=1, dtype=torch.bfloat16),
    Case(batch=1, q_heads=2, kv_heads=2, dim=128, top_k=40, sink=False, empty_rows=True,
         dtype=torch.bfloat16),
    Case(seq_len=9, keys=100, q_heads=4, kv_heads=1, dim=48, dtype=torch.float16, int64=True),
]

GPU_CASES = [
    Case(),
    Case(csa_rate=4, top_k=10, dtype=torch.bfloat16),
    Case(seq_len=1000, top_k=300, q_heads=4, kv_heads=4, dim=128, dtype=torch.bfloat16),
    Case(seq_len=1000, top_k=300, q_heads=8, kv_heads=2, dim=128, dtype=torch.bfloat16,
         empty_rows=True),
    Case(seq_len=1000, top_k=300, q_heads=4, kv_heads=2, dim=128, sink=False),
    Case(seq_len=300, top_k=130, q_heads=4, kv_heads=2, dim=256, dtype=torch.bfloat16),
    Case(seq_len=1000, csa_rate=4, window=128, top_k=64, q_heads=4, kv_heads=1, dim=128,
         dtype=torch.bfloat16),
    Case(seq_len=1, top_k=1, batch=3, dtype=torch.bfloat16),
]


@dataclasses.dataclass(frozen=True)
class KLCase:
    """A call of ``selected_indexer_kl``: n queries over S keys (causal when S = T), K picks
    per query, HI indexer heads of dim DI."""
    seq_len: int = 70
    top_k: int = 67
    heads: int = 3
    dim: int = 16
    batch: int = 2
    keys: int | None = None  # S keys picked without causality; None: causal, S = T
    empty_rows: bool = False  # every 7th row all -1, every 5th with a zero target
    hot_key: bool = False  # every query's first slot is key 0 (one key, many atomic adds)
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        parts = [f"B{self.batch}", f"T{self.seq_len}", f"K{self.top_k}", f"HI{self.heads}",
                 f"DI{self.dim}", str(self.dtype)[6:]]
        if self.keys is not None:
            parts.append(f"S{self.keys}")
        return "-".join(parts + ["empty-rows"] * self.empty_rows + ["hot-key"] * self.hot_key)


KL_CASES = [
    KLCase(),
    KLCase(heads=64, dim=32, top_k=40, seq_len=50, batch=1),
    KLCase(heads=16, dim=48, top_k=130, seq_len=140, batch=1, empty_rows=True),
    KLCase(seq_len=30, keys=9, top_k=8, heads=4, dim=32, hot_key=True),
    KLCase(heads=4, dim=32, dtype=torch.bfloat16, hot_key=True),
]

GPU_KL_CASES = [
    KLCase(seq_len=1000, top_k=300, heads=64, dim=128, dtype=torch.bfloat16, empty_rows=True),
    KLCase(seq_len=1000, top_k=300, heads=64, dim=128, hot_key=True),
    KLCase(seq_len=500, keys=125, top_k=64, heads=8, dim=128, dtype=torch.float16),
]


def check_kl_case(case: KLCase, device) -> dict[str, float]:
    """``selected_indexer_kl`` on ``device`` against ``reference_indexer_kl`` in fp32 on the CPU
    (same rounded values): the loss and the gradients of index_q, index_k and index_weights.
    The target is random, 0 at the -1 slots (as the main attention's mass is). Returns the
    relative errors; asserts they are within ``TOLERANCE``."""
    from megatron_ext.kernels.sparse import triton_indexer

    generator = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    batch, seq_len = case.batch, case.seq_len
    keys = seq_len if case.keys is None else case.keys
    allowed = torch.ones(seq_len, keys, dtype=torch.bool)
    selected = _picks(batch, allowed.tril() if case.keys is None else allowed, case.top_k,
                      generator)
    if case.hot_key:
        selected[..., 1:][selected[..., 1:] == 0] = -1
        selected[..., 0] = 0
    if case.empty_rows:
        selected[:, ::7] = -1
    target = torch.rand(selected.shape, generator=generator) * (selected >= 0)
    if case.empty_rows:
        target[:, 3::5] = 0
    leaves = [torch.randn(*shape, generator=generator).to(case.dtype).float() for shape in
              ((batch, seq_len, case.heads, case.dim), (batch, keys, case.dim),
               (batch, seq_len, case.heads))]
    results = []
    for run, where, cast in ((triton_indexer.selected_indexer_kl, device, case.dtype),
                             (triton_indexer.reference_indexer_kl, "cpu", torch.float32)):
        inputs = [x.to(where, cast).requires_grad_() for x in leaves]
        loss = run(target.to(where), *inputs, selected.to(where))
        grads = torch.autograd.grad(loss, inputs)
        results.append([loss.detach().cpu(), *(g.float().cpu() for g in grads)])
    names = ["loss", "grad_index_q", "grad_index_k", "grad_index_weights"]
    errors = {name: relative_error(got, want) for name, got, want in zip(names, *results)}
    over = {name: f"{error:.2e}" for name, error in errors.items()
            if not error <= TOLERANCE[case.dtype]}
    assert not over, f"{case}: relative errors over {TOLERANCE[case.dtype]}: {over}"
    return errors


# (T, S, HI, DI, dtype) of triton_indexer.index_scores's checks: T and S not multiples of its
# 64 x 64 tiles, one query, 64 heads, dims padded (48 -> 64) or not.
SCORE_CASES = [(70, 70, 3, 16, torch.float32), (50, 130, 64, 48, torch.bfloat16),
               (1, 5, 2, 16, torch.float16), (65, 129, 16, 128, torch.float32)]


def check_index_scores(device) -> int:
    """``index_scores`` against ``lightning_index_scores`` in fp32 on the CPU (same rounded
    values; relative error 1e-5: the two add the same exact products in another order), and
    DSA's and CSA's selections with it against their references. The selections' inputs are
    small integers, so that every score is exact in both and the chosen keys must be equal,
    ties included. Returns how many cases ran."""
    from megatron_ext.kernels.sparse import selected as selected_ops
    from megatron_ext.kernels.sparse import triton_indexer

    generator = torch.Generator().manual_seed(5)
    for seq_len, key_len, heads, dim, dtype in SCORE_CASES:
        index = [torch.randn(*shape, generator=generator).to(dtype) for shape in
                 ((2, seq_len, heads, dim), (2, key_len, dim), (2, seq_len, heads))]
        got = triton_indexer.index_scores(*(x.to(device) for x in index)).cpu()
        want = reference.lightning_index_scores(*index)
        error = relative_error(got, want)
        assert got.shape == want.shape and error <= 1e-5, (seq_len, key_len, heads, dim, error)
    index = [torch.randint(-3, 4, shape, generator=generator).float() for shape in
             ((2, 90, 5, 16), (2, 90, 16), (2, 90, 5))]
    assert selected_ops._scores_function(index[0].to(device), index[1].to(device)) is \
        triton_indexer.index_scores
    on_device = [x.to(device) for x in index]
    for top_k in (1, 7, 64):
        got = sparse.dsa_select(*on_device, top_k=top_k).cpu().sort(-1).values  # any order
        want = sparse.dsa_select(*index, top_k=top_k, backend="reference").sort(-1).values
        assert torch.equal(got, want), ("dsa", top_k, (got != want).nonzero()[:5])
    entries = [index[0], index[1][:, :22], index[2]]
    got = sparse.csa_select(*(x.to(device) for x in entries), rate=4, top_k=5).cpu()
    want = sparse.csa_select(*entries, rate=4, top_k=5, backend="reference").sort(-1).values
    got = got.sort(-1).values
    assert torch.equal(got, want), ("csa", (got != want).nonzero()[:5])
    return len(SCORE_CASES) + 4


def _picks(batch, allowed, top_k, generator) -> torch.Tensor:
    """int32 ``[B, T, K]``: per query, K of its ``allowed [T, S]`` keys at random, in random
    order, -1 in the slots it has no key for (at random places)."""
    scores = torch.rand(batch, *allowed.shape, generator=generator).masked_fill(~allowed, -1.0)
    picked = scores.topk(top_k, dim=-1)
    selected = picked.indices.masked_fill(picked.values < 0, -1)
    shuffle = torch.rand(selected.shape, generator=generator).argsort(-1)
    return selected.gather(-1, shuffle).int()


def _problem(case: Case, generator):
    """The leaves (fp32, rounded to the case's dtype; the sink fp32), the output gradient,
    ``run(leaves, backend)`` and the selection (the DSA call's; CSA's entries), on the CPU."""
    batch, seq_len, dim = case.batch, case.seq_len, case.dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    leaves = {"q": randn(batch, seq_len, case.q_heads, dim)}
    if case.csa_rate is None:
        keys = seq_len if case.keys is None else case.keys
        allowed = torch.ones(seq_len, keys, dtype=torch.bool)
        selected = _picks(batch, allowed.tril() if case.keys is None else allowed, case.top_k,
                          generator)
    else:
        keys = seq_len
        entries = seq_len // case.csa_rate
        sees = reference.compressed_visibility(seq_len, case.csa_rate)  # [T, N]
        selected = _picks(batch, sees, case.top_k, generator)
        leaves.update(compressed_k=randn(batch, entries, case.kv_heads, dim),
                      compressed_v=randn(batch, entries, case.kv_heads, dim))
    leaves.update(k=randn(batch, keys, case.kv_heads, dim),
                  v=randn(batch, keys, case.kv_heads, dim))
    if case.empty_rows:
        selected[:, ::7] = -1
    if case.int64:
        selected = selected.long()
    leaves = {name: x.to(case.dtype).float() for name, x in leaves.items()}
    if case.sink:
        leaves["sink"] = randn(case.q_heads)
    grad = randn(batch, seq_len, case.q_heads, dim)

    def run(x, backend):
        options = dict(sink=x.get("sink"), backend=backend)
        if case.csa_rate is None:
            return sparse.dsa_attention(x["q"], x["k"], x["v"], selected.to(x["q"].device),
                                        **options)
        return sparse.csa_attention(x["q"], x["k"], x["v"], x["compressed_k"], x["compressed_v"],
                                    selected.to(x["q"].device), window=case.window, **options)

    return leaves, grad, run, selected


def _outputs(run, leaves, grad, backend, dtype, device):
    """The output and the gradients of ``<out, grad>`` (fp32, on the CPU), by name."""
    inputs = {name: (x if name == "sink" else x.to(dtype)).to(device).requires_grad_()
              for name, x in leaves.items()}
    out = run(inputs, backend)
    assert out.dtype == dtype and out.shape == grad.shape
    grads = torch.autograd.grad(out, list(inputs.values()), grad.to(device, dtype))
    return {"o": out.float().cpu(), **{f"grad_{name}": g.float().cpu()
                                       for name, g in zip(inputs, grads)}}


def check_case(case: Case, device, backend="triton") -> dict[str, float]:
    """Run ``case`` on ``backend`` (our kernels, "triton"; or "flex", FlexAttention over the
    selection's bitmap) on ``device`` and on the reference in fp32 on the CPU; assert they
    agree (and that the queries with no key get 0). Returns the relative errors."""
    generator = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    leaves, grad, run, selected = _problem(case, generator)
    got = _outputs(run, leaves, grad, backend, case.dtype, device)
    want = _outputs(run, leaves, grad, "reference", torch.float32, "cpu")
    errors = {name: relative_error(got[name], want[name]) for name in want}
    if case.csa_rate is None and backend == "triton":  # the indexer loss's target: the
        # probabilities summed over heads
        from megatron_ext.kernels.sparse import triton

        sink = leaves.get("sink")
        rounded = [leaves[n].to(device, case.dtype) for n in ("q", "k")] + [selected.to(device)]
        sink_on = None if sink is None else sink.to(device)
        expected = triton.reference_mass(leaves["q"], leaves["k"], selected, sink)
        errors["mass"] = relative_error(triton.selected_mass(*rounded, sink=sink_on).cpu(),
                                        expected)
        lse = triton.reference_lse(leaves["q"], leaves["k"], selected, sink).to(device)
        given = triton.selected_mass(*rounded, sink=sink_on, lse=lse)  # its phase 1 skipped
        errors["mass_given_lse"] = relative_error(given.cpu(), expected)
    over = {name: f"{error:.2e}" for name, error in errors.items()
            if not error <= TOLERANCE[case.dtype]}
    assert not over, f"{case}: relative errors over {TOLERANCE[case.dtype]}: {over}"
    nothing = (selected < 0).all(-1)  # [B, T]: queries without a key
    if case.csa_rate is None and nothing.any():
        for name in ("o", "grad_q"):
            assert not got[name][nothing].any(), f"{case}: {name} of a query with no key"
    return errors


def check_indexer_loss(device, dtype=torch.float32) -> float:
    """DSA's sparse-stage indexer loss on the kernels (backend "triton": the target from the
    mass kernel, the KL from ``selected_indexer_kl``) against the reference: the loss and the
    gradients of index_q, index_k and index_weights (T = 70, K = 67, 4 query heads on 2, 3
    indexer heads of dim 16, a sink), on the kernels also given the attention's log-sum-exp
    (``lse``, the reference's), and the loss as the sum of two shares of the queries
    (``QueryShares``), given it too. Returns the worst relative error; asserts it is within
    ``TOLERANCE``."""
    generator = torch.Generator().manual_seed(7)
    batch, seq_len, top_k = 2, 70, 67

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q, k = randn(batch, seq_len, 4, 32).to(dtype), randn(batch, seq_len, 2, 32).to(dtype)
    index = {"index_q": randn(batch, seq_len, 3, 16), "index_k": randn(batch, seq_len, 16),
             "index_weights": randn(batch, seq_len, 3)}
    sink = randn(4)
    selected = _picks(batch, torch.ones(seq_len, seq_len, dtype=torch.bool).tril(), top_k,
                      generator)
    results = []
    _indexer_losses(results, q, k, index, sink, selected, device, dtype)
    worst = max(relative_error(got, want) for got, want in zip(*results))
    assert worst <= TOLERANCE[dtype], f"indexer loss on the mass kernel ({dtype}): {worst:.2e}"
    return worst


def _indexer_losses(results, q, k, index, sink, selected, device, dtype):
    """check_indexer_loss's runs: on the kernels (without, then given the attention's lse) and
    on the reference (loss and gradients), then the kernels' loss (given lse) as the sum of
    two shares."""
    from megatron_ext.kernels.sparse import triton

    seq_len = q.shape[1]

    def run(backend, where, cast, lse=None):
        leaves = {n: x.to(where).requires_grad_() for n, x in index.items()}
        loss = sparse.dsa_indexer_loss(q.to(where, cast), k.to(where, cast), *leaves.values(),
                                       selected=selected.to(where), sink=sink.to(where),
                                       backend=backend, lse=lse)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        return [loss.detach().cpu(), *(g.cpu() for g in grads)]

    lse = triton.reference_lse(q.float(), k.float(), selected, sink).to(device)
    want = run("reference", "cpu", torch.float32)
    results += [run("triton", device, dtype) + run("triton", device, dtype, lse), want * 2]
    # Context parallelism's form: two shares of the queries (interleaved), whose losses sum to
    # the loss (one process holds every head here, so the reduce-scatter is the identity).
    positions = torch.arange(seq_len).view(seq_len // 2, 2).t()
    shared = q.new_zeros((), dtype=torch.float32).to(device)
    for rank in range(2):
        mine = positions[rank]
        shares = sparse.QueryShares(positions, rank, lambda mass, rank=rank: mass[rank])
        shared = shared + sparse.dsa_indexer_loss(
            q.to(device), k.to(device), index["index_q"][:, mine].to(device),
            index["index_k"].to(device), index["index_weights"][:, mine].to(device),
            selected=selected.to(device), sink=sink.to(device), shares=shares, backend="triton",
            lse=lse)
    results[0].append(shared.detach().cpu())
    results[1].append(results[1][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_indexer_loss_on_the_mass_kernel(dtype):
    check_indexer_loss("cuda", dtype)


@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=str)
def test_kernels_match_the_reference(case):
    check_case(case, "cuda")


@pytest.mark.parametrize("case", CASES + GPU_CASES, ids=str)
def test_flex_matches_the_reference(case):
    check_case(case, "cuda", backend="flex")


@pytest.mark.parametrize("case", KL_CASES + GPU_KL_CASES, ids=str)
def test_indexer_kl_matches_the_reference(case):
    check_kl_case(case, "cuda")


def test_index_scores_and_selections_match_the_reference():
    check_index_scores("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_first_use_check_passes(dtype):
    from megatron_ext.kernels.sparse import triton

    triton.checked.cache_clear()
    errors = triton.check(torch.device("cuda", torch.cuda.current_device()), dtype)
    assert all(error <= triton.CHECK_TOLERANCE[dtype] for error in errors.values()), errors
    assert triton.checked(torch.device("cuda", torch.cuda.current_device()), dtype)


def test_auto_runs_flex_then_the_kernels_beyond_its_keys(monkeypatch):
    """"auto" runs DSA's and CSA's attention on FlexAttention over the bitmap; beyond
    ``SELECTED_FLEX_MAX_KEYS`` keys, on the kernels once their check has passed."""
    from megatron_ext.kernels.sparse import triton

    # The check first (it calls the kernels itself): the calls counted are the ops'.
    assert triton.checked(torch.device("cuda", torch.cuda.current_device()), torch.bfloat16)
    calls, kernels, flex_run = [], triton.selected_attention, sparse.dsa.flex_attention_layout
    monkeypatch.setattr(triton, "selected_attention",
                        lambda *args, **kw: calls.append("triton") or kernels(*args, **kw))
    monkeypatch.setattr(sparse.dsa, "flex_attention_layout",
                        lambda *args, **kw: calls.append("flex") or flex_run(*args, **kw))
    problems = [_problem(case, torch.Generator().manual_seed(0)) for case in
                (Case(dtype=torch.bfloat16), Case(csa_rate=4, top_k=10, dtype=torch.bfloat16))]
    for limit, expected in ((sparse.dsa.SELECTED_FLEX_MAX_KEYS, "flex"), (69, "triton")):
        monkeypatch.setattr(sparse.dsa, "SELECTED_FLEX_MAX_KEYS", limit)
        calls.clear()
        for leaves, _, run, _ in problems:
            run({name: (x if name == "sink" else x.bfloat16()).cuda()
                 for name, x in leaves.items()}, "auto")
        assert calls == [expected] * 2, (limit, calls)
