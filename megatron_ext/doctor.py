"""``megatron-ext doctor``: check every kernel backend on this machine against the fp32 reference.

    megatron-ext doctor [--device auto|cpu|cuda] [--backends NAME,...] [--ops NAME,...]
                        [--json PATH]

Prints the environment, then one table row per check as it finishes (op, case, backend, device,
dtype, the worst relative error of the forward outputs and of the gradients, the tolerance,
pass / FAIL / skip, milliseconds, and a note: why a backend was skipped, or the exception it
raised), then a summary. Exits 1 when a check of a backend that ``backend="auto"`` selects here
fails, since training would run it; a failing backend that auto does not select is reported but
only runs when asked for by name. The last rows are the first-use checks of the other fast
paths (the sparse ops' FlashAttention path, the residual Triton kernels, DSA's and CSA's
selected-attention kernels, MoBA's selection kernel, NSA's block-importance kernel): a failure
there is a warning, since "auto" then falls back. ``--ops`` keeps the rows (and runs the checks)
of the named ops only. The checks themselves are ``megatron_ext.kernels.selfcheck``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib.metadata
import json
import math
import platform
import sys
import time

COLUMNS = (  # (title, width)
    ("op", 22), ("case", 18), ("backend", 9), ("device", 6), ("dtype", 8), ("fwd err", 8),
    ("bwd err", 8), ("tol", 7), ("result", 6), ("ms", 8), ("note", 0),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where to run the backends (auto: CUDA if available, else the CPU)")
    parser.add_argument("--backends", default=None, metavar="NAME,...",
                        help="check only these backends (e.g. 'triton,auto'; default: every one; "
                             "fla-core's autotuning takes minutes on a fresh machine)")
    parser.add_argument("--ops", default=None, metavar="NAME,...",
                        help="check only these ops, the table's first column (e.g. "
                             "'moba_selection,nsa_selection'; default: every one)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the environment and every result to PATH (as they come)")


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment(device) -> dict:
    """What the results depend on: versions, the device, the fp32 matmul precision."""
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "megatron-core": _version("megatron-core"),
        "fla-core": _version("fla-core"),
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        info.update(device_name=torch.cuda.get_device_name(device),
                    compute_capability=f"{major}.{minor}", cuda_runtime=torch.version.cuda)
    return info


def stamp(commit: str | None = None) -> dict:
    """The stamp of a benchmark's result file, which ``benchmarks/report.py`` shows beside its
    numbers: the commit (``commit``, else git's HEAD of the working directory, else None), the
    GPU (None without CUDA), torch, Triton and the date."""
    import subprocess

    import torch

    if commit is None:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True)
        commit = done.stdout.strip() or None
    return {"commit": commit,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "torch": torch.__version__, "triton": _version("triton"),
            "date": time.strftime("%Y-%m-%d")}


def add_commit_argument(parser: argparse.ArgumentParser) -> None:
    """A benchmark's ``--commit``, for :func:`stamp` (a copy of the tree without its .git, as
    on a lent GPU machine, has no HEAD to read)."""
    parser.add_argument("--commit", default=None,
                        help="the commit to stamp the results with (default: git's HEAD here)")


def _resolve_device(choice: str):
    import torch

    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch sees no CUDA device here "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    return torch.device("cuda", torch.cuda.current_device())


def _number(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    return format(value, spec) if math.isfinite(value) else str(value)


def format_row(result) -> str:
    cells = (result.op, result.case, result.backend, result.device, result.dtype,
             _number(result.fwd_error, ".1e"), _number(result.bwd_error, ".1e"),
             _number(result.tolerance, ".0e"), result.status, _number(result.ms, ".1f"),
             result.skipped_reason or result.note or "")
    return "  ".join(cell.ljust(width) for cell, (_, width) in zip(cells, COLUMNS)).rstrip()


def _header() -> str:
    header = "  ".join(title.ljust(width) for title, width in COLUMNS).rstrip()
    return f"{header}\n{'-' * len(header)}"


def _auto_failures(results, device) -> list:
    """The failed checks of backends that backend="auto" selects on ``device`` (and of auto)."""
    from megatron_ext.kernels.selfcheck import OPS, auto_backend

    return [r for r in results if r.status == "FAIL" and r.op in OPS
            and r.backend in ("auto", auto_backend(r.op, device))]


def summarize(results, device) -> tuple[str, int]:
    """The summary lines and the exit code."""
    from megatron_ext.kernels.selfcheck import OPS, auto_backend

    counts = {status: sum(r.status == status for r in results) for status in ("pass", "FAIL", "skip")}
    lines = [f"{len(results)} checks on {device}: {counts['pass']} passed, {counts['FAIL']} failed, "
             f"{counts['skip']} skipped (not available here; the note says why)"]
    auto_failed = _auto_failures(results, device)
    others = [r for r in results if r.status == "FAIL" and r not in auto_failed]
    # The ops whose auto backend ran here (--backends or --ops may leave some out).
    checked = sorted({r.op for r in results if r.op in OPS and r.status != "skip"
                      and r.backend in ("auto", auto_backend(r.op, device))})
    selected = ", ".join(f"{op} -> {auto_backend(op, device)}" for op in checked)
    if not checked:
        lines.append("no check of what backend='auto' runs here ran (--backends or --ops left it "
                     "out)")
    elif auto_failed:
        by_backend = collections.Counter(f"{r.op} {r.backend}" for r in auto_failed)
        failed = ", ".join(f"{name} ({count})" for name, count in by_backend.items())
        lines.append(f"FAILED: {len(auto_failed)} checks of what backend='auto' runs here "
                     f"({selected}): {failed}; the table's rows say which")
    else:
        lines.append(f"ok: what backend='auto' runs here ({selected}) passes every check")
    if others:
        lines.append(f"warning: {len(others)} failed checks of backends that auto does not select "
                     f"here; they run only where a config names them (kernel_backend=..., "
                     f"sparse_backend=...), and the fast paths of the last rows fall back to "
                     f"PyTorch or FlexAttention where their first-use check fails")
    return "\n".join(lines), 1 if auto_failed else 0


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_jsonable(item) for item in value]
    return value


def _write_json(path, env, results, summary=None, exit_code=None) -> None:
    payload = {
        "environment": env,
        "complete": summary is not None,
        "results": [dict(dataclasses.asdict(r), status=r.status, fwd_error=r.fwd_error,
                         bwd_error=r.bwd_error) for r in results],
    }
    if summary is not None:
        payload.update(summary=summary, exit_code=exit_code)
    with open(path, "w") as file:
        json.dump(_jsonable(payload), file, indent=1)


def run(args: argparse.Namespace) -> int:
    """The doctor with parsed arguments (``add_arguments``); returns the exit code."""
    try:
        device = _resolve_device(args.device)
    except RuntimeError as error:
        print(f"megatron-ext doctor: error: {error}", file=sys.stderr)
        return 2
    from megatron_ext.kernels import selfcheck

    backends = None if args.backends is None else args.backends.split(",")
    ops = None if args.ops is None else args.ops.split(",")
    try:
        selfcheck.check_names(backends, ops)
    except ValueError as error:
        print(f"megatron-ext doctor: error: {error}", file=sys.stderr)
        return 2
    env = environment(device)
    print("megatron-ext doctor: every kernel backend against the fp32 reference, forward and backward")
    print("  " + " | ".join(f"{name} {env[name]}" for name in
                            ("python", "torch", "triton", "megatron-core", "fla-core")))
    if device.type == "cuda":
        print(f"  device {device}: {env['device_name']}, compute capability "
              f"{env['compute_capability']}, CUDA {env['cuda_runtime']}")
    else:
        print(f"  device cpu (CUDA {'available' if env['cuda_available'] else 'not available'});"
              " the CPU checks the chunked path")
    print(f"  fp32 matmul precision {env['float32_matmul_precision']}; errors are relative "
          "(Frobenius norm), the worst over o and the final state (fwd) and over the gradients (bwd)")
    if device.type == "cuda":
        print("  the first call of each Triton kernel compiles and autotunes: the first rows can "
              "take a minute")
    print()
    print(_header(), flush=True)

    results = []
    started = time.perf_counter()

    def on_result(result) -> None:
        results.append(result)
        print(format_row(result), flush=True)
        if args.json:
            _write_json(args.json, env, results)

    selfcheck.run_all(device, on_result=on_result, backends=backends, ops=ops)
    summary, exit_code = summarize(results, device)
    print()
    print(f"{summary}\n({time.perf_counter() - started:.1f} s)")
    if args.json:
        _write_json(args.json, env, results, summary, exit_code)
    return exit_code

