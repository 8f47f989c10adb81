"""The triton backend of dplr_delta_rule (kernels/dplr/triton.py) against direct PyTorch and the
reference, forward and backward, on CUDA (skipped without a GPU).

Two checks, shared with tests/ops/test_triton_interpret_dplr.py, which runs small cases of both
on Triton's CPU interpreter:

- ``check_scores``: the Triton op ``decayed_scores`` (the decayed scores of one row tensor against
  two column tensors) against a direct evaluation in fp64 of the same fp32 values,
  ``S[t, s] = sum_c rows[t, c] cols[s, c] exp(Grow[t, c] - G[s, c])`` for s < t with the pairwise
  exponents formed under the strict mask; Grow is G' (G shifted by one token, as for A and B) or
  G itself (as for P), G the cumulative sum of per-token log-decays. Forward, and the gradients
  of a fixed random projection of the scores with respect to rows, both cols and G (through G'
  where the rows take it), each a relative error in the Frobenius norm. The leaves are fp32 and
  the direct evaluation takes them exactly, so what is measured is the kernels' own rounding.
- ``check_case``: ``dplr_delta_rule(..., backend="triton")`` against the reference run in fp64 on
  the CPU on the same inputs, rounded once (q, k, v in the case's dtype; a, b, g and the initial
  state in fp32, as the RWKV-7 mixer passes them); o, the final state and the gradients of every
  input (q, k, v, a, b, g, initial_state) of the same random projection of o and the final state
  (selfcheck.run_with_grads).

"Strong" cases scale the per-token log-decays up to -20 per channel and token: G falls to about
-1300 inside a chunk, so any exponent taken across the diagonal (or on the wrong side of a
sub-chunk's reference point) would overflow to inf in fp32; the results must be finite and within
the same tolerance as the rest.

Tolerances (relative, Frobenius norm):
- ``SCORES_TOLERANCE`` 2e-6 for the op, forward and backward: fp32 products summed over K and a
  chunk, with the two factors of each off-diagonal exponent rounded apart; measured on the
  interpreter at most 1.8e-7 (the gradient of G at K = 128, strong decays).
- ``TOLERANCES[float32]`` 1e-5 for the whole op, what the PyTorch chunked form is held to
  (tests/ops/test_recurrence_ops.py): besides the scores, the chunked algorithm's fp32 solves,
  matmuls and state pass; measured on the interpreter at most 5.6e-7 (the gradients of a and g,
  strong decays).
- ``TOLERANCES[bfloat16]`` 5e-3: everything computes in fp32 from the bf16-rounded q, k, v, and o
  and the gradients of q, k, v are rounded to bf16 at the end, a relative 2^-8 = 3.9e-3 per
  element at most; measured 1.7e-3 on the interpreter (o, grad k), the rest as in fp32.
Not yet run on a GPU: the GPU cases below (T = 300 and 1024, K = 64 and 128) have these
tolerances from the interpreter's measurements.
"""
import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.kernels import dplr_delta_rule
from megatron_ext.kernels.dplr import dplr_delta_rule_reference, dplr_delta_rule_triton
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.selfcheck import dplr_inputs
from recurrence_checks import RecurrenceCase, compare_with_reference, synchronize

pytestmark = pytest.mark.gpu

SCORES_TOLERANCE = 2e-6
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 5e-3}
STRONGEST = 20.0  # the strongest per-token log-decay of the strong cases, -20 (exp(-20) = 2e-9)


# ------------------------------------------------------------------------- the decayed scores

@dataclasses.dataclass(frozen=True)
class ScoresCase:
    """``chunks`` chunks of ``chunk_size`` tokens and ``key_dim`` channels; rows decayed by G'
    (``before``, as a's in A and B) or by G (as q's in P); ``strong`` decays down to -20."""

    chunks: int = 2
    chunk_size: int = 64
    key_dim: int = 32
    before: bool = True
    strong: bool = False

    def __str__(self) -> str:
        return "-".join([f"M{self.chunks}", f"C{self.chunk_size}", f"K{self.key_dim}",
                         "Gprime" if self.before else "G", *(["strong"] if self.strong else [])])


def scores_inputs(case: ScoresCase) -> dict[str, torch.Tensor]:
    """rows, cols_b, cols_k ``[M, C, K]`` and G ``[M, C, K]``, the cumulative sum inside each
    chunk of RWKV-7-like log-decays ``-exp(-0.5) sigmoid(x)`` per channel and token (strong: the
    channels scaled by 0 to 40, clamped at -20), all fp32 (G summed in fp32, as the op does)."""
    generator = torch.Generator().manual_seed(0)
    shape = (case.chunks, case.chunk_size, case.key_dim)
    rows, cols_b, cols_k = (torch.randn(shape, generator=generator) for _ in range(3))
    g = -torch.exp(torch.tensor(-0.5)) * torch.sigmoid(torch.randn(shape, generator=generator))
    if case.strong:
        g = (g * torch.linspace(0, 2 * STRONGEST, case.key_dim)).clamp(min=-STRONGEST)
    return {"rows": rows, "cols_b": cols_b, "cols_k": cols_k, "G": g.cumsum(1)}


def _direct_scores(rows, row_decay, col_decay, cols):
    """The scores by their definition: the pairwise exponents ``[M, C, C, K]`` masked to s < t
    before exp."""
    chunk_size = rows.shape[-2]
    strictly_causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool).tril(-1)
    pairwise = (row_decay[:, :, None] - col_decay[:, None]).masked_fill(
        ~strictly_causal[..., None], float("-inf")).exp()
    return [torch.einsum("mtc,msc,mtsc->mts", rows, col, pairwise) for col in cols]


def _scores_with_grads(scores, leaves: dict[str, torch.Tensor], before: bool):
    """The two scores of leaves' rows against cols_b and cols_k, and the gradients of every
    leaf of their fixed random projection (seed 1, fp32 weights)."""
    decay = leaves["G"]
    row_decay = F.pad(decay[:, :-1], (0, 0, 1, 0)) if before else decay
    results = scores(leaves["rows"], row_decay, decay, [leaves["cols_b"], leaves["cols_k"]])
    generator = torch.Generator().manual_seed(1)
    weights = [torch.randn(result.shape, generator=generator).to(result) for result in results]
    loss = sum((result * weight).sum() for result, weight in zip(results, weights))
    return results, dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def check_scores(case: ScoresCase, device) -> dict[str, float]:
    """``decayed_scores`` on ``device`` against the direct fp64 evaluation of the same values,
    forward and backward; asserts finiteness and every relative error within SCORES_TOLERANCE.
    Returns the errors by name."""
    from megatron_ext.kernels.dplr.triton import decayed_scores

    inputs = scores_inputs(case)
    expected, grads_expected = _scores_with_grads(
        _direct_scores, {name: t.double().requires_grad_() for name, t in inputs.items()}, case.before)
    actual, grads = _scores_with_grads(
        decayed_scores, {name: t.to(device).requires_grad_() for name, t in inputs.items()}, case.before)
    errors = {f"S_{name}": relative_error(got, want) for name, got, want in zip("bk", actual, expected)}
    errors.update({f"grad_{name}": relative_error(grads[name], grads_expected[name]) for name in grads})
    finite = all(torch.isfinite(t).all() for t in (*actual, *grads.values()))
    table = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    assert finite and all(error <= SCORES_TOLERANCE for error in errors.values()), (
        f"{case}: tolerance {SCORES_TOLERANCE:g}, finite {finite}: {table}")
    return errors


# ---------------------------------------------------------------------------------- the op

@dataclasses.dataclass(frozen=True)
class Case(RecurrenceCase):
    """One check of the whole op (``form``: one of DPLR_CASES). ``strong``: per-token log-decays
    down to -20. ``chunk_size``: the backend's default (64) if None, else passed to it (the
    interpreter's cases take 32, for fewer padded tokens)."""

    form: str = "rwkv7"
    chunk_size: int | None = None

    def tags(self) -> list[str]:
        return [f"C{self.chunk_size}"] if self.chunk_size else []


def make_inputs(case: Case):
    """The case's inputs, rounded once (RecurrenceCase.rounded: a, b, g and the initial state in
    fp32, as the RWKV-7 mixer passes them), and its cu_seqlens (or None)."""
    inputs, cu_seqlens = case.inputs(dplr_inputs)
    if case.strong:
        inputs["g"] = (inputs["g"] * torch.linspace(0, 2 * STRONGEST, case.key_dim, dtype=torch.float64)
                       ).clamp(min=-STRONGEST)
    return case.rounded(inputs), cu_seqlens


def check_case(case: Case, device) -> dict[str, float]:
    """Run ``case`` on ``device`` through backend="triton" (or the backend's function with the
    case's chunk size) and compare with the fp64 reference on the CPU
    (recurrence_checks.compare_with_reference). Returns the errors by name."""
    rounded, cu_seqlens = make_inputs(case)
    if case.chunk_size is None:
        function = functools.partial(dplr_delta_rule, backend="triton")
    else:
        function = functools.partial(dplr_delta_rule_triton, chunk_size=case.chunk_size)
    return compare_with_reference(case, rounded, cu_seqlens, dplr_delta_rule_reference, function, device,
                                  tolerance=TOLERANCES[case.dtype], reference_dtype=torch.float64)


# ------------------------------------------------------------------------- the GPU's cases

GPU_SCORES_CASES = [ScoresCase(chunks=48, key_dim=key_dim, before=before, strong=strong)
                    for key_dim in (64, 128) for before in (True, False) for strong in (False, True)]
GPU_SCORES_CASES.append(ScoresCase(chunks=48, chunk_size=32, key_dim=256, strong=True))

# RWKV-7's head dims (K = V = 64) and the self-check's (K = 64, V = 128), 2 q/k heads serving 4 v
# heads, T = 300 (odd, 4 chunks and a 44-token rest) and 1024 (16 whole chunks), fp32 and bf16.
_GPU_DIMS = dict(key_heads=2, value_heads=4, key_dim=64, value_dim=64)
GPU_CASES = [Case(seq_len=seq_len, dtype=dtype, **_GPU_DIMS)
             for seq_len in (300, 1024) for dtype in (torch.float32, torch.bfloat16)]
GPU_CASES += [
    Case(seq_len=300, strong=True, **_GPU_DIMS),
    Case(seq_len=300, dtype=torch.bfloat16, **dict(_GPU_DIMS, value_dim=128, key_dim=128)),
    # packed: a short one, an empty one, one across chunks, one token
    Case(lengths=(5, 300, 0, 719, 1), **_GPU_DIMS),
    Case(lengths=(5, 300, 0, 719, 1), dtype=torch.bfloat16, **_GPU_DIMS),
    Case("per_head", seq_len=300, **_GPU_DIMS),
    Case("none", seq_len=300, initial_state=False, **_GPU_DIMS),
]


def _check_on_gpu(check, case) -> None:
    try:
        check(case, "cuda")
    finally:
        synchronize(f"in {case}")


@pytest.mark.parametrize("case", GPU_SCORES_CASES, ids=str)
def test_scores_match_direct_evaluation(case):
    _check_on_gpu(check_scores, case)


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_matches_reference(case):
    _check_on_gpu(check_case, case)


def test_auto_runs_triton_once_verified(monkeypatch):
    """On a GPU whose self-check passed (faked here: the check itself is the doctor's), "auto"
    runs the triton backend for a per-channel decay in bf16."""
    from megatron_ext.kernels import backends, registry

    monkeypatch.setattr(backends, "triton_verdict", lambda op, device, jobs=None: {"passed": True, "reason": ""})
    rounded, _ = make_inputs(Case(dtype=torch.bfloat16, **_GPU_DIMS))
    facts = registry.get("dplr_delta_rule").facts(**{name: t.cuda() for name, t in rounded.items()})
    assert registry.choose("dplr_delta_rule", "auto", facts) == "triton"
