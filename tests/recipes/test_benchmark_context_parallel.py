"""benchmarks/context_parallel.py runs under torchrun on two CPU processes (gloo), measures every
mixer and method it is asked for, and counts the bytes of softmax attention's K/V all-gather and
of MoBA's all-to-all (the sparse mixers' shared path) as megatron_ext/parallel/README.md's
formulas give them."""

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.dist


def test_context_parallel_benchmark_on_two_cpu_processes(tmp_path):
    out = tmp_path / "cp.json"
    seq_len, hidden, heads, groups = 128, 64, 4, 2
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(ROOT / "benchmarks" / "context_parallel.py"), "--device", "cpu",
               "--seq-lens", str(seq_len), "--hidden", str(hidden), "--heads", str(heads),
               "--groups", str(groups), "--moba-block", "32", "--moba-top-k", "2", "--warmup", "1",
               "--reps", "1", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["mixer"], r["method"]) for r in rows] == [
        ("G", "state_passing"), ("G", "all_to_all"), ("M", "state_passing"), ("M", "all_to_all"),
        ("*", "kv_all_gather"), ("B", "all_to_all")]
    assert all("error" not in r and r["fwd_bwd_ms"] > 0 and r["collectives"] > 0 for r in rows), rows
    attention, moba = rows[4], rows[5]
    head_dim, cp, fp32 = hidden // heads, 2, 4
    per_direction = (cp - 1) * 2 * seq_len * groups * head_dim * fp32 // cp  # README: KV all-gather
    assert attention["comm_bytes_per_rank"] == 2 * per_direction  # forward gather + backward reduce-scatter
    # README: Ulysses all-to-all of q, k, v and the output, each way (MoBA adds nothing to it)
    per_direction = (cp - 1) * (seq_len // cp) * (2 * heads + 2 * groups) * head_dim * fp32 // cp
    assert moba["comm_bytes_per_rank"] == 2 * per_direction
