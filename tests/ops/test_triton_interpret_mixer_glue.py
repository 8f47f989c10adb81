"""The linear mixers with their fused glue (kernels/fused/triton.py: the short convolutions, the
gates, the gated RMSNorm, writing their input gradients into the fused projection's gradient)
against the same mixers with the PyTorch reference glue, on Triton's CPU interpreter: output,
input gradient and every parameter's gradient, fp32, every mixer of
tests/modules/test_linear_mixers.py with fused glue (all but Hedgehog, whose normaliser has none) at
B = 2, T = 70 (odd, across the kernels' token tiles), and GDN, KDA and Mamba-2 on packed
sequences. The recurrence itself runs the chunked PyTorch op in both, so only the glue differs;
the fused run must launch Triton kernels, the reference run none. Skipped where Triton is not
installed; ~30 s on two cores."""
import dataclasses
import pathlib
import sys
import time

import torch

import triton_interpreter
from triton_interpreter import needs_triton

# The fused and the reference glue compute in fp32; what differs is the order of sums (measured
# up to 5.3e-6, in the decay parameters' gradients, sums over every token).
TOLERANCE = 2e-5
LAUNCHED: list[str] = []  # the kernels launched, by name (see main)
FUSED_OPS = ("short_conv", "gate", "gated_rms_norm", "rms_norm", "cross_entropy", "rope")


def _relative(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run(mixer, x, packed):
    out, _ = mixer(x, packed_seq_params=packed)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * probe).sum(), [x, *mixer.parameters()])
    return out.detach(), grads


def check(kind: str, packed: bool) -> float:
    """The worst relative difference between the fused and the reference glue."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_ext.kernels import registry
    from test_linear_mixers import _mixer

    if packed:
        cu = torch.tensor([0, 7, 40, 45], dtype=torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=33, max_seqlen_kv=33)
        shape = (45, 1, 64)
    else:
        params, shape = None, (70, 2, 64)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0), requires_grad=True)
    results, launched = [], []
    # "auto" of the fused ops as on a GPU whose first-use check passed (or failed): their Triton
    # backends on any device, verified (or not)
    declared = {op: registry.get(op).backends for op in FUSED_OPS}
    saved = {op: backends["triton"] for op, backends in declared.items()}
    for fused in (True, False):
        for op, backends in declared.items():
            backends["triton"] = dataclasses.replace(
                saved[op], auto_devices=None, verify=lambda facts, fused=fused: None if fused else "off")
        LAUNCHED.clear()
        try:
            results.append(_run(_mixer(kind, "chunked"), x, params))
        finally:
            for op, backends in declared.items():
                backends["triton"] = saved[op]
        launched.append(sorted(set(LAUNCHED)))
    assert launched[0] and not launched[1], (kind, launched)
    (out, grads), (out_ref, grads_ref) = results
    errors = [_relative(out, out_ref)] + [_relative(g, r) for g, r in zip(grads, grads_ref)]
    assert max(errors) <= TOLERANCE, (kind, packed, errors)
    return max(errors)


def main() -> None:
    triton_interpreter.setup()
    from triton.runtime import interpreter

    run_grid = interpreter.GridExecutor.__call__

    def run_grid_recording(self, *args, **kwargs):
        LAUNCHED.append(self.fn.__name__)
        return run_grid(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = run_grid_recording
    # tests/modules, for test_linear_mixers (harness is on the script's path: run_as_script)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "modules"))
    import harness
    from test_linear_mixers import KINDS

    harness.use_cpu()
    harness.init_single_process("gloo")
    cases = [(kind, packed) for kind in KINDS if kind != "hedgehog"
             for packed in ((False, True) if kind in ("gated_deltanet", "kda", "mamba2") else (False,))]
    for kind, packed in triton_interpreter.share(cases):
        start = time.perf_counter()
        worst = check(kind, packed)
        print(f"{kind}{' packed' if packed else ''}: worst {worst:.1e} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    triton_interpreter.report_passed(len(cases))


@needs_triton
def test_fused_glue_equals_the_reference_glue_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


if __name__ == "__main__":
    main()
