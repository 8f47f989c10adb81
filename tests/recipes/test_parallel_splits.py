"""benchmarks/parallel_splits.py without GPUs: splits parse to the right TP / PP / CP / DP and bad
ones are refused before anything launches; each split's command goes through the CLI and
Megatron's own argument parser and validator (as ``megatron-ext pretrain`` runs them) with the
sizes asked for; a run (fake commands printing Megatron's log lines) is summarised, and a failed
split is recorded while the next one still runs."""

import json
import pathlib
import sys

import pytest

import harness
from megatron_ext import cli
from megatron_ext.launch import presets
from megatron_ext.pretrain import megatron_argv

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return harness.load_script(ROOT / "benchmarks" / "parallel_splits.py", "parallel_splits")


@pytest.mark.parametrize("text, gpus, sizes", [
    ("dp2", 2, (1, 1, 1, 2, None)),
    ("tp2", 2, (2, 1, 1, 1, None)),
    ("pp2", 2, (1, 2, 1, 1, None)),
    ("cp2", 2, (1, 1, 2, 1, "state_passing")),
    ("cp2:all_to_all", 2, (1, 1, 2, 1, "all_to_all")),
    ("tp2", 4, (2, 1, 1, 2, None)),
    ("pp2dp2", 4, (1, 2, 1, 2, None)),
    ("tp2cp2", 4, (2, 1, 2, 1, "state_passing")),
])
def test_split_sizes(bench, text, gpus, sizes):
    split = bench.parse_split(text, gpus)
    assert (split.tp, split.pp, split.cp, split.dp, split.cp_method) == sizes


@pytest.mark.parametrize("text, message", [
    ("tp3", "does not divide --gpus 2"),
    ("tp2dp2", "DP is the GPUs left, 2 / 2 = 1, not 2"),
    ("tp2tp2", "at most once"),
    ("tp0", "write sizes like"),
    ("ep2", "write sizes like"),
    ("tp2:all_to_all", "needs cp > 1"),
    ("cp2:ring", "is one of"),
])
def test_bad_splits_are_refused(bench, text, message):
    with pytest.raises(ValueError, match=message):
        bench.parse_split(text, 2)


def test_splits_the_preset_or_batch_cannot_take_are_refused(bench):
    settings = presets.load_settings("hybrid-350m")  # 20 layers, 16 heads, 4 query groups
    with pytest.raises(ValueError, match="not a multiple of DP \\* micro-batch = 2 \\* 3"):
        bench.check_split(bench.parse_split("dp2", 2), settings, 8, 3)
    with pytest.raises(ValueError, match="20 layers do not split over PP = 3"):
        bench.check_split(bench.parse_split("pp3", 3), settings, 8, 1)
    with pytest.raises(ValueError, match="query groups do not split over TP = 8"):
        bench.check_split(bench.parse_split("tp8", 8), settings, 8, 1)


def test_bad_split_stops_before_any_launch(bench, tmp_path, capsys):
    out = tmp_path / "splits.json"
    with pytest.raises(SystemExit):
        bench.main(["--gpus", "2", "--splits", "dp2,tp3", "--out", str(out)])
    assert "TP * PP * CP = 3 does not divide --gpus 2" in capsys.readouterr().err
    assert not out.exists()


def _megatron_args(command, monkeypatch, world_size):
    """What Megatron parses from a split's command in ``megatron-ext pretrain``: the CLI's
    arguments, the preset's flags, then the split's (without Megatron's global side effects)."""
    import megatron.training.arguments as arguments
    from megatron.training.arguments import parse_args, validate_args

    from megatron_ext.config import add_megatron_args

    cli_args = cli.build_parser().parse_args(command[command.index("megatron_ext.cli") + 1:])
    extra = cli_args.megatron_args[1:]
    assert cli_args.megatron_args[0] == "--" and cli_args.mock_data
    argv = megatron_argv(cli._settings(cli_args), cli_args.run_dir, mock_data=True) + extra
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # Hopper, no CUDA here
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # pretrain sets it
    monkeypatch.setattr("sys.argv", ["pretrain", *argv])
    args = parse_args(add_megatron_args)
    validate_args(args, {})
    return args


@pytest.mark.parametrize("text, gpus", [
    ("dp2", 2), ("tp2", 2), ("pp2", 2), ("cp2", 2), ("cp2:all_to_all", 2), ("tp2cp2", 4),
    ("pp2dp2", 4),
])
def test_megatron_takes_each_split_as_asked(bench, text, gpus, monkeypatch, tmp_path):
    split = bench.parse_split(text, gpus)
    command = bench.split_command(split, preset="hybrid-350m", steps=30, run_dir=str(tmp_path),
                                  global_batch=8, micro_batch=1, extra=["--seed", "7"])
    assert command[:4] == ["env", "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                           "NVSHMEM_DISABLE_NVLS=1"]
    assert command[5:11] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(gpus), "-m"]
    args = _megatron_args(command, monkeypatch, gpus)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.data_parallel_size) == (
        split.tp, split.pp, split.cp, split.dp)
    assert args.sequence_parallel == (split.tp > 1)
    assert args.ext_context_parallel_method == (split.cp_method or "state_passing")
    assert (args.global_batch_size, args.micro_batch_size, args.train_iters) == (8, 1, 30)
    assert args.global_batch_size // (args.micro_batch_size * args.data_parallel_size) == 8 // split.dp
    assert args.eval_iters == 0 and args.log_interval == 1 and args.log_memory_interval == 30
    assert not args.save and args.load == str(tmp_path / "checkpoints")  # nothing saved or resumed
    assert args.seed == 7 and args.mock_data
    assert args.cuda_graph_impl == "none"  # eager in every split (the graph refuses PP and CP)


def _fake(lines, returncode=0):
    """A command printing ``lines`` and exiting with ``returncode``."""
    return [sys.executable, "-c",
            f"import sys; print({chr(10).join(lines)!r}); sys.exit({returncode})"]


def _iteration(i, ms):
    return (f" [2026-01-01 00:00:00.000000] iteration {i:8d}/{30:8d} | consumed samples: "
            f"{8 * i:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
            f"(TFLOP/s/GPU): 50.0 | learning rate: 3.0E-04 | global batch size:     8 | "
            f"lm loss: 1.000000E+01 | loss scale: 1.0 |")


MEMORY = ("[Rank {}] (after 2 iterations) memory (MB) | allocated: 900.00 | max allocated: {:.2f}"
          " | reserved: 2000.00 | max reserved: 2000.00")


def test_a_run_is_summarised_from_megatron_log_lines(bench, tmp_path):
    lines = [_iteration(1, 5000.0), _iteration(2, 300.0), MEMORY.format(0, 1500),
             MEMORY.format(1, 2048), _iteration(3, 100.0), _iteration(4, 110.0),
             _iteration(5, 120.0)]
    split = bench.parse_split("pp2", 2)
    result = bench.run_split(split, _fake(lines), tmp_path / "pp2.log", timeout_s=60,
                             run_dir=str(tmp_path / "run"))
    assert result["returncode"] == 0 and "log_tail" not in result
    assert result["peak_allocated_mib"] == 2048.0  # the largest over the ranks' reports
    summary = bench.summarize(result["records"], warmup=2, gpus=2, tokens_per_iteration=8 * 4096,
                              flops_per_token=2e9, peak_tflops=989.0)
    assert summary["timed_iterations"] == 3 and summary["median_ms_per_iteration"] == 110.0
    tokens_per_s = 8 * 4096 / 0.110
    assert summary["tokens_per_s"] == round(tokens_per_s)
    assert summary["tokens_per_s_per_gpu"] == round(tokens_per_s / 2)
    assert summary["model_tflops_per_gpu"] == round(2e9 * tokens_per_s / 2 / 1e12, 1)
    assert summary["mfu"] == round(2e9 * tokens_per_s / 2 / 1e12 / 989.0, 4)
    assert summary["megatron_tflops_per_gpu"] == 50.0 and summary["final_loss"] == 10.0


def test_ranks_left_running_by_a_split_are_killed(bench, tmp_path):
    """A split whose launcher exits leaving a "rank" running under setsid (as
    torchrun's are, out of reach of coreutils' timeout) with the split's run directory in its
    command line: run_split kills it and records its PID."""
    import os
    import time

    run_dir = str(tmp_path / "parallel_splits_x")
    rank = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
            f"'import time; time.sleep(600)', '--run-dir', {run_dir!r}], start_new_session=True);"
            f" print('rank', p.pid)")
    result = bench.run_split(bench.parse_split("dp2", 2), [sys.executable, "-c", rank],
                             tmp_path / "dp2.log", timeout_s=60, run_dir=run_dir)
    pid = int((tmp_path / "dp2.log").read_text().split()[-1])
    assert result["killed_leftovers"] == [pid]
    for _ in range(100):  # reaped by init once killed
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"process {pid} still runs")


def test_a_failed_split_is_recorded_and_the_next_still_runs(bench, tmp_path, monkeypatch, capsys):
    good = [_iteration(i, 100.0 + i) for i in range(1, 9)] + [MEMORY.format(0, 4096)]
    fast = [_iteration(i, 50.0) for i in range(1, 9)]
    bad = ["Traceback (most recent call last):", "RuntimeError: NCCL error"]
    fakes = {"dp2": _fake(good), "tp2": _fake(bad, 1), "pp2": _fake(fast)}
    monkeypatch.setattr(bench, "split_command", lambda split, **_: fakes[split.name])
    out = tmp_path / "splits.json"
    assert bench.main(["--gpus", "2", "--splits", "dp2,tp2,pp2", "--steps", "8", "--warmup", "2",
                       "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    dp, tp, pp = report["splits"]
    assert dp["returncode"] == 0 and dp["median_ms_per_iteration"] == 105.5
    assert dp["peak_allocated_mib"] == 4096.0
    assert tp["returncode"] == 1 and tp["log_tail"] == bad and "tokens_per_s" not in tp
    assert pp["returncode"] == 0 and pp["tokens_per_s"] > dp["tokens_per_s"]
    assert (tmp_path / "splits_tp2.log").read_text().splitlines() == bad
    table = capsys.readouterr().out
    assert "(no timed iterations)" in table and f"{105.5 / 50.0:.2f}x" in table
