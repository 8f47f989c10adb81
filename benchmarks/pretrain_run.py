"""A preset through ``megatron-ext pretrain`` on this machine's GPUs: stopped by SIGUSR1 part way
(as Slurm warns a job before its time limit), resumed from its checkpoint, run to the end.

Records, from Megatron's own log lines, every logged iteration's loss and time per iteration,
then tokens/s and model FLOP utilisation (MFU), and whether the run stopped with the preemption
exit status and resumed where it stopped. Output: ``--out`` (JSON) and the two logs next to it.

MFU counts the model's FLOPs per token by ``megatron_ext.launch.presets.model_flops_per_token``
(its docstring states the count), divided by the GPU's dense bf16 peak (``--peak-tflops``, 989 for
an H100/H200 SXM).

    python benchmarks/pretrain_run.py --preset hybrid-350m --steps 300 --stop-at 150 \\
        --out benchmarks/results/pretrain_run_h200.json -- --global-batch-size 8
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.launch.presets import load_settings, model_flops_per_token, parameter_count
from megatron_ext.train import PREEMPTED_EXIT_CODE

ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+)")
FIELDS = {
    "ms_per_iteration": re.compile(r"elapsed time per iteration \(ms\): ([\d.]+)"),
    "loss": re.compile(r"lm loss: ([\d.E+-]+)"),
    "megatron_tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)"),
    "global_batch_size": re.compile(r"global batch size:\s+(\d+)"),
}
MEMORY = re.compile(r"max allocated: ([\d.]+)")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def run_phase(command: list[str], log_path: pathlib.Path, stop_at: int | None,
              on_exit=None) -> dict:
    """Run ``command``, tee its output to log_path, parse Megatron's iteration lines; with
    stop_at, send SIGUSR1 once an iteration >= stop_at is logged. ``on_exit()``, if given, runs
    as soon as ``command`` exits, while its output may still be open: processes it left
    running hold that pipe, and the phase ends when they close it (e.g. killed by on_exit)."""
    records, peak_mib, signalled = [], None, None
    start = time.time()
    with open(log_path, "w") as out:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        watcher = None
        if on_exit is not None:
            watcher = threading.Thread(target=lambda: (process.wait(), on_exit()), daemon=True)
            watcher.start()
        for line in process.stdout:
            out.write(line)
            match = ITERATION.search(line)
            if match and "elapsed time per iteration" in line:
                record = {"iteration": int(match.group(1))}
                for name, pattern in FIELDS.items():
                    found = pattern.search(line)
                    if found:
                        record[name] = float(found.group(1))
                records.append(record)
                log(f"iteration {record['iteration']}: loss {record.get('loss')}, "
                    f"{record.get('ms_per_iteration')} ms")
                if stop_at is not None and signalled is None and record["iteration"] >= stop_at:
                    process.send_signal(signal.SIGUSR1)
                    signalled = record["iteration"]
                    log(f"sent SIGUSR1 after iteration {signalled}")
            memory = MEMORY.search(line)
            if memory:
                peak_mib = max(peak_mib or 0.0, float(memory.group(1)))
        returncode = process.wait()
        if watcher is not None:
            watcher.join()
    return {"command": command, "returncode": returncode, "records": records,
            "signalled_after": signalled, "peak_allocated_mib": peak_mib,
            "wall_s": round(time.time() - start, 1), "log": log_path.name}


def add_megatron_flags(parser: argparse.ArgumentParser, where: str) -> None:
    """Megatron flags after ``--`` on this script's command line, for ``megatron-ext pretrain``
    (read them with :func:`megatron_flags`)."""
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER,
                        help=f"after --: extra Megatron flags for {where}")


def megatron_flags(args) -> list[str]:
    return args.megatron_args[1:] if args.megatron_args[:1] == ["--"] else args.megatron_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="hybrid-350m")
    parser.add_argument("--run-dir", default="runs/pretrain_run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--stop-at", type=int, default=150,
                        help="stop phase 1 at this iteration (see --stop-with)")
    parser.add_argument("--stop-with", choices=("signal", "exit-interval"), default="signal",
                        help="signal: SIGUSR1 once the iteration is logged (as Slurm warns a job); "
                             "exit-interval: Megatron's --exit-interval (as --exit-duration-in-mins)")
    parser.add_argument("--mock-data", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one GPU (H100/H200 SXM: 989)")
    parser.add_argument("--out", required=True)
    add_commit_argument(parser)
    add_megatron_flags(parser, "both phases")
    args = parser.parse_args(argv)
    extra = megatron_flags(args)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "megatron_ext.cli", "pretrain", "--preset", args.preset,
               "--run-dir", args.run_dir, "--steps", str(args.steps),
               *(["--mock-data"] if args.mock_data else []), "--", *extra]

    if args.stop_with == "signal":
        log(f"phase 1: {' '.join(command)} (SIGUSR1 after iteration {args.stop_at})")
        first = run_phase(command, out.with_name(out.stem + "_phase1.log"), args.stop_at)
    else:
        stopping = command + ["--exit-interval", str(args.stop_at)]
        log(f"phase 1: {' '.join(stopping)}")
        first = run_phase(stopping, out.with_name(out.stem + "_phase1.log"), None)
    log(f"phase 1 exited {first['returncode']} (preempted = {PREEMPTED_EXIT_CODE})")
    second = None
    if first["returncode"] == PREEMPTED_EXIT_CODE:
        log("phase 2: the same command, resuming")
        second = run_phase(command, out.with_name(out.stem + "_phase2.log"), None)
        log(f"phase 2 exited {second['returncode']}")

    settings = load_settings(args.preset)
    records = first["records"] + (second["records"] if second else [])
    timed = [r for r in records[1:] if "ms_per_iteration" in r]  # the first includes warm-up
    summary = {"preset": args.preset, "parameters": parameter_count(args.preset),
               "seq_length": settings.model.seq_length, "pattern": settings.ext.pattern}
    if timed:
        batch = timed[-1].get("global_batch_size", settings.train.global_batch_size)
        ms = statistics.median(r["ms_per_iteration"] for r in timed)
        tokens_per_s = batch * settings.model.seq_length / (ms / 1e3)
        flops = model_flops_per_token(settings)
        summary.update(global_batch_size=batch, median_ms_per_iteration=ms,
                       tokens_per_s=round(tokens_per_s), model_flops_per_token=flops,
                       model_tflops_per_gpu=round(flops * tokens_per_s / 1e12, 1),
                       mfu=round(flops * tokens_per_s / (args.peak_tflops * 1e12), 4),
                       megatron_reported_tflops_median=statistics.median(
                           r["megatron_tflops"] for r in timed if "megatron_tflops" in r)
                       if any("megatron_tflops" in r for r in timed) else None)
    if second and first["records"] and second["records"]:
        summary["stopped_after_iteration"] = first["records"][-1]["iteration"]
        summary["resumed_at_iteration"] = second["records"][0]["iteration"]
    summary["stopped_with"] = args.stop_with
    result = {"environment": stamp(args.commit), "summary": summary, "phases": [first, second],
              "peak_tflops": args.peak_tflops}
    out.write_text(json.dumps(result, indent=1))
    log(f"summary: {json.dumps(summary)}")
    ok = first["returncode"] == PREEMPTED_EXIT_CODE and second and second["returncode"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
