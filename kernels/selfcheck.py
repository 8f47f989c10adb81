"""The self-check: every backend of every op against the fp32 reference, on small shapes, forward
and backward, on one device. ``megatron-ext doctor`` prints it; kernels/backends.py runs it once
per machine before ``backend="auto"`` trusts our Triton kernels.

What is checked, per op (``OPS``; the cases are named in ``cases.py``):
    gated_delta_rule        deltanet, gated_deltanet, kda, gdn2, kda on packed sequences, and
                            gated_deltanet and kda on one sequence of SEGMENTED_LEN = 4117 tokens
                            (the Triton kernels' segmented state walks; oracle: the chunked form)
    decay_linear_attention  none, constant (per head: RetNet, Lightning), per_head (Mamba-2 SSD),
                            per_channel (GLA), and per_channel on packed sequences
    dplr_delta_rule         rwkv7 (RWKV-7's a, b and decay per key channel), per_head, none, and
                            rwkv7 on packed sequences
each with grouped heads (2 q/k heads serve 4 v heads), an initial state, and T = 97 = 64 + 33
tokens, odd and across a 64-token chunk boundary (packed: sequences of 5, 70 and 22 tokens).
K = 32 and V = 64 differ, so that a swapped layout cannot pass, and are powers of two at least 16
wide, as Triton kernels' matrix tiles want.

How: the inputs are made in fp64 and rounded once to the checked dtype, the way the mixers pass
them: q, k and v in the dtype (``LOW_PRECISION_INPUTS``), the gates and the initial state in
fp32. The oracle is the op's reference run in fp32 on the CPU on those same rounded values, with
the gradients of a fixed random projection of o and of the final state; the backend runs on the
device with the same projection. Errors are relative, in the Frobenius norm
``||actual - expected|| / ||expected||``, per output and per gradient; a check passes when every
one is finite and within the tolerance (``tolerance_for``).

After them, ``run_all`` gives the first-use checks of the fast paths outside ``OPS`` a row each
(``FIRST_USE_BACKENDS``): the sparse ops' FlashAttention path (``sparse.flash.check``, and
``sparse.flash.check_cudnn`` for its blocks and DSA's attention on cuDNN), the
residual Triton kernels (``residual.efficient.first_use_checks``), DSA's and CSA's
selected-attention kernels (``sparse.triton.check``), MoBA's selection kernel
(``sparse.triton_select.check_moba``), NSA's block-importance kernel
(``sparse.triton_select.check_importance``) and the fused layer kernels around the linear
mixers (``fused.ops.check_errors``). Where a row is skipped, and why, is the registry's
declaration of the backend the check verifies (softmax_attention's and dsa_attention's flash,
dsa_attention's triton, moba_selection's triton, the fused ops' triton).

The ops' backends, and what each takes, come from the backend registry (``registry.py``, where
each op package declares its op). A backend that cannot run a case here is skipped with its
reason and not run: by its rule in the registry (the devices "auto" runs it on, and what it
takes: e.g. ``backends.fla_unavailable_reason``), or because it refuses the call with a
RuntimeError saying ``"<op>: backend '<name>' cannot run ..."`` (e.g. fla-core's DeltaNet in
fp32). Where only the backward is refused, the forward is checked and the note says why the
backward was not.
"""
import dataclasses
import functools
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from . import decay, delta_rule, dplr, registry
from .cases import CASES, DECAY_CASES, DELTA_RULE_CASES, DPLR_CASES, DTYPES, Case
from .first_use import relative_error

__all__ = [
    "OPS", "CheckResult", "auto_backend", "check_backend", "decay_inputs", "delta_rule_inputs",
    "dplr_inputs", "run_all", "run_with_grads", "tolerance_for",
]

# ---------------------------------------------------------------------------------------------
# Inputs (shared with tests/ops/test_recurrence_ops.py, test_delta_rule.py, test_decay.py and
# test_dplr.py)
# ---------------------------------------------------------------------------------------------



def _leaf_inputs(draw_gates, *, batch, seq_len, key_heads, value_heads, key_dim, value_dim, dtype,
                 with_initial_state, num_states, seed):
    """Inputs of a recurrence op, every tensor a leaf in ``dtype`` that requires grad, drawn in
    this order from one seeded fp64 normal sampler ``randn(*shape)``: q, k (L2-normalised), v,
    then the family's gates (``draw_gates(randn)`` returns them by name), then the initial state
    ``[N, Hv, K, V]`` (N = num_states or B)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    tensors = {
        "q": randn(batch, seq_len, key_heads, key_dim),
        "k": F.normalize(randn(batch, seq_len, key_heads, key_dim), dim=-1),
        "v": randn(batch, seq_len, value_heads, value_dim),
    }
    tensors.update(draw_gates(randn))
    if with_initial_state:
        tensors["initial_state"] = randn(num_states or batch, value_heads, key_dim, value_dim)
    return {name: tensor.to(dtype).requires_grad_() for name, tensor in tensors.items()}


def delta_rule_inputs(case, *, batch=2, seq_len=37, key_heads=2, value_heads=4, key_dim=8,
                      value_dim=12, dtype=torch.float64, with_initial_state=True, num_states=None,
                      seed=0):
    """Keyword arguments for gated_delta_rule in the form of ``case`` (one of DELTA_RULE_CASES),
    every tensor a leaf in ``dtype`` that requires grad: q, k ``[B, T, Hk, K]``, v
    ``[B, T, Hv, V]``, beta ``[B, T, Hv]`` (or erase ``[B, T, Hv, K]`` and write ``[B, T, Hv, V]``
    for gdn2), g ``[B, T, Hv]`` (gated_deltanet) or ``[B, T, Hv, K]`` (kda, gdn2), and
    initial_state ``[N, Hv, K, V]`` (N = num_states or B).

    Keys are L2-normalised and gates lie in (0, 1), as in the models, so that the recurrence is
    contractive and the fp32 comparisons measure rounding, not an exploding state."""
    if case not in DELTA_RULE_CASES:
        raise ValueError(f"delta_rule_inputs: unknown case {case!r}; known cases: {DELTA_RULE_CASES}")
    per_head = (batch, seq_len, value_heads)

    def gates(randn):
        if case == "gdn2":
            drawn = {"erase": torch.sigmoid(randn(*per_head, key_dim)),
                     "write": torch.sigmoid(randn(*per_head, value_dim))}
        else:
            drawn = {"beta": torch.sigmoid(randn(*per_head))}
        if case == "gated_deltanet":
            drawn["g"] = F.logsigmoid(randn(*per_head) + 2.0)
        elif case in ("kda", "gdn2"):
            drawn["g"] = F.logsigmoid(randn(*per_head, key_dim) + 2.0)
        return drawn

    return _leaf_inputs(gates, batch=batch, seq_len=seq_len, key_heads=key_heads,
                        value_heads=value_heads, key_dim=key_dim, value_dim=value_dim, dtype=dtype,
                        with_initial_state=with_initial_state, num_states=num_states, seed=seed)


def decay_inputs(decay_form, *, batch=2, seq_len=37, key_heads=2, value_heads=4, key_dim=8,
                 value_dim=12, dtype=torch.float64, with_initial_state=True, num_states=None, seed=0):
    """Keyword arguments for decay_linear_attention with a decay of ``decay_form`` (one of
    DECAY_CASES: no g; g ``[Hv]``, RetNet's decays; g ``[B, T, Hv]``; g ``[B, T, Hv, K]``), every
    tensor a leaf in ``dtype`` that requires grad; shapes as in ``delta_rule_inputs``.

    Keys are L2-normalised and decays lie in (0, 1), as in the models, so that the fp32
    comparisons measure rounding, not a growing state."""
    if decay_form not in DECAY_CASES:
        raise ValueError(f"decay_inputs: unknown decay {decay_form!r}; known decays: {DECAY_CASES}")
    per_head = (batch, seq_len, value_heads)

    def gates(randn):
        if decay_form == "constant":  # RetNet's per-head decays
            return {"g": torch.log(1 - 2.0 ** (-5 - torch.arange(value_heads, dtype=torch.float64)))}
        if decay_form == "per_head":
            return {"g": F.logsigmoid(randn(*per_head) + 2.0)}
        if decay_form == "per_channel":
            return {"g": F.logsigmoid(randn(*per_head, key_dim) + 2.0)}
        return {}

    return _leaf_inputs(gates, batch=batch, seq_len=seq_len, key_heads=key_heads,
                        value_heads=value_heads, key_dim=key_dim, value_dim=value_dim, dtype=dtype,
                        with_initial_state=with_initial_state, num_states=num_states, seed=seed)


def dplr_inputs(form, *, batch=2, seq_len=37, key_heads=2, value_heads=4, key_dim=8,
                value_dim=12, dtype=torch.float64, with_initial_state=True, num_states=None, seed=0):
    """Keyword arguments for dplr_delta_rule with a decay of ``form`` (one of DPLR_CASES), every
    tensor a leaf in ``dtype`` that requires grad; shapes as in ``delta_rule_inputs``, a and b
    ``[B, T, Hv, K]``. a and b are RWKV-7's: ``a = -kappa_hat`` and ``b = kappa_hat * alpha``,
    kappa_hat an L2-normalised removal key apart from k and alpha in (0, 1); the decay ``g`` is
    RWKV-7's ``-exp(-0.5) * sigmoid(d)`` per key channel ("rwkv7"), a log-sigmoid per head
    ("per_head") or absent ("none")."""
    if form not in DPLR_CASES:
        raise ValueError(f"dplr_inputs: unknown form {form!r}; known forms: {DPLR_CASES}")
    per_channel = (batch, seq_len, value_heads, key_dim)

    def gates(randn):
        removal_key = F.normalize(randn(*per_channel), dim=-1)
        drawn = {"a": -removal_key, "b": removal_key * torch.sigmoid(randn(*per_channel))}
        if form == "rwkv7":
            drawn["g"] = -torch.exp(torch.tensor(-0.5)) * torch.sigmoid(randn(*per_channel))
        elif form == "per_head":
            drawn["g"] = F.logsigmoid(randn(batch, seq_len, value_heads) + 2.0)
        return drawn

    return _leaf_inputs(gates, batch=batch, seq_len=seq_len, key_heads=key_heads,
                        value_heads=value_heads, key_dim=key_dim, value_dim=value_dim, dtype=dtype,
                        with_initial_state=with_initial_state, num_states=num_states, seed=seed)


def run_with_grads(function, inputs, *, weights_dtype=None, **options):
    """o, the final state and the gradients (a dict by input name) of a fixed random projection
    of both, w.r.t. every input. The projection weights are drawn in fp32 (seed 1), rounded to
    ``weights_dtype`` if given, so that a low-precision run and its fp32 oracle take the same
    ones."""
    o, final_state = function(**inputs, output_final_state=True, **options)
    generator = torch.Generator().manual_seed(1)
    weights = []
    for tensor in (o, final_state):
        weight = torch.randn(tensor.shape, generator=generator)
        if weights_dtype is not None:
            weight = weight.to(weights_dtype)
        weights.append(weight.to(device=tensor.device, dtype=tensor.dtype))
    loss = (o * weights[0]).sum() + (final_state * weights[1]).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return o, final_state, dict(zip(inputs, grads))


# ---------------------------------------------------------------------------------------------
# The ops and their cases
# ---------------------------------------------------------------------------------------------

# K = 64 (not smaller): the decay Triton kernels decline K < 64 in 16-bit for its scalar forms
# (kernels.backends.decay_triton_unsupported), and a declined case fails the self-check.
BATCH, SEQ_LEN, KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 2, 97, 2, 4, 64, 128
PACKED_LENGTHS = (5, 70, 22)  # shorter than a chunk, across a chunk boundary, a rest: T = 97
# One sequence of 65 chunks, the last partial: at B = 1 and 4 v heads the delta-rule Triton
# kernels walk its states in 5 segments (kernels/delta_rule/triton.py, "Segmented walks") on a
# GPU of 64 SMs or more.
SEGMENTED_LEN = 64 * 64 + 21

# The tensors that take the checked dtype; the mixers compute gates and states in fp32.
LOW_PRECISION_INPUTS = ("q", "k", "v")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str                      # as declared in the backend registry
    function: Callable             # the public op; picks the backend by its ``backend=`` argument
    reference: Callable            # the oracle, called directly (not through the registry)
    make_inputs: Callable
    cases: tuple[Case, ...]
    # The oracle of the segmented cases, where the token-by-token reference is too slow (over a
    # minute on two CPU cores at SEGMENTED_LEN): the chunked form, checked against the reference
    # by the other cases.
    long_oracle: Callable | None = None

    @property
    def declared(self) -> registry.Op:
        return registry.get(self.name)

    def backends(self) -> list[str]:
        """The op's backends as the registry declares them, read at call time (so that a
        backend added or replaced there is what gets checked), then "auto"."""
        return [*self.declared.backends, "auto"]

    def case(self, name: str) -> Case:
        for case in self.cases:
            if case.name == name:
                return case
        raise ValueError(f"{self.name}: unknown case {name!r}; known cases: "
                         f"{', '.join(case.name for case in self.cases)}")


OPS = {
    op.name: op for op in (
        Op("gated_delta_rule", delta_rule.gated_delta_rule, delta_rule.gated_delta_rule_reference,
           delta_rule_inputs, cases=CASES["gated_delta_rule"],
           long_oracle=functools.partial(delta_rule.gated_delta_rule, backend="chunked")),
        Op("decay_linear_attention", decay.decay_linear_attention,
           decay.decay_linear_attention_reference, decay_inputs,
           cases=CASES["decay_linear_attention"]),
        Op("dplr_delta_rule", dplr.dplr_delta_rule, dplr.dplr_delta_rule_reference, dplr_inputs,
           cases=CASES["dplr_delta_rule"]),
    )
}


def auto_backend(op: str, device) -> str:
    """The backend that ``backend="auto"`` runs for ``op`` on ``device`` for inputs of any form
    and dtype the self-check covers (``registry.choose`` with the device alone: the Triton
    backend's verdict over every case). Should the op's own "auto" ever run another for a case,
    the "auto" row is checked with the wrong tolerance and fails loudly rather than passing
    silently."""
    return registry.choose(op, "auto", device=torch.device(device))


# ---------------------------------------------------------------------------------------------
# Tolerances
# ---------------------------------------------------------------------------------------------

# Relative errors (Frobenius norm) against the fp32 reference on the same rounded inputs.
# "exact" backends compute in fp32 with fp32 matmuls (our reference and chunked paths); "fast"
# ones are Triton kernels (fla-core, ours to come).
TOLERANCES = {
    # fp32 rounds at 6e-8; the chunked sums over K and over the tokens of a chunk, and its
    # unit-triangular solve, amplify that to at most ~8e-7 measured
    # (tests/ops/test_recurrence_ops.py), while an algebraic slip shows up as 1e-3 or more.
    ("exact", torch.float32): 1e-5,
    # bf16 q, k, v: the path computes in fp32 and rounds o and the gradients of q, k, v to bf16
    # at the end, 2^-8 = 3.9e-3 per element at most (measured 1.7e-3 in norm).
    ("exact", torch.bfloat16): 1e-2,
    # Triton's tl.dot takes fp32 operands as TF32 by default (10-bit mantissa, rounding 2^-11 =
    # 4.9e-4), compounded through the chunk's triangular solve and the state pass. fla-core's own
    # tests, at the same mantissa (fp16) and on longer sequences (T up to 1000, D up to 256),
    # allow 5e-3 for o, 8e-3 for most gradients and 2e-2 for those of beta and g.
    ("fast", torch.float32): 1e-2,
    # bf16 inputs to a fast kernel: o is rounded to bf16 (3.9e-3) and so are the kernel's
    # intermediate tiles (the WY / UT factors, the chunk states), which compounds to ~1e-2.
    # Not yet calibrated on a GPU: the gradients of the gates are the likeliest to come close.
    ("fast", torch.bfloat16): 2e-2,
}
EXACT_BACKENDS = ("reference", "chunked")


def tolerance_for(backend: str, dtype: torch.dtype, device, op: str | None = None) -> float:
    """The tolerance of ``backend`` (auto: the backend it runs) for inputs in ``dtype`` on
    ``device``. Torch's own matmuls count as fast on CUDA where they may use TF32
    (``torch.set_float32_matmul_precision`` other than "highest")."""
    if backend == "auto":
        backend = auto_backend(op, device)
    exact = backend in EXACT_BACKENDS and not (
        torch.device(device).type == "cuda" and torch.get_float32_matmul_precision() != "highest")
    return TOLERANCES[("exact" if exact else "fast", dtype)]


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class CheckResult:
    op: str
    case: str                      # "*" for a backend that cannot run any case here
    backend: str
    device: str
    dtype: str                     # "float32", "bfloat16", or "*"
    errors: dict[str, float] = dataclasses.field(default_factory=dict)  # "o", "final_state", "grad_q", ...
    tolerance: float | None = None
    passed: bool = False
    ms: float | None = None        # one forward + backward (forward only where the note says so)
    skipped_reason: str | None = None
    note: str | None = None        # an exception, or why only the forward was checked

    @property
    def status(self) -> str:
        return "skip" if self.skipped_reason is not None else "pass" if self.passed else "FAIL"

    @property
    def fwd_error(self) -> float | None:
        values = [error for name, error in self.errors.items() if not name.startswith("grad_")]
        return _worst(values)

    @property
    def bwd_error(self) -> float | None:
        values = [error for name, error in self.errors.items() if name.startswith("grad_")]
        return _worst(values)


def _worst(values: list[float]) -> float | None:
    if not values:
        return None
    return max(values, key=lambda value: float("inf") if value != value else value)  # NaN is worst


def _rounded_inputs(op: Op, case: Case, dtype: torch.dtype):
    """The case's inputs rounded to the checked dtype (detached, on the CPU) and its options."""
    num_states = len(PACKED_LENGTHS) if case.packed else None
    inputs = op.make_inputs(
        case.form, batch=1 if case.packed or case.segmented else BATCH,
        seq_len=SEGMENTED_LEN if case.segmented else SEQ_LEN, key_heads=KEY_HEADS,
        value_heads=VALUE_HEADS, key_dim=KEY_DIM, value_dim=VALUE_DIM, num_states=num_states)
    rounded = {name: tensor.detach().to(dtype if name in LOW_PRECISION_INPUTS else torch.float32)
               for name, tensor in inputs.items()}
    options = {}
    if case.packed:
        options["cu_seqlens"] = torch.tensor([0, *torch.tensor(PACKED_LENGTHS).cumsum(0).tolist()])
    return rounded, options


@functools.lru_cache(maxsize=None)
def _oracle(op_name: str, case_name: str, dtype: torch.dtype):
    """The reference (a segmented case: ``long_oracle``) in fp32 on the CPU on the rounded
    inputs: o, final state, gradients."""
    op = OPS[op_name]
    case = op.case(case_name)
    inputs, options = _rounded_inputs(op, case, dtype)
    inputs = {name: tensor.float().requires_grad_() for name, tensor in inputs.items()}
    oracle = op.long_oracle if case.segmented else op.reference
    o, final_state, grads = run_with_grads(oracle, inputs, weights_dtype=dtype, **options)
    return o.detach(), final_state.detach(), grads


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _refusal(op: Op, backend: str, error: Exception) -> str | None:
    """The reason, if ``error`` is the backend refusing the call ("<op>: backend '<name>' cannot
    run ..."), else None."""
    message = str(error)
    if isinstance(error, RuntimeError) and message.startswith(f"{op.name}: backend '{backend}' cannot run"):
        return message
    return None


def _walks_segments(op: Op, backend: str, device: torch.device) -> bool:
    """Whether ``backend`` is the Triton kernels (named, or what "auto" runs on ``device``), the
    one backend that cuts state walks into segments: the others have no row for a segmented case,
    whose oracle is the chunked form."""
    return backend == "triton" or (backend == "auto" and auto_backend(op.name, device) == "triton")


def _availability(op: Op, case: Case, backend: str, device: torch.device, dtype: torch.dtype):
    """(why the backend is not run at all, why its backward is not run), each None if it is: the
    backend's rule in the registry for the case's inputs on ``device``, with and without a
    backward. A segmented case checks the Triton kernels alone (``_walks_segments``)."""
    if case.segmented and not _walks_segments(op, backend, device):
        return "only the Triton kernels walk states in segments (the oracle here: the chunked form)", None
    if backend == "reference" and device.type == "cpu":
        return "the oracle itself (the reference in fp32 on the CPU)", None
    if backend == "auto":  # what it runs, it runs
        return None, None
    declared = op.declared.backend(backend)
    inputs, options = _rounded_inputs(op, case, dtype)
    with torch.enable_grad():  # as the check runs it: every input requires grad
        facts = op.declared.facts(**{name: tensor.requires_grad_() for name, tensor in inputs.items()},
                                  **options)
    facts = dataclasses.replace(facts, device=device)
    full = declared.declines(dataclasses.replace(facts, requires_grad=True))
    if full is None:
        return None, None
    forward = declared.declines(dataclasses.replace(facts, requires_grad=False))
    return (forward, None) if forward is not None else (None, full)


def check_backend(op: str, case: str, backend: str, device, dtype: torch.dtype) -> CheckResult:
    """Run ``backend`` of ``op`` on ``case`` (names from OPS) with inputs in ``dtype`` on
    ``device``, forward and backward, against the fp32 reference on the same rounded inputs.

    The backend is called through the op (``op(..., backend=backend)``), as the mixers call it, so
    that its backend table is what runs. The timed run follows one warm-up run on CUDA (where the
    first call compiles and autotunes Triton kernels). Never raises for a failing backend: an
    exception is a failed check with the exception in ``note``."""
    spec = OPS[op]
    the_case = spec.case(case)
    if backend not in spec.backends():
        raise ValueError(f"{op}: unknown backend {backend!r}; known backends: {', '.join(spec.backends())}")
    device = torch.device(device)
    result = CheckResult(op, case, backend, str(device), str(dtype).removeprefix("torch."),
                         tolerance=tolerance_for(backend, dtype, device, op))
    skipped, backward_refused = _availability(spec, the_case, backend, device, dtype)
    if skipped is not None:
        result.tolerance, result.skipped_reason = None, skipped
        return result

    inputs, options = _rounded_inputs(spec, the_case, dtype)
    with_grads = backward_refused is None
    inputs = {name: tensor.to(device).requires_grad_(with_grads) for name, tensor in inputs.items()}
    if "cu_seqlens" in options:  # int32 on the device, as Megatron's PackedSeqParams carries it
        options["cu_seqlens"] = options["cu_seqlens"].to(device=device, dtype=torch.int32)

    def run():
        if with_grads:
            return run_with_grads(spec.function, inputs, weights_dtype=dtype, backend=backend, **options)
        with torch.no_grad():
            return (*spec.function(**inputs, output_final_state=True, backend=backend, **options), {})

    try:
        if device.type == "cuda":
            run()
            _sync(device)
        start = time.perf_counter()
        o, final_state, grads = run()
        _sync(device)
        result.ms = (time.perf_counter() - start) * 1e3
    except Exception as error:  # noqa: BLE001 - a doctor reports every failure, it does not stop
        refusal = _refusal(spec, backend, error) if backend != "auto" else None
        if refusal is not None:
            result.tolerance, result.skipped_reason = None, refusal
        else:
            result.note = f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
        return result

    o_expected, state_expected, grads_expected = _oracle(op, case, dtype)
    result.errors = {"o": relative_error(o, o_expected),
                     "final_state": relative_error(final_state, state_expected)}
    result.errors.update({f"grad_{name}": relative_error(grad, grads_expected[name])
                          for name, grad in grads.items()})
    over = [f"{name} {error:.1e}" for name, error in result.errors.items()
            if not error <= result.tolerance]  # NaN is over
    result.passed = not over
    notes = [f"over the tolerance: {', '.join(over)}"] if over else []
    if backward_refused is not None:
        notes.append(f"forward only: {backward_refused}")
    elif backend == "auto":
        notes.append(f"auto runs {auto_backend(op, device)}")
    result.note = "; ".join(notes) or None
    return result


# On every device: fp32 checks the algebra at full precision, bf16 is what the models pass.


def run_all(device, on_result: Callable[[CheckResult], None] | None = None,
            backends: list[str] | None = None, ops: list[str] | None = None) -> list[CheckResult]:
    """Every backend of every op (or those named in ``backends``), every case, fp32 and bf16
    inputs, on ``device``, then the first-use checks of the other fast paths
    (``FIRST_USE_BACKENDS``); ``ops`` keeps the rows of these ops only (the table's first
    column, :func:`op_names`), and only those checks run. A backend that cannot run any case
    here for one reason (fla-core without CUDA; the reference on the CPU, which is the oracle)
    is one row with case and dtype "*". ``on_result`` is called with each result as it comes
    (the first CUDA calls compile)."""
    check_names(backends, ops)
    device = torch.device(device)
    results = []
    # One CPU thread: the tensors here are a few thousand elements, too small to gain from
    # intra-op threads, and on a machine whose cores are busy the threads' spin-waits made the
    # CPU run 3 to 10 times slower. Restored on the way out.
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        for result in _checks(device, backends, ops):
            results.append(result)
            if on_result is not None:
                on_result(result)
    finally:
        torch.set_num_threads(threads)
    return results


def check_names(backends: list[str] | None, ops: list[str] | None) -> None:
    """Raise ValueError naming the backends and ops among these that no check has."""
    known = {name for op in OPS.values() for name in op.backends()} | set(FIRST_USE_BACKENDS)
    unknown = sorted(set(backends or ()) - known)
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {sorted(known)}")
    names = op_names()
    unknown = sorted(set(ops or ()) - set(names))
    if unknown:
        raise ValueError(f"unknown ops {unknown}; known: {names}")


def op_names() -> list[str]:
    """The ops the doctor's rows name (its first column): those of ``OPS``, then those of the
    first-use checks."""
    first_use = (row.op for row, _ in _first_use_rows(torch.device("meta"), None))
    return [*OPS, *dict.fromkeys(first_use)]


def _checks(device: torch.device, backends: list[str] | None, ops: list[str] | None):
    for op in OPS.values():
        if ops is not None and op.name not in ops:
            continue
        runnable = []
        for backend in op.backends():
            if backends is not None and backend not in backends:
                continue
            cases = [case for case in op.cases if not case.segmented or _walks_segments(op, backend, device)]
            reasons = {_availability(op, case, backend, device, dtype)[0] for case in cases for dtype in DTYPES}
            if len(reasons) == 1 and None not in reasons:
                yield CheckResult(op.name, "*", backend, str(device), "*", skipped_reason=reasons.pop())
            else:
                runnable.append((backend, cases))
        for case in op.cases:
            for dtype in DTYPES:
                for backend, cases in runnable:
                    if case in cases:
                        yield check_backend(op.name, case.name, backend, device, dtype)
    for row, run in _first_use_rows(device, backends):
        if ops is None or row.op in ops:
            yield _run_first_use(row, run)


# The fast paths outside OPS, each with its own first-use check in the process that uses it:
# the FlashAttention-2 path of the sparse ops (backend "flash"), the residual Triton kernels,
# DSA's and CSA's selected-attention kernels, MoBA's selection kernel and NSA's block-importance
# kernel ("triton"). Their rows in the doctor's table; "auto" falls back where they fail.
FIRST_USE_BACKENDS = ("flash", "triton")


def _run_first_use(result: CheckResult, run: Callable[[], dict[str, float] | None]) -> CheckResult:
    """Run a first-use check unless its row is a skip: ``run()`` returns the errors (then the
    row's tolerance decides) or None (it raises on a mismatch)."""
    if result.skipped_reason is None:
        start = time.perf_counter()
        try:
            errors = run()
            result.errors = errors or {}
            result.passed = errors is None or all(error <= result.tolerance
                                                  for error in errors.values())
        except Exception as error:  # noqa: BLE001 - a check that cannot run fails
            result.note = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        result.ms = (time.perf_counter() - start) * 1e3
    return result


def _first_use_rows(device: torch.device, backends: list[str] | None):
    """``(row, run)`` of each first-use check, nothing run yet (``_run_first_use`` runs it)."""
    from .residual import efficient
    from .sparse import flash

    if backends is None or "flash" in backends:
        # the rules of softmax_attention's flash backend and of dsa_attention's (cuDNN's too)
        for check, case, op in ((flash.check, "first-use check", "softmax_attention"),
                                (flash.check_cudnn, "cuDNN first-use", "dsa_attention")):
            for dtype in (torch.bfloat16, torch.float16):
                facts = registry.Facts(device=device, dtype=dtype, key_dim=64, extra={"causal": True})
                reason = registry.get(op).backends["flash"].refusal(facts)
                yield (CheckResult("sparse_attention", case, "flash", str(device),
                                   str(dtype).removeprefix("torch."),
                                   tolerance=flash.CHECK_TOLERANCE, skipped_reason=reason),
                       functools.partial(check, device, dtype))
    if backends is None or "triton" in backends:
        for kernels, configuration, dtype, run in efficient.first_use_checks(device):
            yield (CheckResult(kernels, configuration, "triton", str(device),
                               str(dtype).removeprefix("torch."),
                               skipped_reason=run if isinstance(run, str) else None), run)
        yield from _selected_attention_checks(device)
        yield from _selection_checks(device)
        yield from _fused_layer_checks(device)


def _fused_layer_checks(device: torch.device):
    """The first-use check of the fused layer kernels (short conv + SiLU + L2 norm, gated
    RMSNorm, RMSNorm, RoPE, cross-entropy; ``fused.ops.check_errors``), one row per dtype."""
    from .fused import ops as fused

    triton = registry.get("rms_norm").backends["triton"]  # every fused op's: one first-use check
    for dtype in (torch.float32, torch.bfloat16):
        reason = triton.off_device(registry.Facts(device=device, dtype=dtype))
        yield (CheckResult("fused_layer_ops", "first-use check", "triton", str(device),
                           str(dtype).removeprefix("torch."), tolerance=fused.CHECK_TOLERANCE[dtype],
                           skipped_reason=reason),
               functools.partial(fused.check_errors, device, dtype))


def _selected_attention_checks(device: torch.device):
    """The first-use check of DSA's and CSA's selected-attention Triton kernels
    (``sparse.triton.check``), one row per dtype; a skip where dsa_attention's triton backend
    does not run (its rule in the registry: where Triton does not import, off CUDA, ...)."""
    triton = registry.get("dsa_attention").backends["triton"]
    selected = None
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        reason = triton.refusal(registry.Facts(device=device, dtype=dtype, key_dim=64))
        if reason is None:
            from .sparse import triton as selected
        tolerance = None if selected is None else selected.CHECK_TOLERANCE[dtype]
        yield (CheckResult("selected_attention", "first-use check", "triton", str(device),
                           str(dtype).removeprefix("torch."), tolerance=tolerance,
                           skipped_reason=reason),
               None if selected is None else functools.partial(selected.check, device, dtype))


def _selection_checks(device: torch.device):
    """The first-use checks of MoBA's selection kernel (``sparse.triton_select.check_moba``) and
    NSA's block-importance kernel (``check_importance``), one row per kernel and dtype; skips
    where their ops' triton backends (``moba_selection``, ``nsa_selection`` in the registry) do
    not run on the device or Triton does not import."""
    from .sparse import layout  # noqa: F401 - declares the selection ops

    kernel = registry.get("moba_selection").backends["triton"]
    reason = kernel.declines(registry.Facts(device=device))
    if reason is None:
        from .sparse import triton_select
    for op, check, tolerance in (("moba_selection", "check_moba", "MOBA_CHECK_TOLERANCE"),
                                 ("nsa_selection", "check_importance", "IMPORTANCE_TOLERANCE")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            yield (CheckResult(op, "first-use check", "triton", str(device),
                               str(dtype).removeprefix("torch."),
                               tolerance=None if reason else getattr(triton_select, tolerance),
                               skipped_reason=reason),
                   None if reason else functools.partial(getattr(triton_select, check), device,
                                                         dtype))


def failures(op: str, backend: str, device, case: str | None = None,
             dtype: str | None = None) -> list[str]:
    """Every case of ``op`` (fp32 and bf16) that ``backend`` does not pass on ``device``, as
    ``"case/dtype: why"``; empty when all pass. ``case`` and ``dtype`` (e.g. "kda", "bfloat16")
    check that one case or dtype only."""
    found, checked = [], 0
    for the_case in OPS[op].cases:
        for the_dtype in DTYPES:
            if case not in (None, the_case.name) or dtype not in (None, str(the_dtype).removeprefix("torch.")):
                continue
            checked += 1
            result = check_backend(op, the_case.name, backend, device, the_dtype)
            if result.status != "pass":
                found.append(f"{the_case.name}/{result.dtype}: "
                             f"{result.skipped_reason or result.note or 'failed'}")
    if not checked:
        raise ValueError(f"{op}: no case {case!r} in dtype {dtype!r}")
    return found


if __name__ == "__main__":
    # kernels/backends.py runs this in child processes: python -m ... OP BACKEND DEVICE [CASE
    # DTYPE]; the last stdout line is {"failures": [...]}.
    import json
    import sys

    print(json.dumps({"failures": failures(*sys.argv[1:6])}), flush=True)
