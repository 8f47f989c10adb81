"""benchmarks/sparse_attention.py on the CPU: the flash and fla ops are skipped with the reason,
--resume measures only the missing (op, T) rows, and the check before an fla op's timing passes a
kernel with fla-core's documented semantics (fla-core 0.6.0's parallel_attn, written out densely
here: fla-core itself needs CUDA) and keeps a wrong one from being timed; and
benchmarks/dsa_stages.py on the CPU."""

import json
import pathlib
import sys
import types

import pytest
import torch

import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The docstring's CPU shapes.
SMALL = ["--device", "cpu", "--batch-tokens", "512", "--heads", "2", "--head-dim", "16",
         "--window", "32", "--moba-block", "32", "--moba-top-k", "2", "--nsa", "8,4,16,3,32",
         "--dsa", "16,2,8", "--hca", "16,32", "--csa", "4,8,32,2,8", "--warmup", "1", "--reps", "1"]


@pytest.fixture(scope="module")
def benchmark():
    return harness.load_script(ROOT / "benchmarks" / "sparse_attention.py",
                               "sparse_attention_benchmark")


def test_fla_skipped_on_cpu_and_resume_measures_only_the_missing_rows(benchmark, tmp_path):
    out = tmp_path / "sparse.json"
    benchmark.main(SMALL + ["--seq-lens", "128", "--ops", "swa_sink,sdpa", "--out", str(out)])
    first = json.loads(out.read_text())["results"]
    assert [r["op"] for r in first] == ["swa_sink/flex", "swa_sink/gathered", "swa_sink/flash",
                                        "swa_sink/fla", "sdpa/torch"]
    flash, fla = first[2:4]
    assert "fwd_ms" not in flash and "CUDA only" in flash["fwd_error"]
    assert "fwd_ms" not in fla and "fla-core" in fla["fwd_error"] and "fla-core" in fla["fwd_bwd_error"]

    benchmark.main(SMALL + ["--seq-lens", "128,256", "--ops", "swa_sink/gathered,sdpa", "--out", str(out),
                            "--resume"])
    second = json.loads(out.read_text())["results"]
    assert second[:5] == first  # kept as they were, not measured again
    assert [(r["op"], r["seq_len"]) for r in second[5:]] == [("swa_sink/gathered", 256), ("sdpa/torch", 256)]
    assert all(r["fwd_bwd_ms"] > 0 for r in second[5:])


def test_grouped_key_value_heads_reach_every_op(benchmark, tmp_path):
    """--kv-heads gives k and v (and the compressors' inputs) fewer heads than q, for every
    family on the gathered path (FoX skipped there) and for SDPA (enable_gqa); a count that
    does not divide the query heads is refused."""
    out = tmp_path / "grouped.json"
    grouped = SMALL + ["--seq-lens", "128", "--heads", "4"]
    benchmark.main(grouped + ["--kv-heads", "2", "--ops", "gathered,sdpa", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["settings"]["kv_heads"] == 2
    rows = record["results"]
    assert [r["op"] for r in rows] == [f"{family}/gathered" for family in benchmark.INPUTS] + ["sdpa/torch"]
    timed = [r for r in rows if r["op"] != "fox/gathered"]  # forget gates run on flex only
    assert all(r["fwd_bwd_ms"] > 0 for r in timed), [r for r in timed if "fwd_bwd_ms" not in r]
    assert "forget gates" in json.dumps(next(r for r in rows if r["op"] == "fox/gathered"))
    inputs = benchmark.make_inputs(benchmark.parse_args(grouped + ["--kv-heads", "2"]), "nsa",
                                   1, 64, 4, 16)
    assert inputs["q"].shape[2] == 4 and inputs["k"].shape[2] == inputs["v"].shape[2] == 2
    assert inputs["k_weights"].shape[0] == 2
    with pytest.raises(SystemExit):
        benchmark.parse_args(grouped + ["--kv-heads", "3"])


def documented_parallel_attn(q, k, v, g=None, scale=None, window_size=None, cu_seqlens=None,
                             chunk_indices=None, *, sink_bias=None, log2_sink=False):
    """fla.ops.attn.parallel_attn as its docstring defines it: q, k, v [B, T, H, D], scale
    D ** -0.5 by default, query i sees keys [i - window_size + 1, i] (all earlier with None),
    and exp(sink_bias[h]) joins each row's softmax denominator. ``log2_sink``: a wrong kernel,
    adding 2 ** sink_bias[h] instead (fla's kernels work in base 2)."""
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) * scale
    positions = torch.arange(q.shape[1])
    behind = positions[:, None] - positions[None, :]
    visible = (behind >= 0) & (behind < (window_size or q.shape[1]))
    scores = scores.masked_fill(~visible, float("-inf"))
    if sink_bias is not None:
        sink = sink_bias.float() * (torch.log(torch.tensor(2.0)) if log2_sink else 1)
        sink = sink[None, :, None, None].expand(*scores.shape[:3], 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhts,bshd->bthd", probs, v.float()).to(v.dtype)


@pytest.fixture
def fake_fla(benchmark, monkeypatch):
    """fla.ops.attn.parallel_attn as documented (``fake_fla.log2_sink = True``: a wrong one),
    with the benchmark's CUDA rule lifted so that its fla ops run on the CPU."""
    attn = types.ModuleType("fla.ops.attn")
    attn.log2_sink = False
    attn.parallel_attn = lambda *a, **kw: documented_parallel_attn(*a, **kw, log2_sink=attn.log2_sink)
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.attn", attn)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(benchmark, "fla_unavailable", lambda device: None)
    return attn


@pytest.mark.parametrize("family", ["swa_sink", "causal_sink"])
def test_fla_op_is_checked_then_timed(benchmark, fake_fla, family):
    args = benchmark.parse_args(SMALL + ["--seq-lens", "128"])
    [op] = benchmark.bench.select_ops(benchmark.build_ops(args), f"{family}/fla")
    row = benchmark.bench.measure(op, 128, args)
    check = row["check"]
    assert "failed" not in check and check["shape"] == [1, 64, 2, 16]
    assert set(check["relative_errors"]["fla"]) == {"out", "q", "k", "v", "sink"}
    assert max(check["relative_errors"]["fla"].values()) < 1e-2
    assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0


def test_a_wrong_fla_op_is_not_timed(benchmark, fake_fla):
    fake_fla.log2_sink = True
    args = benchmark.parse_args(SMALL + ["--seq-lens", "128"])
    [op] = benchmark.bench.select_ops(benchmark.build_ops(args), "swa_sink/fla")
    row = benchmark.bench.measure(op, 128, args)
    assert "sink" in row["check"]["failed"]
    assert "fwd_ms" not in row and "fwd_bwd_ms" not in row
    assert row["fwd_error"] == row["fwd_bwd_error"] and "check failed" in row["fwd_error"]


def test_slow_ops_are_timed_once_and_not_run_at_longer_lengths(benchmark, tmp_path):
    out = tmp_path / "slow.json"
    args = SMALL + ["--seq-lens", "128,256", "--ops", "swa_sink/gathered,sdpa", "--out", str(out)]
    benchmark.main(args + ["--warmup", "2", "--reps", "3", "--slow-call-s", "1e-9"])
    rows = {(r["op"], r["seq_len"]): r for r in json.loads(out.read_text())["results"]}
    for op in ("swa_sink/gathered", "sdpa/torch"):
        first, second = rows[op, 128], rows[op, 256]
        assert first["fwd_reps"] == first["fwd_bwd_reps"] == 1 and first["fwd_bwd_ms"] > 0
        assert "fwd_ms" not in second and second["fwd_error"].startswith("one call took")
        assert "at T = 128, over --slow-call-s 1e-09" in second["fwd_bwd_error"]

    benchmark.main(args + ["--warmup", "2", "--reps", "3"])  # the default, 10 s
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 4 and all(r["fwd_reps"] == r["fwd_bwd_reps"] == 3 for r in rows)


def test_dsa_stages_on_the_cpu(tmp_path):
    """benchmarks/dsa_stages.py with the docstring's CPU shapes: every stage timed at each T."""
    stages = harness.load_script(ROOT / "benchmarks" / "dsa_stages.py", "dsa_stages_benchmark")
    out = tmp_path / "stages.json"
    stages.main(["--device", "cpu", "--seq-lens", "64,128", "--batch-tokens", "256", "--heads",
                 "2", "--head-dim", "16", "--dsa", "16,2,8", "--reps", "1", "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    assert [(r["seq_len"], r["batch"]) for r in results] == [(64, 4), (128, 2)]
    names = ["select", "auto_attention_fwd", "auto_attention_fwd_bwd", "loss_fwd", "loss_fwd_bwd"]
    assert all(r[name] > 0 for r in results for name in names)


def test_summary_gives_the_back_to_back_ratio_where_both_rows_have_it(benchmark, capsys):
    record = {"results": [
        dict(op="sdpa/torch", seq_len=64, fwd_bwd_ms=10.0, fwd_bwd_back_to_back_ms=8.0),
        dict(op="moba/flash", seq_len=64, fwd_bwd_ms=6.0, fwd_bwd_back_to_back_ms=4.0,
             fwd_bwd_peak_gib=1.5),
        dict(op="moba/flex", seq_len=64, fwd_bwd_ms=7.0)]}
    benchmark.summary(record)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("moba/flash T=64: fwd+bwd 6.00 ms = 0.60x SDPA (back to back 4.00 ms "
                             "= 0.50x), peak 1.50 GiB")
    assert lines[1].endswith("moba/flex T=64: fwd+bwd 7.00 ms = 0.70x SDPA, peak nan GiB")
