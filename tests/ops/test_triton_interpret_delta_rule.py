"""Our Triton kernels for the gated delta rule (backend "triton") on the CPU, under Triton's
interpreter (TRITON_INTERPRET=1), against the reference: the ``check`` of
tests/ops/test_triton_delta_rule.py on small shapes in fp32, and in bf16 and fp16 (the tensor-core
path's storage dtypes and casts), in a subprocess (the interpreter must be switched on before the
kernels are defined), every load and store checked to stay inside the launch's tensors; the
triangular inverse (_invert_kernel) alone against the inverse in fp64; when the state walks are
cut into segments; and the messages for what the backend refuses. Skipped where Triton does not
import. About 2 minutes on two cores, as two processes (triton_interpreter.run_sharded).

The interpreter runs each program as numpy code: it checks the algebra, indexing, masking and
varlen handling of the kernels, not GPU code generation, layouts or speed.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import triton_interpreter

pytest.importorskip("triton", reason="Triton is not installed")

from megatron_ext.kernels import gated_delta_rule  # noqa: E402
from megatron_ext.kernels.selfcheck import delta_rule_inputs  # noqa: E402

OPS_TESTS = pathlib.Path(__file__).parent  # test_triton_delta_rule.py, the GPU test of the kernels
TESTS = pathlib.Path(__file__).parents[1]  # triton_interpreter.py

# Keyword arguments of check(): all four forms with grouped heads (Hk = 1, Hv = 2) across a chunk
# boundary, three v heads to a q/k head (a group's middle member reads and writes partial sums),
# K != V both ways (K = 64 is several blocks of key channels, with a decay per channel and per
# head), one token, Hk = Hv, packed sequences (one empty), strong decay, the write residual, an
# erase gate next to beta, fp16, bf16 without a decay and with a per-channel one (the forms whose
# bf16 backward failed on an H200), and bf16 at K = V = 128 with one decay per head (the
# benchmark's form: several blocks of V in _bwd_scores and in the sequential kernels, BV = 64 in
# _bwd_state); and state walks cut into segments of 2 chunks (packed sequences, one empty, with
# initial states; the write residual's gradient; bf16).
SMALL = dict(key_heads=1, value_heads=2, key_dim=16, value_dim=32)
CASES = [
    *(dict(case=case, seq_len=70, **SMALL) for case in ("deltanet", "gated_deltanet", "kda", "gdn2")),
    dict(SMALL, case="kda", seq_len=64, key_dim=64, value_dim=16),
    dict(SMALL, case="gated_deltanet", seq_len=70, key_dim=64, value_dim=16),
    dict(SMALL, case="gdn2", seq_len=1),
    dict(SMALL, case="gated_deltanet", seq_len=65, value_heads=1),
    dict(SMALL, case="kda", seq_len=40, value_heads=3),
    dict(SMALL, case="kda", cu_seqlens=[0, 37, 64, 64, 130]),
    dict(SMALL, case="gated_deltanet", cu_seqlens=[0, 5, 70]),
    dict(SMALL, case="gated_deltanet", seq_len=70, strong_decay=True),
    dict(SMALL, case="gdn2", seq_len=70, strong_decay=True),
    dict(SMALL, case="gdn2", seq_len=40, residual=True),
    dict(SMALL, case="kda", seq_len=40, erase_with_beta=True),
    dict(SMALL, case="kda", seq_len=40, dtype="float16"),
    *(dict(SMALL, case=case, seq_len=70, dtype="bfloat16") for case in ("deltanet", "kda")),
    dict(SMALL, case="gated_deltanet", seq_len=70, key_dim=128, value_dim=128, dtype="bfloat16"),
    dict(SMALL, case="kda", cu_seqlens=[0, 37, 64, 64, 600], segment_chunks=2),
    dict(SMALL, case="gdn2", seq_len=530, residual=True, segment_chunks=2),
    dict(SMALL, case="gated_deltanet", seq_len=540, dtype="bfloat16", segment_chunks=2),
]

# The interpreter set up as for the other interpreter tests (tests/triton_interpreter.py: one
# CPU thread, its fix for NumPy >= 2.4, every load and store checked to stay inside the launch's
# tensors) and with bf16 dot operands widened to fp32 first (the interpreter keeps bf16 as raw
# 16-bit integers); as several processes, each checking its share of the cases.
_SCRIPT = """
import json, sys
import torch
sys.path[:0] = sys.argv[1:3]
import triton_interpreter
triton_interpreter.setup()
triton_interpreter.widen_bf16_dots()
from test_triton_delta_rule import check
checked = []
for number, kwargs in triton_interpreter.share(enumerate(json.loads(sys.argv[3]))):
    kwargs["dtype"] = getattr(torch, kwargs.pop("dtype", "float32"))
    checked.append({"number": number, "case": kwargs["case"], "errors": check(device="cpu", **kwargs)})
print(json.dumps(checked))
"""


def test_kernels_match_the_reference_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    outputs = triton_interpreter.run_sharded([sys.executable, "-c", _SCRIPT, str(OPS_TESTS), str(TESTS),
                                              json.dumps(CASES)], env, triton_interpreter.shard_count())
    # check() asserts the tolerances itself
    checked = sorted((c for output in outputs for c in json.loads(output.splitlines()[-1])),
                     key=lambda c: c["number"])
    assert [c["case"] for c in checked] == [case["case"] for case in CASES]
    assert all(c["errors"] for c in checked), checked


# _invert_kernel alone, in fp32, against the inverse in fp64: strictly lower A with entries of
# either sign and entries of T up to ~8, so that every step of the forward substitution on the four
# diagonal blocks and every block of the block substitution shows in T.
_INVERT_SCRIPT = """
import torch
from megatron_ext.kernels.delta_rule.triton import _invert_kernel
torch.manual_seed(0)
A = torch.tril(0.3 * torch.randn(3, 64, 64), -1).contiguous()
T = torch.empty_like(A)
_invert_kernel[(3,)](A, T)
expected = torch.linalg.inv(torch.eye(64, dtype=torch.float64) + A.double())
error = (T.double() - expected).abs().max().item()
assert error < 1e-5 * expected.abs().max().item(), error
"""


def test_invert_kernel_matches_the_inverse_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", _INVERT_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-5000:]


def test_unsupported_head_dims_and_devices_are_refused():
    inputs = {name: t.detach() for name, t in delta_rule_inputs("kda", key_dim=8, value_dim=12).items()}
    with pytest.raises(ValueError, match=r"backend 'triton' cannot run K = 8, V = 12: the Triton "
                                         r"kernels take head dims 16, 32, 64, 128, 256"):
        gated_delta_rule(**inputs, backend="triton")
    inputs = {name: t.detach() for name, t in delta_rule_inputs("kda", key_dim=16, value_dim=32).items()}
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run .* CUDA device, not 'cpu'"):
            gated_delta_rule(**inputs, backend="triton")
    if torch.cuda.is_available():
        cuda = {name: tensor.cuda() for name, tensor in inputs.items()}
        with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run inputs in torch.float64"):
            gated_delta_rule(**cuda, backend="triton")


def test_state_walks_are_segmented_where_whole_walks_would_leave_sms_idle():
    """_segment_chunks on a device of 128 SMs (the CPU stands for one): segments where the whole
    walks at the narrowest value tile (16) fill at most half the SMs and the longest sequence has
    four segments of 16 chunks, doubled while it keeps 16 segments; whole walks otherwise, and at
    K = 256."""
    from megatron_ext.kernels.delta_rule.triton import _segment_chunks

    cpu = torch.device("cpu")
    assert _segment_chunks(16, 64, 64, 64, cpu) == 16  # B = 1, Hv = 16 at T = 4096: 64 programs
    assert _segment_chunks(16, 64, 64, 63, cpu) == 0  # too short for four segments
    assert _segment_chunks(16, 64, 64, 255, cpu) == 16  # 16 segments
    assert _segment_chunks(16, 64, 64, 256, cpu) == 32  # T = 16384: 8 segments
    assert _segment_chunks(16, 64, 64, 512, cpu) == 64  # T = 32768: 8 segments
    assert _segment_chunks(32, 64, 64, 256, cpu) == 0  # B = 2: 128 programs at BV = 16
    assert _segment_chunks(8, 128, 128, 256, cpu) == 32  # 64 programs at BV = 16
    assert _segment_chunks(16, 256, 64, 256, cpu) == 0  # K = 256
