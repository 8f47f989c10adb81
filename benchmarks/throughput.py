"""Training throughput in Megatron's own loop: ``megatron-ext pretrain --mock-data`` on one GPU.

For every preset, pattern and sequence length T, one run of ``--iterations`` iterations with
``--tokens-per-micro-batch`` tokens per micro-batch (micro-batch = that / T) and
``--tokens-per-iteration`` per iteration (global batch = that / T; gradient accumulation makes up
the rest). It records, per run:

- ``ms_per_iteration``: the median of Megatron's own "elapsed time per iteration" over the
  iterations after the first ``--warmup`` and before the two next to the profiled one (the
  profiler slows those); ``tokens_per_s`` from it;
- ``peak_gib``: Megatron's "max allocated" memory report;
- ``mfu``: model FLOPs per token (``megatron_ext.launch.presets.model_flops_per_token``, whose
  docstring states the count) x tokens/s / ``--peak-tflops``;
- ``megatron_tflops``, ``megatron_mfu``: the median of Megatron's own "throughput per GPU
  (TFLOP/s/GPU)" over the same iterations, and that / ``--peak-tflops``. Megatron's formula
  counts every layer as causal softmax attention (it is not told the pattern), so it applies to
  the all-``*`` rows only;
- ``breakdown``: the GPU time of the last iteration (profiled by Megatron's
  ``--profile --use-pytorch-profiler``) by kernel category (:func:`category`), in ms,
  ``idle`` = the timed iterations' median minus the GPU's busy time (time the GPU waits for
  the host), the number of kernels launched, the host threads' busy time
  (:func:`host_busy`), and the GPU time by category and origin (:func:`origins`: the code that
  launched each kernel; with the presets' CUDA graph that is the graph launch, so attribute an
  eager run: ``-- --cuda-graph-impl none --pytorch-profiler-collect-callstack``).

Output: ``--out`` (JSON, one row per run, stamped with the commit, GPU, torch and Triton) and a
plot of tokens/s against T per pattern next to it (``.png``); each run's log under ``--log-dir``
(not kept on main).

    python benchmarks/throughput.py --presets hybrid-350m --patterns preset,'*' \\
        --seq-lengths 4096,16384 --out benchmarks/results/throughput_h200.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time

from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.launch.presets import load_settings, model_flops_per_token, parameter_count

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+.*elapsed time per iteration \(ms\): ([\d.]+)")
LOSS = re.compile(r"lm loss: ([\d.E+-]+)")
MEMORY = re.compile(r"max allocated: ([\d.]+)")
TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([\d.]+)")
CATEGORIES = ("gemm", "attention", "linear_mixer", "mixer_glue", "elementwise_copy_reduce",
              "optimizer", "communication", "other")


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _triton_names(modules) -> tuple[str, ...]:
    import importlib

    import triton

    names = []
    for module in modules:
        for name, value in vars(importlib.import_module(module)).items():
            if isinstance(value, (triton.runtime.JITFunction, triton.runtime.Autotuner,
                                  triton.runtime.Heuristics)):
                names.append(name)
    return tuple(names)


def categoriser():
    """``category(kernel name) -> one of CATEGORIES`` for this tree's kernels: ``linear_mixer``
    the delta-rule and decay ops' Triton kernels (with their grouped heads' gradient sum),
    ``mixer_glue`` all of ``kernels/fused``'s (the
    mixers' short convolution and gated RMSNorm, and the layers' RMSNorm, RoPE and the loss's
    cross-entropy, which without them run as PyTorch's ``elementwise_copy_reduce`` kernels)."""
    mixer = _triton_names(["megatron_ext.kernels.delta_rule.triton",
                           "megatron_ext.kernels.decay.triton", "megatron_ext.kernels.group_sum"])
    glue = _triton_names(["megatron_ext.kernels.fused.triton"])

    def category(name: str) -> str:
        low = name.lower()
        if "nccl" in low:
            return "communication"
        if any(low.startswith(n.lower()) for n in glue):
            return "mixer_glue"
        if any(low.startswith(n.lower()) for n in mixer):
            return "linear_mixer"
        if any(k in low for k in ("flash", "fmha", "sdpa", "attention", "attn")):
            return "attention"
        if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")):
            return "gemm"
        if any(k in low for k in ("adam", "multi_tensor", "foreach", "l2norm")):
            return "optimizer"
        if any(k in low for k in ("elementwise", "reduce", "copy", "memcpy", "memset", "cat",
                                  "triton_poi", "triton_red", "triton_per", "index", "scatter",
                                  "gather", "softmax", "norm", "where", "fill")):
            return "elementwise_copy_reduce"
        return "other"

    return category


def _covered_ms(intervals) -> float:
    """The length of the union of ``(start, end)`` intervals (µs), in ms."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def host_busy(events) -> list[float]:
    """The host threads' busy ms in a trace, busiest first (the main thread, then autograd's
    backward thread): the union of each thread's operator and CUDA-runtime events, less the
    time spent waiting in CUDA synchronisations (``.item()``, loss checks). The profiler adds
    a little to every operator, so this is an upper bound of the unprofiled host time."""
    work: dict = {}
    waits: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cpu_op", "cuda_runtime", "cuda_driver"):
            continue
        span = (e["ts"], e["ts"] + e["dur"])
        work.setdefault(e.get("tid"), []).append(span)
        if "Synchronize" in e["name"]:
            waits.setdefault(e.get("tid"), []).append(span)
    busy = [_covered_ms(spans) - _covered_ms(waits.get(tid, ())) for tid, spans in work.items()]
    return sorted((round(ms, 2) for ms in busy), reverse=True)


def _code_roots() -> list[tuple[str, str]]:
    """(folder, the name it stands for) of megatron-ext's and Megatron's packages here, for the
    frames of an editable install, whose paths the profiler leaves absolute."""
    import megatron.core
    import megatron_ext
    import megatron_ext.kernels
    import megatron_ext.launch

    roots = [(pathlib.Path(megatron.core.__file__).parent, "megatron/core")]
    roots += [(pathlib.Path(m.__file__).parent, m.__name__.replace(".", "/"))
              for m in (megatron_ext.kernels, megatron_ext.launch, megatron_ext)]
    return [(str(folder) + "/", name + "/") for folder, name in roots]


def _our_frame(name: str, roots) -> str | None:
    """A profiler's Python frame ``path(line): function`` as ``megatron_ext/...`` or
    ``megatron/core/...``, or None for a frame of other code."""
    for folder, short in roots:
        if name.startswith(folder):
            return short + name[len(folder):]
    return name if name.startswith(("megatron_ext/", "megatron/core/")) else None


BACKWARD_NODE = "autograd::engine::evaluate_function: "


def origins(events, roots=None) -> dict[tuple[str, str], float]:
    """GPU ms of a Chrome trace's kernels by (category, origin): the innermost of the host events
    around the kernel's launch (the runtime call of the same ``correlation``, on its thread) that
    is a Python frame of megatron-ext or Megatron (traces profiled with the call stack) or an
    autograd node (``autograd::engine::evaluate_function: X``: ``X``); else the innermost
    operator; ``"(no launch found)"`` for a kernel without its launch in the trace. Host events
    of one thread nest, so one sweep per thread in time order finds them."""
    category = categoriser()
    roots = _code_roots() if roots is None else roots
    threads: dict = {}  # thread -> [(start, order, item)]
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            threads.setdefault(e.get("tid"), []).append((e["ts"], 1, e))
        elif e.get("cat") in ("cpu_op", "python_function"):  # outer events first at equal starts
            threads.setdefault(e.get("tid"), []).append((e["ts"], -e["dur"], e))
    launched_by: dict = {}  # correlation -> origin
    for items in threads.values():
        stack: list = []  # the host events around the current time, outermost first
        for start, _, e in sorted(items, key=lambda item: item[:2]):
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < start:
                stack.pop()
            if e.get("cat") != "cuda_runtime":
                stack.append(e)
                continue
            origin = None
            for outer in reversed(stack):
                if outer["cat"] == "python_function":
                    origin = _our_frame(outer["name"], roots)
                elif outer["name"].startswith(BACKWARD_NODE):
                    origin = outer["name"][len(BACKWARD_NODE):]
                if origin:
                    break
            if origin is None:
                ops = [outer["name"] for outer in stack if outer["cat"] == "cpu_op"]
                origin = ops[-1] if ops else e["name"]
            launched_by[e["args"]["correlation"]] = origin
    totals: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            key = (category(e["name"]), launched_by.get(e.get("args", {}).get("correlation"),
                                                        "(no launch found)"))
            totals[key] = totals.get(key, 0.0) + e["dur"] / 1e3
    return totals


def breakdown(trace_path: pathlib.Path, ms_per_iteration: float) -> dict:
    """GPU ms per category in the profiled iteration of a Chrome trace, the GPU's busy time,
    ``idle``: the (unprofiled) iteration time minus the busy time, the time the GPU waits,
    ``kernels``: the number of GPU kernels and copies launched, ``host_busy``
    (:func:`host_busy`), ``top_kernels`` (the 25 largest by name) and ``by_origin`` (the 40
    largest ``"category | origin"`` of :func:`origins`)."""
    category = categoriser()
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy",
                                                                          "gpu_memset")]
    totals = {c: 0.0 for c in CATEGORIES}
    top: dict[str, float] = {}
    for e in gpu:
        ms = e["dur"] / 1e3
        totals[category(e["name"])] += ms
        top[e["name"]] = top.get(e["name"], 0.0) + ms
    busy = sum(totals.values())
    result = {c: round(v, 2) for c, v in totals.items()}
    result.update(gpu_busy=round(busy, 2), idle=round(max(ms_per_iteration - busy, 0.0), 2),
                  kernels=len(gpu), host_busy=host_busy(events)[:2],
                  top_kernels={k: round(v, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:25]},
                  by_origin={f"{c} | {origin}": round(ms, 2) for (c, origin), ms
                             in sorted(origins(events).items(), key=lambda kv: -kv[1])[:40]})
    return result


def run_one(preset: str, pattern: str | None, seq_length: int, args) -> dict:
    """One ``megatron-ext pretrain`` run; returns its row."""
    settings = load_settings(preset)
    if pattern is not None:
        settings.ext.pattern = pattern
    settings.model.seq_length = seq_length
    micro = max(1, args.tokens_per_micro_batch // seq_length)
    global_batch = max(micro, args.tokens_per_iteration // seq_length)
    name = f"{preset}_{(pattern or 'preset').replace('*', 'x').replace(' ', '')}_{seq_length}"
    run_dir = (pathlib.Path(args.scratch) / name).resolve()
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    profile_at = args.iterations + 1
    command = [sys.executable, "-m", "megatron_ext.cli", "pretrain", "--preset", preset,
               "--mock-data", "--run-dir", str(run_dir),
               *(["--pattern", pattern] if pattern is not None else []), "--",
               "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length),
               "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
               "--train-iters", str(profile_at), "--log-interval", "1",
               "--eval-iters", "0", "--eval-interval", str(10**6),
               # No checkpoint: an empty --save / --load turns saving and loading off.
               "--save", "", "--load", "", "--save-interval", str(10**6),
               "--profile", "--use-pytorch-profiler", "--profile-step-start", str(profile_at - 1),
               "--profile-step-end", str(profile_at), "--tensorboard-dir", str(run_dir / "tb"),
               *args.megatron_args]
    log_path = pathlib.Path(args.log_dir) / f"{name}.log"
    log(f"{name}: micro-batch {micro}, global batch {global_batch}")
    times, losses, tflops, peak_mib = {}, {}, {}, None
    start = time.time()
    with open(log_path, "w") as out:
        # From the run's folder: a checkout's ./megatron_ext must not shadow the installed one.
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, cwd=run_dir)
        for line in process.stdout:
            out.write(line)
            if (match := ITERATION.search(line)):
                it = int(match.group(1))
                times[it] = float(match.group(2))
                if (loss := LOSS.search(line)):
                    losses[it] = float(loss.group(1))
                if (throughput := TFLOPS.search(line)):
                    tflops[it] = float(throughput.group(1))
                log(f"  iteration {it}: {times[it]:.1f} ms, loss {losses.get(it)}")
            if (memory := MEMORY.search(line)):
                peak_mib = max(peak_mib or 0.0, float(memory.group(1)))
        returncode = process.wait()
    row = {"preset": preset, "pattern": settings.ext.pattern if isinstance(settings.ext.pattern, str)
           else ",".join(settings.ext.pattern), "seq_length": seq_length, "micro_batch": micro,
           "global_batch": global_batch, "cuda_graph": settings.train.cuda_graph,
           "returncode": returncode,
           "wall_s": round(time.time() - start, 1), "log": log_path.name}
    # The profiler starts a step early (its warm-up) and slows the iterations next to it.
    timed_iterations = [i for i in sorted(times) if args.warmup < i < profile_at - 2]
    timed = [times[i] for i in timed_iterations]
    if returncode != 0 or not timed:
        row["error"] = f"exit {returncode}; see {log_path}"
        return row
    ms = statistics.median(timed)
    tokens_per_s = global_batch * seq_length / (ms / 1e3)
    flops = model_flops_per_token(settings)
    row.update(parameters=parameter_count(settings), ms_per_iteration=round(ms, 1),
               ms_spread=[round(min(timed), 1), round(max(timed), 1)],
               tokens_per_s=round(tokens_per_s), peak_gib=round((peak_mib or 0) / 1024, 2),
               model_flops_per_token=flops, mfu=round(flops * tokens_per_s / (args.peak_tflops * 1e12), 4),
               loss_last=losses.get(max(losses)) if losses else None)
    megatron = [tflops[i] for i in timed_iterations if i in tflops]
    if megatron:
        row.update(megatron_tflops=round(statistics.median(megatron), 1),
                   megatron_mfu=round(statistics.median(megatron) / args.peak_tflops, 4))
    traces = sorted((run_dir / "torch_profile").glob("*.json.gz"))
    if traces:
        row["breakdown"] = breakdown(traces[-1], ms)
        if args.keep_traces:
            pathlib.Path(args.keep_traces).mkdir(parents=True, exist_ok=True)
            shutil.copy(traces[-1], pathlib.Path(args.keep_traces) / f"{name}.json.gz")
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


def plot(record: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list] = {}
    for row in record["rows"]:
        if "tokens_per_s" in row:
            series.setdefault(f"{row['preset']}: {row['pattern']}", []).append(
                (row["seq_length"], row["tokens_per_s"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] / 1e3 for p in points], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length T (tokens per micro-batch fixed)")
    ax.set_ylabel("thousand tokens / s")
    env = record["environment"]
    ax.set_title(f"megatron-ext pretrain, one {env['gpu']} ({env['commit']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="hybrid-350m")
    parser.add_argument("--patterns", default="preset,*",
                        help="comma-separated; 'preset' = the preset's own pattern")
    parser.add_argument("--seq-lengths", default="4096,16384")
    parser.add_argument("--tokens-per-micro-batch", type=int, default=16384)
    parser.add_argument("--tokens-per-iteration", type=int, default=65536)
    parser.add_argument("--iterations", type=int, default=12,
                        help="iterations before the profiled one: --warmup, the timed ones, and "
                             "two next to the profiler's start")
    parser.add_argument("--warmup", type=int, default=5,
                        help="iterations left out first: compilation, autotuning and, with the "
                             "presets' CUDA graph, Megatron's three eager iterations and capture")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="dense bf16 peak of one GPU (H100/H200 SXM: 989)")
    parser.add_argument("--scratch", default="runs/throughput")
    parser.add_argument("--log-dir", default="runs/throughput/logs")
    parser.add_argument("--keep-traces", default=None, metavar="DIR",
                        help="keep each run's profiled-iteration trace (Chrome JSON) in DIR")
    parser.add_argument("--out", required=True)
    add_commit_argument(parser)
    parser.add_argument("--replot", action="store_true",
                        help="only redraw --out's plot from its JSON")
    parser.add_argument("--append", action="store_true",
                        help="add the rows to --out's (another preset's sequence lengths)")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER,
                        help="after --: extra Megatron flags for every run")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out)
    if args.replot:
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        return 0
    if args.megatron_args[:1] == ["--"]:
        args.megatron_args = args.megatron_args[1:]
    pathlib.Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"environment": stamp(args.commit), "commands": [], "peak_tflops": args.peak_tflops,
              "rows": []}
    if args.append and out.exists():
        record = json.loads(out.read_text())
    record["commands"].append("python " + " ".join(sys.argv))
    for preset in args.presets.split(","):
        for pattern in args.patterns.split(","):
            for seq_length in (int(t) for t in args.seq_lengths.split(",")):
                row = run_one(preset, None if pattern == "preset" else pattern, seq_length, args)
                log(json.dumps({k: v for k, v in row.items() if k != "breakdown"}))
                if "breakdown" in row:
                    log("  breakdown: " + json.dumps({k: v for k, v in row["breakdown"].items()
                                                      if k != "top_kernels"}))
                record["rows"].append(row)
                out.write_text(json.dumps(record, indent=1))
    plot(record, out.with_suffix(".png"))
    return 0 if all("error" not in row for row in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
