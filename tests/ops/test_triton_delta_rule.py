"""gated_delta_rule(backend="triton"), our own Triton kernels, against the token-by-token
reference, forward and backward, on CUDA (skipped without it). ``check`` is also what
tests/ops/test_triton_interpret_delta_rule.py runs on the CPU under Triton's interpreter.

Each check runs the kernels and the reference (in fp64, on the same device) on the same input values, and
compares o, the final state and the gradients of a fixed random projection of both (and of the
write residual where asked) w.r.t. every input, gates and initial state included. q, k and v are
drawn as bf16 values for every checked dtype (gates and initial state in fp32), so that one
reference run serves all dtypes; the fp32 checks still run the kernels' fp32 path throughout.
The layouts: T of 1, 63, 64, 65 and 200 (one token, either side of a chunk boundary, several
chunks with a partial last one), state walks cut into segments (as chosen at T = 4117, B = 1, and
forced to 2 chunks over packed sequences), grouped heads (Hk = 2 q/k heads for Hv = 4) and Hk = Hv, packed
sequences of 37, 27, 0 and 66 tokens (an empty one, and one across a chunk boundary) with an
initial state each, K != V (64 and 128, so that a transposed state cannot pass) and K = V = 128
(the production head dim); and strong decay, with log-decays from 0 down to -20 per token, so
that G falls to about -1300 inside a chunk.

Tolerances, relative errors in the Frobenius norm, ||actual - expected|| / ||expected||:
- fp32 q, k, v: the kernels run every tl.dot in full fp32 ("ieee"), so they agree with the
  reference to fp32 rounding, amplified by the sums over channels and tokens and by the
  triangular solve: measured 1e-7 to 8e-7 under the interpreter (K, V of 16 to 64, T up to
  130), strong decay included. We allow 1e-5 (1e-4 with strong decay, where fp32 holds G, and
  so every exp(G_t - G_s), only to ~1e-4 absolute and a GPU's parallel cumulative sum rounds
  differently); an algebraic slip gives 1e-3 or more.
- bf16 q, k, v: the kernels round their dot operands and stored tiles (P, T = (I + A)^-1, W, U,
  the chunk states, ...) to bf16, 2^-8 = 3.9e-3 relative each, as fla-core does. Measured under
  the interpreter (its bf16 dots widened to fp32, as tensor cores multiply): 4e-4 in fp16, and
  in bf16 6e-4 to 1.6e-2 on the layouts here (K = 64, V = 128, T up to 130; o and the final
  state at most 1.2e-2). We allow 2e-2 for o and the final state and 5e-2 for the gradients
  (those of the gates sum many such products), fla-core's own tolerances at this precision (as
  in test_fla_backend.py).

A kernel that faults (an illegal memory access) leaves the process's CUDA context unusable: the
tests after it then fail at once, each naming the test that faulted.
"""
import contextlib
import functools

import pytest
import torch

from megatron_ext.kernels.delta_rule import gated_delta_rule_reference, gated_delta_rule_triton
from megatron_ext.kernels.delta_rule import triton as delta_rule_triton
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.registry import BackendUnavailable
from megatron_ext.kernels import selfcheck
from megatron_ext.kernels.selfcheck import delta_rule_inputs

pytestmark = pytest.mark.gpu

CASES = ["deltanet", "gated_deltanet", "kda", "gdn2"]
KEY_DIM, VALUE_DIM = 64, 128
# (outputs, gradients) by dtype of q, k, v; see the module docstring.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 5e-2), torch.float16: (2e-2, 5e-2)}
STRONG_DECAY_TOLERANCE = 1e-4  # fp32, see the module docstring
PACKED = [0, 37, 64, 64, 130]
LAYOUTS = [
    *(dict(batch=2, seq_len=seq_len) for seq_len in (1, 63, 64, 65, 200)),
    dict(cu_seqlens=PACKED),
    dict(batch=2, seq_len=130, value_heads=2),
]


_FAULT = []  # the first test after which CUDA was unusable, and its error


@pytest.fixture(autouse=True)
def _stop_after_a_cuda_fault(request):
    """A kernel that faults (an illegal memory access, say) leaves the process's CUDA context
    unusable, so that every later test would fail with the same error: after the first such test,
    fail the rest at once, naming it."""
    if _FAULT:
        pytest.fail(f"not run: CUDA has been unusable since {_FAULT[0]} ({_FAULT[1]}); run that test "
                    "alone with CUDA_LAUNCH_BLOCKING=1 to see which kernel faulted", pytrace=False)
    yield
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:  # torch.AcceleratorError
        _FAULT.extend([request.node.name, str(error).strip().splitlines()[0]])


def _strengthen_decay(g: torch.Tensor) -> torch.Tensor:
    """Scale the log-decays by 0 to 40 across the last axis (heads, or key channels) and clamp them
    at -20: from no decay to exp(-20) per token."""
    factor = torch.linspace(0.0, 40.0, g.shape[-1], dtype=g.dtype)
    return (g * factor).clamp(min=-20.0)


def _run(function, inputs, weights, options):
    """The outputs (o, final state and, if weighted, the write residual) and the gradients, by
    input name, of sum(output * weight)."""
    leaves = {name: tensor.clone().requires_grad_() for name, tensor in inputs.items()}
    outputs = function(**leaves, output_final_state=True, **options)
    loss = sum((output.double() * weight.to(output.device)).sum() for output, weight in zip(outputs, weights))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return outputs, dict(zip(leaves, grads))


@functools.lru_cache(maxsize=None)
def _expected(case, batch, seq_len, cu_seqlens, key_heads, value_heads, key_dim, value_dim,
              strong_decay, residual, erase_with_beta, seed, device):
    """The inputs (q, k, v bf16 values in fp32; the rest fp32), options and projection weights of
    a check, on the CPU, and the reference's outputs and gradients on them in fp64, computed on
    ``device``."""
    num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
    inputs = delta_rule_inputs(case, batch=batch, seq_len=seq_len, key_heads=key_heads,
                               value_heads=value_heads, key_dim=key_dim, value_dim=value_dim,
                               num_states=num_states, seed=seed)
    inputs = {name: tensor.detach() for name, tensor in inputs.items()}
    if strong_decay:
        inputs["g"] = _strengthen_decay(inputs["g"])
    if erase_with_beta:
        generator = torch.Generator().manual_seed(seed + 1)
        erase = torch.randn(inputs["g"].shape, generator=generator, dtype=torch.float64)
        inputs["erase"] = torch.sigmoid(erase)
    inputs = {name: (tensor.bfloat16() if name in ("q", "k", "v") else tensor).float()
              for name, tensor in inputs.items()}
    options = {"return_write_residual": residual}
    if cu_seqlens is not None:
        options["cu_seqlens"] = torch.tensor(cu_seqlens, dtype=torch.int32)

    shapes = [(batch, seq_len, value_heads, value_dim), (num_states, value_heads, key_dim, value_dim)]
    generator = torch.Generator().manual_seed(seed + 2)
    weights = [torch.randn(shape, generator=generator) for shape in shapes + shapes[:1] * residual]
    weights[0] = weights[0].bfloat16()  # o comes in v's dtype: project it with representable weights
    weights = [weight.double() for weight in weights]
    expected = _run(gated_delta_rule_reference,
                    {name: tensor.to(device, torch.float64) for name, tensor in inputs.items()}, weights,
                    {name: value.to(device) if torch.is_tensor(value) else value for name, value in options.items()})
    return inputs, options, weights, expected


@contextlib.contextmanager
def _segmented_walks(segment_chunks):
    """Inside, the kernels cut their state walks into segments of ``segment_chunks`` chunks where
    they cut them at all (``_segment_chunks``); on leaving, assert that every call did."""
    module, chosen = delta_rule_triton, []
    saved, decide = module._SEGMENT_CHUNKS, module._segment_chunks
    module._SEGMENT_CHUNKS = segment_chunks
    module._segment_chunks = lambda *args: chosen.append(decide(*args)) or chosen[-1]
    try:
        yield
    finally:
        module._SEGMENT_CHUNKS, module._segment_chunks = saved, decide
    assert chosen and all(c == segment_chunks for c in chosen), chosen


def check(case, *, device, dtype=torch.float32, batch=2, seq_len=None, cu_seqlens=None,
          key_heads=2, value_heads=4, key_dim=KEY_DIM, value_dim=VALUE_DIM, strong_decay=False,
          residual=False, erase_with_beta=False, segment_chunks=None, seed=0) -> dict[str, float]:
    """Run the triton backend on ``device`` with q, k, v in ``dtype`` against the fp64 reference on
    the same values; assert that every output and gradient is within the tolerance (NaN is not);
    return the errors by name.

    ``cu_seqlens`` (a list) packs sequences (then batch is 1); ``erase_with_beta`` (kda only) adds
    an erase gate per key channel, so that beta is the write gate alone; ``residual`` also
    compares the write residual and its gradient; ``segment_chunks`` runs segmented state walks
    of that many chunks (asserting that they ran)."""
    if cu_seqlens is not None:
        batch, seq_len = 1, cu_seqlens[-1]
    inputs, options, weights, (expected, expected_grads) = _expected(
        case, batch, seq_len, None if cu_seqlens is None else tuple(cu_seqlens), key_heads, value_heads,
        key_dim, value_dim, strong_decay, residual, erase_with_beta, seed, device)
    inputs = {name: tensor.to(device=device, dtype=dtype if name in ("q", "k", "v") else tensor.dtype)
              for name, tensor in inputs.items()}
    options = {name: value.to(device) if torch.is_tensor(value) else value for name, value in options.items()}
    with _segmented_walks(segment_chunks) if segment_chunks else contextlib.nullcontext():
        actual, actual_grads = _run(gated_delta_rule_triton, inputs, weights, options)

    assert actual[0].dtype == dtype and actual[1].dtype == torch.float32
    names = ["o", "final_state", "write_residual"]
    errors = {name: relative_error(a, e) for name, a, e in zip(names, actual, expected)}
    for name, grad in actual_grads.items():
        assert grad.dtype == inputs[name].dtype, f"grad of {name} is {grad.dtype}"
        errors[f"grad_{name}"] = relative_error(grad, expected_grads[name])
    output_tolerance, grad_tolerance = TOLERANCES[dtype]
    if strong_decay and dtype == torch.float32:
        output_tolerance = grad_tolerance = STRONG_DECAY_TOLERANCE
    over = {name: f"{error:.2e}" for name, error in errors.items()
            if not error <= (grad_tolerance if name.startswith("grad_") else output_tolerance)}
    layout = f"cu_seqlens={cu_seqlens}" if cu_seqlens is not None else f"B={batch}, T={seq_len}"
    assert not over, (f"{case} {dtype} {layout} Hk={key_heads} Hv={value_heads} K={key_dim} V={value_dim}"
                      f"{' strong decay' if strong_decay else ''}: over the tolerance {over}")
    return errors


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case, dtype):
    for layout in LAYOUTS:
        check(case, device="cuda", dtype=dtype, **layout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["gated_deltanet", "kda", "gdn2"])
def test_strong_decay(case, dtype):
    check(case, device="cuda", dtype=dtype, seq_len=200, strong_decay=True)
    check(case, device="cuda", dtype=dtype, cu_seqlens=PACKED, strong_decay=True)


@pytest.mark.parametrize("case", ["gated_deltanet", "kda"])
def test_production_head_dims(case):
    check(case, device="cuda", dtype=torch.bfloat16, seq_len=200, key_dim=128, value_dim=128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["gated_deltanet", "kda"])
def test_hybrid_preset_heads(case, dtype):
    """The hybrid presets' grouping, four v heads per q/k head, at K = V = 64: _bwd_qkg sums each
    group's q/k gradients over four v heads. KDA in bf16 there is declined on a GPU
    (kernels.backends._delta_declined: its gradients came back NaN on an H100), so the backend
    refuses it, saying why."""
    shape = dict(seq_len=200, key_heads=2, value_heads=8, key_dim=64, value_dim=64)
    if case == "kda" and dtype == torch.bfloat16:
        with pytest.raises(BackendUnavailable, match="per-channel decay at V = 64"):
            check(case, device="cuda", dtype=dtype, **shape)
    else:
        check(case, device="cuda", dtype=dtype, **shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_segmented_walks(case, dtype):
    """The state walks in segments: as they are chosen (one sequence of 65 chunks, few heads: 16
    chunks a segment) and, forced to 2 chunks, over packed sequences with initial states (one
    head, so that the four walks fill at most half the SMs and _segment_chunks segments them)."""
    check(case, device="cuda", dtype=dtype, batch=1, seq_len=4117, segment_chunks=16)
    check(case, device="cuda", dtype=dtype, cu_seqlens=[0, 37, 64, 64, 600], key_heads=1, value_heads=1,
          segment_chunks=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", ["gated_deltanet_segmented", "kda_segmented"])
def test_selfcheck_segmented_cases(case, dtype):
    """The self-check's segmented cases (what backend="auto" relies on for the segmented walks)
    pass here, and their walks were cut into segments of 16 chunks."""
    with _segmented_walks(16):
        result = selfcheck.check_backend("gated_delta_rule", case, "triton", "cuda", dtype)
    assert result.passed, (result.errors, result.note)


def test_write_residual():
    check("gdn2", device="cuda", seq_len=130, residual=True)


@pytest.mark.slow
def test_erase_gate_with_beta_and_fp16():
    check("kda", device="cuda", seq_len=130, erase_with_beta=True)
    check("kda", device="cuda", dtype=torch.float16, seq_len=130)
