"""The triton backend of dplr_delta_rule (kernels/dplr/triton.py) on Triton's CPU interpreter, and
the backend's refusals. Skipped where Triton is not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/ops/test_triton_dplr.py and runs its ``check_scores`` on ``SCORES_CASES`` (the Triton
op against the direct fp64 evaluation, forward and backward, strong decays and several K blocks
included) and its ``check_case`` on ``CASES`` (the whole op against the fp64 reference: odd T
across a chunk border, packed sequences with an empty one, grouped heads, initial and final
states, strong decays, every decay form, and bf16 q, k, v), with that module's tolerances, every
load and store checked to stay inside the tensors passed to its kernel
(triton_interpreter.py's bounds checker). The kernels only ever see fp32 (the chunked algorithm
upcasts), so bf16 runs here as on a GPU. ~30 s on one core.
"""
import os

import pytest
import torch

import triton_interpreter
from triton_interpreter import needs_triton


def scores_cases(ScoresCase) -> list:
    return [
        ScoresCase(),  # rows decayed by G', as A and B
        ScoresCase(before=False, strong=True),  # by G, as P; decays down to -20 per token
        ScoresCase(chunks=1, chunk_size=32, key_dim=128, strong=True),  # two K blocks
    ]


def cases(Case) -> list:
    """K = 16, V = 8, one q/k head serving two v heads unless said. The interpreter's time goes
    with the padded tokens the kernels see, so most cases take chunks of 32 tokens and T = 40
    (a chunk and 8 more); one takes the default 64 and T = 70."""
    small = dict(key_heads=1, value_heads=2, key_dim=16, value_dim=8)
    return [
        Case(batch=1, seq_len=70, strong=True, **small),  # chunks of 64, with an initial state
        Case(seq_len=40, chunk_size=32, **small),  # B = 2
        # packed: short, across a chunk border, empty, one token; one head
        Case(lengths=(3, 36, 0, 1), chunk_size=32, **dict(small, value_heads=1)),
        Case(batch=1, seq_len=40, dtype=torch.bfloat16, chunk_size=32, **small),
        Case("per_head", seq_len=37, initial_state=False, **small),  # PyTorch scores: no kernel runs
        Case("none", seq_len=37, **small),
    ]


def main() -> None:
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_triton_dplr")
    scores = scores_cases(checks.ScoresCase)
    whole = cases(checks.Case)
    triton_interpreter.run_cases(scores, checks.check_scores)
    triton_interpreter.run_cases(whole, checks.check_case)
    triton_interpreter.report_passed(len(scores) + len(whole))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


def _inputs(key_dim=16, dtype=torch.float32):
    from megatron_ext.kernels.selfcheck import dplr_inputs

    inputs = dplr_inputs("rwkv7", batch=1, seq_len=5, key_heads=1, value_heads=1, key_dim=key_dim)
    return {name: t.detach().to(dtype) for name, t in inputs.items()}


@needs_triton
def test_unsupported_key_dims_are_named():
    from megatron_ext.kernels import dplr_delta_rule

    for key_dim in (8, 48, 512):
        with pytest.raises(ValueError, match=rf"dplr_delta_rule: backend 'triton' cannot run K = {key_dim}: the "
                                             rf"Triton kernels take key dims 16, 32, 64, 128, 256"):
            dplr_delta_rule(**_inputs(key_dim), backend="triton")


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_refusals_name_the_reason():
    """What the backend cannot run it refuses with "<op>: backend 'triton' cannot run ...", which
    the self-check (``megatron-ext doctor``) reports as a skip, not a failure."""
    from megatron_ext.kernels import dplr_delta_rule, registry

    with pytest.raises(RuntimeError, match=r"dplr_delta_rule: backend 'triton' cannot run tensors on cpu"):
        dplr_delta_rule(**_inputs(), backend="triton")
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run inputs in torch.float64"):
        registry.choose("dplr_delta_rule", "triton", device="cuda", dtype=torch.float64)


@needs_triton
def test_chunk_sizes_are_checked(monkeypatch):
    from megatron_ext.kernels.dplr import triton as dplr_triton

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the registry's rule: CPU tensors need it
    with pytest.raises(ValueError, match=r"chunk_size = 48; the triton backend takes \(16, 32, 64, 128\)"):
        dplr_triton.dplr_delta_rule_triton(**_inputs(), chunk_size=48)


if __name__ == "__main__":
    main()
