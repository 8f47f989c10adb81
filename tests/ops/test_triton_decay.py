"""Our Triton kernels for decay_linear_attention (kernels/decay/triton.py) against the fp32
reference, forward and backward, on CUDA (skipped without a GPU).

``check_case`` is the one check: it also serves tests/ops/test_triton_interpret_decay.py, which
runs a small subset of ``GPU_CASES``' kind of cases on Triton's CPU interpreter.

Each case rounds q, k, v once to its dtype (g and the initial state stay fp32, as the mixers
pass them), runs the reference in fp32 on the CPU on those same values, and the kernels on the
device through ``decay_linear_attention(..., backend="triton")``; both take the gradients of the
same random projection of o and of the final state (selfcheck.run_with_grads). Errors are
relative, in the Frobenius norm, per output and per gradient (q, k, v, g, initial_state).

Tolerances (``TOLERANCES``):
- float32: 2e-5. The kernels take fp32 tl.dot inputs at full precision (input_precision "ieee",
  no TF32) and accumulate in fp32; the reference reassociates nothing. What is left is fp32
  rounding through sums over K, a chunk and a sequence, and the chunk-local cumulative
  log-decay G, which with strong decays reaches ~-2500 and carries an absolute rounding of
  ~1e-4 into exp(G_t - G_s) (the chunked PyTorch path has the same). Measured on the
  interpreter over every fp32 case below: at most 2e-6. An algebraic slip shows up as 1e-3 or
  more.
- float16: 5e-3, bfloat16: 2e-2. q, k, v are rounded before both runs, so what differs is the
  kernels' own low-precision steps: o is rounded to the dtype (2^-11 and 2^-8 per element), and
  so are the chunk states h_c and dh'_c, the decayed q and k tiles and P or dP before their
  matmuls, each a relative 2^-11 (fp16) or 2^-8 (bf16) per element (the decayed tiles of the two
  state passes 2^-11 for both: TF32), which compound to a few times that in norm. The interpreter
  cannot run bf16 (see the CPU module) nor round to TF32; with the GPU's bf16 and TF32 arithmetic
  emulated on it (a scratch patch of its tl.dot and roundings, not part of these tests), every
  case below is within 7.5e-3 in bf16 (the gradient of the constant g with strong decays; 3e-3
  for the rest), so 2e-2 leaves a 2.5x margin (the self-check's bf16 tolerance for fast kernels
  is the same), and, run in fp16, within 1.6e-3 (the gradient of a scalar g at K = 128, a sum of
  differences of products over the channels; 3.5e-4 for the rest). The final state is
  accumulated and returned in fp32 and gets the same tolerance as o.

A CUDA fault (an illegal memory access, say) breaks the CUDA context for the rest of the process,
after which every case would report the same error: ``synchronize`` ends the run at the first
one instead, naming the case.

GPU time: the cases share a few sets of compiled kernels (fp32 at K = 32, V = 64; bf16 at
K = V = 128, at K = 64, V = 128 and, per channel, at K = 32, V = 64), each ~20 kernels over the
three decay forms (constant and per-head decays share theirs); the references run on the CPU on
small shapes (~8 s in all on two cores). fp16 runs the bf16 kernels' code with another dtype and
is checked on the interpreter only.
"""
import dataclasses
import functools
import math

import pytest
import torch

from megatron_ext.kernels import decay_linear_attention
from megatron_ext.kernels.backends import decay_triton_declined_reason
from megatron_ext.kernels.decay import decay_linear_attention_reference
from megatron_ext.kernels.selfcheck import decay_inputs
from recurrence_checks import RecurrenceCase, compare_with_reference, synchronize

pytestmark = pytest.mark.gpu

DECAYS = ("none", "constant", "per_head", "per_channel")
TOLERANCES = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case(RecurrenceCase):
    """One check (``form``: the decay, one of DECAYS). ``strong``: per-token decays down to
    exp(-40). ``scale``: None for the default K ** -0.5."""

    scale: float | None = None

    def tags(self) -> list[str]:
        return [f"scale{self.scale:g}"] if self.scale is not None else []


def make_inputs(case: Case):
    """The case's inputs, rounded once (RecurrenceCase.rounded), and its cu_seqlens (or None)."""
    inputs, cu_seqlens = case.inputs(decay_inputs)
    if case.strong and "g" in inputs:
        # Decay strengths from 0 to 100 times the usual across the last axis (channels, or heads
        # for a scalar decay), per-token log-decays clamped at -40: G falls to about -2500
        # within a chunk, so any exponent taken on the wrong side of a reference token overflows.
        g = inputs["g"]
        if g.dim() == 1:
            inputs["g"] = -torch.logspace(-2, math.log10(40.0), g.numel(), dtype=g.dtype)
        else:
            inputs["g"] = (g * torch.linspace(0, 100, g.shape[-1], dtype=g.dtype)).clamp(min=-40.0)
    return case.rounded(inputs), cu_seqlens


def check_case(case: Case, device) -> dict[str, float]:
    """Run ``case`` on ``device`` through backend="triton" and compare with the fp32 reference
    on the CPU (recurrence_checks.compare_with_reference). Returns the errors by name."""
    rounded, cu_seqlens = make_inputs(case)
    options = {} if case.scale is None else {"scale": case.scale}
    return compare_with_reference(
        case, rounded, cu_seqlens, decay_linear_attention_reference,
        functools.partial(decay_linear_attention, backend="triton"), device,
        tolerance=TOLERANCES[case.dtype], reference_dtype=torch.float32, **options)


# fp32 at K = 32, V = 64 (K != V); bf16 at K = V = 128 (the benchmark's head dims), at K = 32,
# V = 64 (kernels/selfcheck.py's: a bf16 failure that `megatron-ext doctor` shows must show here
# too) and at K = 64, V = 128. Over T: a single token, one short of a chunk, exactly one, one
# past, and several chunks with a short end.
SEQ_LENS = (1, 63, 64, 65, 200)
DIMS = [(torch.float32, 32, 64), (torch.bfloat16, 128, 128), (torch.bfloat16, 32, 64), (torch.bfloat16, 64, 128)]


def _gpu_cases() -> list[Case]:
    cases = []
    for dtype, key_dim, value_dim in DIMS:
        dims = dict(dtype=dtype, key_dim=key_dim, value_dim=value_dim)
        for decay in DECAYS:
            cases += [Case(decay, seq_len=seq_len, **dims) for seq_len in SEQ_LENS]  # Hk = 2, Hv = 4
            cases.append(Case(decay, seq_len=130, key_heads=2, value_heads=2, initial_state=False, scale=1.0,
                              **dims))  # scale 1 as Mamba-2's
            # Packed: a short one, an exact chunk, an empty one, one across chunks, one token.
            cases.append(Case(decay, lengths=(5, 64, 0, 130, 1), **dims))
            if decay != "none":
                cases.append(Case(decay, seq_len=200, strong=True, **dims))
    return cases


GPU_CASES = _gpu_cases()


def _declined(case: Case) -> str | None:
    """kernels.backends.decay_triton_declined_reason for the case's inputs on the GPU."""
    q = torch.empty(1, 1, 1, case.key_dim, dtype=case.dtype, device="cuda")
    g = None if case.form == "none" else torch.empty(
        (1, 1, 1, case.key_dim) if case.form == "per_channel" else (1, 1, 1), device="cuda")
    return decay_triton_declined_reason(q, g)


@pytest.mark.parametrize("case", GPU_CASES, ids=str)
def test_triton_matches_reference(case):
    """Within the tolerance; or, for the inputs the kernels decline on a GPU (bf16 scalar forms at
    K = 32, measured wrong on the H200), refused with a clear error, and "auto" runs chunked."""
    synchronize(f"before {case} (left by an earlier test of this process; run this file alone)")
    try:
        if _declined(case):
            with pytest.raises(RuntimeError, match="backend 'triton' cannot run K = 32"):
                check_case(case, "cuda")
            q = torch.randn(1, 8, 1, case.key_dim, dtype=case.dtype, device="cuda")
            o, _ = decay_linear_attention(q, q, q, g=None if case.form == "none" else torch.full(
                (1, 8, 1), -0.1, device="cuda"), backend="auto")
            expected, _ = decay_linear_attention(q, q, q, g=None if case.form == "none" else torch.full(
                (1, 8, 1), -0.1, device="cuda"), backend="chunked")
            torch.testing.assert_close(o, expected, rtol=0, atol=0)
        else:
            check_case(case, "cuda")
    finally:
        synchronize(f"in {case}, the first case to fault")
