"""What the checks of the recurrence ops' Triton backends against their references share
(tests/ops/test_triton_decay.py and test_triton_dplr.py, run on a GPU and, in small cases, on
Triton's CPU interpreter): a case's shapes and name, its inputs rounded as the mixers pass them,
the comparison of the backend's run with the reference's, and the stop at a CUDA fault."""
import dataclasses

import pytest
import torch

from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.selfcheck import run_with_grads

LOW_PRECISION_INPUTS = ("q", "k", "v")  # rounded to the case's dtype; the others stay fp32


@dataclasses.dataclass(frozen=True)
class RecurrenceCase:
    """One check. ``form``: the op's input form (the first argument of its inputs function in
    kernels/selfcheck.py). ``lengths``: packed sequences (cu_seqlens, B = 1) instead of B rows of
    ``seq_len`` tokens. ``strong``: decays far stronger than a model's (the test module says how
    strong)."""

    form: str
    seq_len: int = 65
    lengths: tuple[int, ...] | None = None
    batch: int = 2
    key_heads: int = 2
    value_heads: int = 4
    key_dim: int = 32
    value_dim: int = 64
    dtype: torch.dtype = torch.float32
    initial_state: bool = True
    strong: bool = False

    def tags(self) -> list[str]:
        """A subclass's own parts of the name."""
        return []

    def __str__(self) -> str:
        shape = f"lengths{list(self.lengths)}" if self.lengths else f"B{self.batch}xT{self.seq_len}"
        return "-".join([
            self.form, str(self.dtype).removeprefix("torch."), shape,
            f"H{self.key_heads}x{self.value_heads}", f"K{self.key_dim}V{self.value_dim}",
            *(["init"] if self.initial_state else []), *(["strong"] if self.strong else []),
            *self.tags(),
        ])

    def inputs(self, make_inputs) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``make_inputs(form, **shapes)`` (selfcheck's decay_inputs or dplr_inputs) of this case,
        detached fp64 CPU tensors, and its cu_seqlens (or None)."""
        packed = self.lengths is not None
        inputs = make_inputs(
            self.form, batch=1 if packed else self.batch,
            seq_len=sum(self.lengths) if packed else self.seq_len, key_heads=self.key_heads,
            value_heads=self.value_heads, key_dim=self.key_dim, value_dim=self.value_dim,
            with_initial_state=self.initial_state, num_states=len(self.lengths) if packed else None)
        cu_seqlens = torch.tensor([0, *torch.tensor(self.lengths).cumsum(0).tolist()]) if packed else None
        return {name: tensor.detach() for name, tensor in inputs.items()}, cu_seqlens

    def rounded(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs rounded once, as the mixers pass them: q, k, v in the case's dtype, the
        gates and the initial state in fp32."""
        return {name: tensor.to(self.dtype if name in LOW_PRECISION_INPUTS else torch.float32)
                for name, tensor in inputs.items()}


def compare_with_reference(case: RecurrenceCase, rounded, cu_seqlens, reference, function, device, *,
                           tolerance: float, reference_dtype: torch.dtype, **options) -> dict[str, float]:
    """Run ``reference`` on the CPU in ``reference_dtype`` and ``function`` on ``device``, both
    on the same rounded inputs, each with the gradients of one random projection of o and the
    final state (selfcheck.run_with_grads); assert o in the case's dtype, the final state in
    fp32, every gradient in its input's dtype, everything finite and every relative error
    (Frobenius norm) within ``tolerance``. Returns the errors by name ("o", "final_state",
    "grad_q", ...)."""
    if cu_seqlens is not None:
        options["cu_seqlens"] = cu_seqlens
    o_expected, state_expected, grads_expected = run_with_grads(
        reference, {name: t.to(reference_dtype).requires_grad_() for name, t in rounded.items()},
        weights_dtype=case.dtype, **options)

    inputs = {name: tensor.to(device).requires_grad_() for name, tensor in rounded.items()}
    if cu_seqlens is not None:  # int32 on the device, as Megatron's PackedSeqParams carries it
        options["cu_seqlens"] = cu_seqlens.to(device=device, dtype=torch.int32)
    o, final_state, grads = run_with_grads(function, inputs, weights_dtype=case.dtype, **options)

    assert o.dtype == case.dtype and final_state.dtype == torch.float32, (o.dtype, final_state.dtype)
    assert all(grads[name].dtype == inputs[name].dtype for name in grads)
    errors = {"o": relative_error(o, o_expected), "final_state": relative_error(final_state, state_expected)}
    errors.update({f"grad_{name}": relative_error(grads[name], grads_expected[name]) for name in grads})
    table = ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    finite = all(torch.isfinite(tensor).all() for tensor in (o, final_state, *grads.values()))
    assert finite and all(error <= tolerance for error in errors.values()), (
        f"{case}: tolerance {tolerance:g}, finite {finite}: {table}")
    return errors


def synchronize(where: str) -> None:
    """Wait for the GPU; on a CUDA fault (an illegal memory access, say) end the whole pytest run
    with a message naming ``where`` it was seen. The fault breaks the CUDA context for the rest of
    the process, so every later case would only repeat the same error."""
    try:
        torch.cuda.synchronize()
    except RuntimeError as error:  # torch.AcceleratorError: the sticky error of the faulting kernel
        pytest.exit(f"CUDA fault {where}: {error}\nThe CUDA context of this process is broken; the remaining "
                    "cases were not run.", returncode=1)
