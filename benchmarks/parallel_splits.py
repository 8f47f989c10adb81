"""Throughput of a preset under Megatron's training loop (``megatron-ext pretrain``, mock data) on
one host's GPUs: data parallel only versus tensor-, pipeline- and context-parallel splits.

Each split is one ``torchrun --standalone`` run of the same model on the same global batch (the
same tokens per iteration) for ``--steps`` iterations, in a fresh run directory with checkpoint
saving off (``--save ''``): no split resumes another's checkpoint and none writes one. A split
names its TP, PP and CP sizes; DP is the GPUs left, ``GPUs / (TP * PP * CP)``: ``dp2``, ``tp2``,
``pp2``, ``cp2`` (state passing), ``cp2:all_to_all``, ``tp2cp2``, ``pp2dp2``. TP splits add
``--sequence-parallel``. NVLink multicast is off in every launched process (:data:`MULTICAST_OFF`,
set by ``env`` in the command). Every split runs eagerly (``--cuda-graph-impl none``): the
presets' CUDA graph of an iteration is refused with pipeline or context parallelism, and the
splits are compared as they would all run.

Per split, from Megatron's log lines (``run_phase`` of ``benchmarks/pretrain_run.py``): the median
ms per iteration over the iterations after ``--warmup``, tokens/s in all and per GPU, model
TFLOP/s per GPU and MFU (``megatron_ext.launch.presets.model_flops_per_token``, against ``--peak-tflops``),
Megatron's own TFLOP/s figure, the peak allocated memory (the largest "max allocated" that any
rank reports: every rank of the first data-parallel replica prints it after iterations 1 and 2
and at the last one), the return code and the wall time. A split that fails or passes
``--split-timeout`` keeps its return code and its log's last lines, and the next split runs.
``--out`` (JSON) is rewritten after every split; each split's log lies next to it.

On 2 GPUs (about 5 minutes for the five default splits):

    python benchmarks/parallel_splits.py --gpus 2 --preset hybrid-350m --steps 30 \\
        --out benchmarks/results/parallel_splits_h200x2.json

(With the package laid out by ``benchmarks/gpu_setup.sh``, run it from /tmp, as the other
``megatron-ext pretrain`` runs: a ``megatron_ext`` folder in the working directory would shadow
the laid-out one.) Flags after ``--`` go to Megatron in every split.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import re
import shlex
import signal
import statistics
import sys
import tempfile
from typing import NamedTuple

from megatron_ext.config import CHOICES
from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.launch.presets import load_settings, model_flops_per_token

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
DEFAULT_SPLITS = {2: "dp2,tp2,pp2,cp2,cp2:all_to_all",
                  4: "dp4,tp2dp2,pp2dp2,cp2dp2,tp2cp2"}
SPLIT_PART = re.compile(r"(tp|pp|cp|dp)([1-9]\d*)")
LOG_TAIL = 30


def _pretrain_run():
    """benchmarks/pretrain_run.py, for run_phase, log and its Megatron flags (loaded by path:
    benchmarks/ is a folder of scripts, not a package)."""
    path = pathlib.Path(__file__).with_name("pretrain_run.py")
    spec = importlib.util.spec_from_file_location("pretrain_run", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pretrain_run = _pretrain_run()
log = pretrain_run.log


class Split(NamedTuple):
    name: str
    tp: int
    pp: int
    cp: int
    dp: int
    cp_method: str | None  # with cp > 1 only


def parse_split(text: str, gpus: int) -> Split:
    """``"tp2"``, ``"pp2dp2"``, ``"cp2:all_to_all"`` on ``gpus`` GPUs (DP: the GPUs left)."""
    layout, _, method = text.partition(":")
    parts = SPLIT_PART.findall(layout)
    if not parts or "".join(k + n for k, n in parts) != layout or len(
            {k for k, _ in parts}) != len(parts):
        raise ValueError(f"split {text!r}: write sizes like 'tp2', 'pp2dp2' or 'cp2:all_to_all' "
                         "(each of tp, pp, cp, dp at most once)")
    sizes = {k: int(n) for k, n in parts}
    tp, pp, cp = (sizes.get(k, 1) for k in ("tp", "pp", "cp"))
    if gpus % (tp * pp * cp):
        raise ValueError(f"split {text!r}: TP * PP * CP = {tp * pp * cp} does not divide "
                         f"--gpus {gpus}")
    dp = gpus // (tp * pp * cp)
    if sizes.get("dp", dp) != dp:
        raise ValueError(f"split {text!r}: DP is the GPUs left, {gpus} / {tp * pp * cp} = {dp}, "
                         f"not {sizes['dp']}")
    if method and cp == 1:
        raise ValueError(f"split {text!r}: a context-parallel method needs cp > 1")
    methods = CHOICES["context_parallel_method"]
    if method and method not in methods:
        raise ValueError(f"split {text!r}: the context-parallel method is one of {list(methods)}")
    return Split(text, tp, pp, cp, dp, (method or methods[0]) if cp > 1 else None)


def check_split(split: Split, settings, global_batch: int, micro_batch: int) -> None:
    """ValueError, before anything launches, for a split this preset and batch cannot take."""
    m = settings.model
    problems = [
        (global_batch % (split.dp * micro_batch),
         f"global batch {global_batch} is not a multiple of DP * micro-batch = "
         f"{split.dp} * {micro_batch}"),
        (m.num_layers % split.pp, f"{m.num_layers} layers do not split over PP = {split.pp}"),
        (m.num_attention_heads % split.tp or (m.num_query_groups or 0) % split.tp,
         f"{m.num_attention_heads} heads / {m.num_query_groups} query groups do not split over "
         f"TP = {split.tp}"),
        (m.seq_length % (2 * split.cp),
         f"sequence length {m.seq_length} is not a multiple of 2 * CP = {2 * split.cp}"),
    ]
    for failed, message in problems:
        if failed:
            raise ValueError(f"split {split.name!r}: {message}")


def split_command(split: Split, *, preset: str, steps: int, run_dir: str, global_batch: int,
                  micro_batch: int, extra: list[str]) -> list[str]:
    """The torchrun command of one split, NVLink multicast off in its environment."""
    flags = ["--tensor-model-parallel-size", split.tp, "--pipeline-model-parallel-size", split.pp,
             "--context-parallel-size", split.cp]
    if split.tp > 1:
        flags.append("--sequence-parallel")
    if split.cp_method:
        flags += ["--ext-context-parallel-method", split.cp_method]
    flags += ["--global-batch-size", global_batch, "--micro-batch-size", micro_batch,
              "--log-interval", 1, "--log-memory-interval", steps, "--eval-iters", 0,
              "--save", "", "--cuda-graph-impl", "none"]
    return ["env", *(f"{k}={v}" for k, v in MULTICAST_OFF.items()),
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(split.tp * split.pp * split.cp * split.dp), "-m", "megatron_ext.cli", "pretrain",
            "--preset", preset, "--mock-data", "--run-dir", run_dir, "--steps", str(steps), "--",
            *map(str, flags), *extra]


def summarize(records: list[dict], *, warmup: int, gpus: int, tokens_per_iteration: int,
              flops_per_token: float, peak_tflops: float) -> dict:
    """Throughput over the logged iterations after the first ``warmup``; {} if there are none."""
    timed = [r for r in records if r["iteration"] > warmup and "ms_per_iteration" in r]
    if not timed:
        return {}
    ms = statistics.median(r["ms_per_iteration"] for r in timed)
    tokens_per_s = tokens_per_iteration / (ms / 1e3)
    tflops_per_gpu = flops_per_token * tokens_per_s / gpus / 1e12
    reported = [r["megatron_tflops"] for r in timed if "megatron_tflops" in r]
    return {"timed_iterations": len(timed), "median_ms_per_iteration": ms,
            "tokens_per_s": round(tokens_per_s), "tokens_per_s_per_gpu": round(tokens_per_s / gpus),
            "model_tflops_per_gpu": round(tflops_per_gpu, 1),
            "mfu": round(tflops_per_gpu / peak_tflops, 4),
            "megatron_tflops_per_gpu": statistics.median(reported) if reported else None,
            "final_loss": timed[-1].get("loss")}


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL every other process whose command line holds ``marker`` (a split's own run
    directory); their PIDs. torchrun starts its ranks with setsid (process groups of their own), out
    of reach of coreutils' timeout, which signals its command's process group: when a timeout killed
    torchrun, ranks stuck in a collective kept running on the GPUs, orphaned, into the next
    split and the next command (seen on 2 H200s)."""
    killed = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command_line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            if marker in command_line:
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return killed


def run_split(split: Split, command: list[str], log_path: pathlib.Path, timeout_s: int,
              run_dir: str) -> dict:
    """Run one split under coreutils' timeout (status 124, or 137 after SIGKILL, when it ran
    out of time); once its launcher has exited, kill what is left of it
    (:func:`kill_leftovers`: ranks left running would also keep its output open, and this
    call waiting)."""
    limited = ["timeout", "--kill-after", "30", str(timeout_s), *command]
    killed = []
    phase = pretrain_run.run_phase(limited, log_path, None,
                                   on_exit=lambda: killed.extend(kill_leftovers(run_dir)))
    result = {**split._asdict(), "command": shlex.join(command),
              "returncode": phase["returncode"], "timed_out": phase["returncode"] in (124, 137),
              "wall_s": phase["wall_s"], "log": phase["log"],
              "peak_allocated_mib": phase["peak_allocated_mib"], "records": phase["records"],
              "killed_leftovers": killed}
    if phase["returncode"] != 0:
        result["log_tail"] = log_path.read_text(errors="replace").splitlines()[-LOG_TAIL:]
    return result


def table(results: list[dict]) -> str:
    """One line per split; "vs dp": tokens/s over the DP-only split's."""
    base = next((r.get("tokens_per_s") for r in results
                 if r["tp"] == r["pp"] == r["cp"] == 1 and r.get("tokens_per_s")), None)
    lines = [f"{'split':<20} {'exit':>4} {'ms/iter':>9} {'tokens/s':>9} {'TFLOP/s/GPU':>11} "
             f"{'MFU':>6} {'peak GiB':>8} {'vs dp':>6}"]
    for r in results:
        if "tokens_per_s" not in r:
            lines.append(f"{r['name']:<20} {r['returncode']:>4}  (no timed iterations)")
            continue
        peak = f"{r['peak_allocated_mib'] / 1024:.1f}" if r["peak_allocated_mib"] else "-"
        versus = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(f"{r['name']:<20} {r['returncode']:>4} {r['median_ms_per_iteration']:>9.1f} "
                     f"{r['tokens_per_s']:>9} {r['model_tflops_per_gpu']:>11.1f} "
                     f"{r['mfu']:>6.1%} {peak:>8} {versus:>6}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, required=True, help="GPUs of this host to use")
    parser.add_argument("--preset", default="hybrid-350m")
    parser.add_argument("--splits", default=None,
                        help="comma-separated, e.g. dp2,tp2,pp2,cp2,cp2:all_to_all "
                             f"(default for 2 and 4 GPUs: {DEFAULT_SPLITS})")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5,
                        help="logged iterations left out of the median")
    parser.add_argument("--global-batch-size", type=int, default=8,
                        help="sequences per iteration, the same in every split")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one GPU (H100/H200 SXM: 989)")
    parser.add_argument("--split-timeout", type=int, default=180, help="seconds per split")
    parser.add_argument("--out", required=True)
    add_commit_argument(parser)
    pretrain_run.add_megatron_flags(parser, "every split")
    args = parser.parse_args(argv)
    extra = pretrain_run.megatron_flags(args)
    if args.splits is None and args.gpus not in DEFAULT_SPLITS:
        parser.error(f"--splits is needed for --gpus {args.gpus}")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no iteration after --warmup {args.warmup}")
    settings = load_settings(args.preset)
    try:
        splits = [parse_split(text, args.gpus)
                  for text in (args.splits or DEFAULT_SPLITS[args.gpus]).split(",")]
        for split in splits:
            check_split(split, settings, args.global_batch_size, args.micro_batch_size)
    except ValueError as e:
        parser.error(str(e))

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seq = settings.model.seq_length
    flops = model_flops_per_token(settings)
    report = {"preset": args.preset, "gpus": args.gpus, "steps": args.steps,
              "warmup": args.warmup, "global_batch_size": args.global_batch_size,
              "micro_batch_size": args.micro_batch_size, "seq_length": seq,
              "tokens_per_iteration": args.global_batch_size * seq,
              "model_flops_per_token": flops, "peak_tflops": args.peak_tflops,
              "environment": stamp(args.commit), "nccl_environment": MULTICAST_OFF,
              "megatron_args": extra, "splits": []}
    for number, split in enumerate(splits, 1):
        with tempfile.TemporaryDirectory(prefix="parallel_splits_") as run_dir:
            command = split_command(split, preset=args.preset, steps=args.steps, run_dir=run_dir,
                                    global_batch=args.global_batch_size,
                                    micro_batch=args.micro_batch_size, extra=extra)
            log(f"split {number}/{len(splits)} {split.name} (TP {split.tp}, PP {split.pp}, "
                f"CP {split.cp}, DP {split.dp}): {shlex.join(command)}")
            log_path = out.with_name(f"{out.stem}_{split.name.replace(':', '_')}.log")
            result = run_split(split, command, log_path, args.split_timeout, run_dir)
        result.update(summarize(result["records"], warmup=args.warmup, gpus=args.gpus,
                                tokens_per_iteration=args.global_batch_size * seq,
                                flops_per_token=flops, peak_tflops=args.peak_tflops))
        report["splits"].append(result)
        out.write_text(json.dumps(report, indent=1))
        log(f"split {split.name}: exit {result['returncode']}, {result['wall_s']} s, "
            f"{result.get('median_ms_per_iteration')} ms/iteration, "
            f"{result.get('tokens_per_s')} tokens/s")
        if result["killed_leftovers"]:
            log(f"  killed {len(result['killed_leftovers'])} processes left running by the "
                f"split: {result['killed_leftovers']}")
        for line in result.get("log_tail", [])[-5:]:
            log(f"  {line}")
    print(table(report["splits"]), flush=True)
    log(f"wrote {out}")
    return 0 if all(r["returncode"] == 0 for r in report["splits"]) else 1


if __name__ == "__main__":
    sys.exit(main())
