"""benchmarks/kernels.py on the CPU with grouped heads (``--key-heads``): the linear ops get q and
k with fewer heads than v, SDPA runs GQA, every op of the families is timed fwd and fwd+bwd, and
a key-head count that does not divide the heads is refused; --resume keeps the rows it finds,
each with its commit, and refuses a file of other settings."""

import json
import pathlib

import pytest

import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = ["--device", "cpu", "--seq-lens", "64", "--batch-tokens", "128", "--heads", "4",
         "--key-heads", "2", "--head-dim", "16", "--warmup", "1", "--reps", "1"]


@pytest.fixture(scope="module")
def benchmark():
    return harness.load_script(ROOT / "benchmarks" / "kernels.py", "kernels_benchmark")


def test_grouped_heads_reach_every_op(benchmark, tmp_path):
    ops = {op.name: op for op in benchmark.build_ops(benchmark.torch.device("cpu"), key_heads=2)}
    gdn = ops["gdn/chunked"].make_inputs(2, 64, 4, 16)
    assert gdn["q"].shape == gdn["k"].shape == (2, 64, 2, 16) and gdn["v"].shape == (2, 64, 4, 16)
    assert gdn["beta"].shape == gdn["g"].shape == (2, 64, 4)
    sdpa = ops["sdpa/torch"].make_inputs(2, 64, 4, 16)
    assert sdpa["q"].shape[1] == 4 and sdpa["k"].shape[1] == sdpa["v"].shape[1] == 2

    out = tmp_path / "kernels.json"
    benchmark.main(SMALL + ["--ops", "gdn/chunked,dplr/chunked,decay_channel/chunked,sdpa", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["settings"]["key_heads"] == 2
    rows = {row["op"]: row for row in record["results"]}
    assert sorted(rows) == ["decay_channel/chunked", "dplr/chunked", "gdn/chunked", "sdpa/torch"]
    for row in rows.values():
        assert row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0, row


def test_key_heads_must_divide_the_heads(benchmark):
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--device", "cpu", "--heads", "4", "--key-heads", "3"])


def test_resume_keeps_rows_and_their_commits(benchmark, tmp_path):
    out = tmp_path / "kernels.json"
    benchmark.main(SMALL + ["--ops", "sdpa", "--out", str(out), "--commit", "aaa1111"])
    benchmark.main(SMALL + ["--ops", "sdpa,gdn/chunked", "--out", str(out), "--resume", "--commit", "bbb2222"])
    record = json.loads(out.read_text())
    assert {row["op"]: row["commit"] for row in record["results"]} == {"sdpa/torch": "aaa1111",
                                                                       "gdn/chunked": "bbb2222"}
    assert record["commit"] == "bbb2222" and record["settings"]["ops"] == "sdpa"
    assert [run["ops"] for run in record["resumed"]] == ["sdpa,gdn/chunked"]
    with pytest.raises(SystemExit, match="--resume"):  # another head dim than the file's rows
        benchmark.main(SMALL + ["--head-dim", "32", "--ops", "sdpa", "--out", str(out), "--resume"])
