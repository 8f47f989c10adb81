"""Linear-recurrence ops on one device: forward and forward+backward time, and peak memory, for
every backend beside torch SDPA (causal softmax attention, the yardstick), in one run.

Ops (``--ops`` takes families, e.g. ``kda``, backends, e.g. ``triton``, or single ops, e.g.
``kda/fla``):

    deltanet, gdn, kda, gdn2          gated_delta_rule: backends chunked, triton and fla
    decay_none, decay_constant,       decay_linear_attention with no decay (linear attention),
    decay_scalar, decay_channel       a constant per-head decay (RetNet, Lightning), a per-token
                                      scalar decay (Mamba-2 SSD) and a per-channel decay (GLA):
                                      backends chunked, triton and fla (chunk_simple_gla/chunk_gla)
    dplr                              dplr_delta_rule (RWKV-7's recurrence: a = -kappa_hat,
                                      b = kappa_hat * alpha, a per-channel decay): backends
                                      chunked and triton (its decayed scores in Triton kernels,
                                      the rest of the chunked form in PyTorch)
    sdpa                              torch SDPA, causal softmax attention

Shapes: B = batch_tokens / T sequences of T tokens, H value heads, Hk = ``--key-heads`` q/k heads
(default H; fewer is grouped: each q/k head serves H / Hk value heads, as in the presets' GDN
layers, and SDPA then runs GQA with Hk key/value heads), head dim D (K = V = D). Inputs are
bf16 (q and k L2-normalised, gates in (0, 1), as in the models); every backend keeps its
recurrent state in fp32, and no initial state is passed, as in training.

Timing: after ``--warmup`` untimed calls, ``--reps`` timed calls, each between two CUDA events
(perf_counter on CPU); the median counts. "fwd" runs under torch.no_grad(); "fwd_bwd" is the
forward plus the gradients of every input (torch.autograd.grad, so nothing accumulates). Peak
memory is the peak of torch.cuda.max_memory_allocated over the timed calls, inputs included. A
failure (fla-core refusing a backward, out of memory) is recorded as the reason, and the run goes
on. An op whose second warm-up call takes longer than ``--slow-call-s`` (10 s) is timed once
(``fwd_reps`` / ``fwd_bwd_reps`` say how often), and one whose timed call takes longer is not run
at the longer T, with the reason in its rows: PyTorch reference paths would otherwise hold a run
for minutes. Results are written to ``--out`` after every op, and a plot (``.png`` next to it)
at the end; with ``--resume`` a run keeps what ``--out`` holds (from the same device and settings) and
measures only what is missing. Each row records the commit it was measured at.

On an H200 with Triton 3.6 and fla-core 0.6.0, each fla op spends one to four minutes
autotuning and compiling its forward, and as much its backward, before the first timing (GDN-2:
141 s and 217 s on a busy host); our Triton kernels compile in seconds (they are not autotuned).
fla-core has Triton keep its autotuning results (``*.autotune.json`` under ``TRITON_CACHE_DIR``,
keyed by B, H, the head dims and dtypes, not T), so a run that starts from another's cache
skips that: on a machine that starts bare, carry those files over.

    source benchmarks/gpu_setup.sh && python benchmarks/kernels.py     # on the GPU machine
    python benchmarks/kernels.py --device cpu --seq-lens 128 --batch-tokens 256 --ops chunked,sdpa
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import pathlib
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.kernels import decay_linear_attention, dplr_delta_rule, gated_delta_rule
from megatron_ext.kernels.backends import fla_unavailable_reason
from megatron_ext.kernels.decay.fla import decay_fla_kind
from megatron_ext.kernels.delta_rule.fla import fla_kind

DELTA_FAMILIES = ["deltanet", "gdn", "kda", "gdn2"]
DECAY_FAMILIES = ["decay_none", "decay_constant", "decay_scalar", "decay_channel"]
BACKENDS = ["chunked", "triton", "fla"]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclasses.dataclass
class Op:
    """One op to time: ``make_inputs(B, T, H, D)`` gives the input tensors by name, ``run(**inputs)``
    the output; ``skip`` says why it cannot run here (then nothing is timed). ``check()``, if
    given, runs before each measurement (cache it if it is costly) and returns what the row
    records as its "check"; with a "failed" reason in it the op is not timed."""

    family: str
    backend: str
    make_inputs: Callable[..., dict[str, torch.Tensor]]
    run: Callable[..., torch.Tensor]
    skip: str | None = None
    check: Callable[[], dict] | None = None

    @property
    def name(self) -> str:
        return f"{self.family}/{self.backend}"


def linear_inputs(family, batch, seq_len, heads, dim, device, key_heads=None):
    """q, k ``[B, T, Hk, D]`` (Hk = ``key_heads``, default H), v ``[B, T, H, D]`` and the
    family's gates (per value head), bf16."""

    def randn(*shape):
        return torch.randn(*shape, device=device, dtype=torch.float32)

    per_head = (batch, seq_len, heads)
    per_key_head = (batch, seq_len, key_heads or heads, dim)
    inputs = {"q": F.normalize(randn(*per_key_head), dim=-1), "k": F.normalize(randn(*per_key_head), dim=-1),
              "v": randn(*per_head, dim)}
    if family == "gdn2":
        inputs.update(erase=torch.sigmoid(randn(*per_head, dim)), write=torch.sigmoid(randn(*per_head, dim)))
    elif family == "dplr":  # RWKV-7: removal key -kappa_hat, its write-back kappa_hat * alpha
        removal = F.normalize(randn(*per_head, dim), dim=-1)
        inputs.update(a=-removal, b=removal * torch.sigmoid(randn(*per_head, dim)))
    elif family in DELTA_FAMILIES:
        inputs["beta"] = torch.sigmoid(randn(*per_head))
    if family in ("gdn", "decay_scalar"):
        inputs["g"] = F.logsigmoid(randn(*per_head) + 2.0)
    elif family in ("kda", "gdn2", "decay_channel", "dplr"):
        inputs["g"] = F.logsigmoid(randn(*per_head, dim) + 2.0)
    inputs = {name: tensor.bfloat16() for name, tensor in inputs.items()}
    if family == "decay_constant":  # RetNet's per-head decays, fp32 as the mixers pass them
        inputs["g"] = torch.log(1 - 2.0 ** (-5 - torch.arange(heads, device=device, dtype=torch.float32)))
    return inputs


def sdpa_inputs(batch, seq_len, heads, dim, device, kv_heads=None):
    """q ``[B, H, T, D]``, k and v ``[B, Hkv, T, D]`` (Hkv = ``kv_heads``, default H) bf16,
    SDPA's layout."""
    counts = dict(q=heads, k=kv_heads or heads, v=kv_heads or heads)
    return {name: torch.randn(batch, count, seq_len, dim, device=device, dtype=torch.bfloat16)
            for name, count in counts.items()}


def _fla_skip(family, inputs_example, device) -> str | None:
    """Why fla-core cannot run this family's forward here (its refused backwards are recorded
    when they happen)."""
    if family in DELTA_FAMILIES:
        kind = fla_kind(beta=inputs_example.get("beta"), g=inputs_example.get("g"),
                        erase=inputs_example.get("erase"), write=inputs_example.get("write"))
    else:
        kind = decay_fla_kind(inputs_example.get("g"))
    return fla_unavailable_reason(kind, device, requires_grad=False)


def build_ops(device: torch.device, key_heads: int | None = None) -> list[Op]:
    """Every op, with ``key_heads`` q/k heads (SDPA: key/value heads; default: as many as H)."""
    ops = []
    for family in DELTA_FAMILIES + DECAY_FAMILIES:
        make = lambda *shape, family=family: linear_inputs(family, *shape, device, key_heads)  # noqa: E731
        function = gated_delta_rule if family in DELTA_FAMILIES else decay_linear_attention
        example = linear_inputs(family, 1, 1, 2, 16, "cpu")
        for backend in BACKENDS:
            skip = None
            if backend == "fla":
                skip = _fla_skip(family, example, device)
            elif backend == "triton" and device.type != "cuda":
                skip = "our Triton kernels need CUDA"
            run = lambda backend=backend, function=function, **x: function(**x, backend=backend)[0]  # noqa: E731
            ops.append(Op(family, backend, make, run, skip))
    for backend in ("chunked", "triton"):
        ops.append(Op("dplr", backend, lambda *shape: linear_inputs("dplr", *shape, device, key_heads),
                      lambda backend=backend, **x: dplr_delta_rule(**x, backend=backend)[0],
                      "our Triton kernels need CUDA" if backend == "triton" and device.type != "cuda" else None))
    ops.append(Op("sdpa", "torch", lambda *shape: sdpa_inputs(*shape, device, key_heads),
                  lambda **x: F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=True,
                                                             enable_gqa=x["k"].shape[1] < x["q"].shape[1])))
    return ops


def time_ms(function, *, warmup, reps, device, slow_s=float("inf")):
    """Median milliseconds of ``function()`` over ``reps`` calls after ``warmup`` calls, the peak
    allocated GiB over the timed calls (None on CPU), and the number of timed calls. A warm-up
    call after the first (which may compile and autotune) that takes longer than ``slow_s``
    seconds ends the warm-up, and one timed call follows."""
    for index in range(warmup):
        start = time.perf_counter()
        function()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if index > 0 and time.perf_counter() - start > slow_s:
            reps = 1
            break
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            function()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), torch.cuda.max_memory_allocated(device) / 2**30, reps
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), None, reps


def back_to_back_ms(function, *, reps, device):
    """Milliseconds a call of ``function`` (on CUDA) takes among ``reps`` calls issued back to
    back between two events: the host queues each call while the GPU runs the ones before, as in
    a training step, so host time that the GPU's work covers does not count (:func:`time_ms`
    starts every call on an idle GPU, so it does)."""
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def describe(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def measure(op: Op, seq_len: int, args) -> dict:
    batch = args.batch_tokens // seq_len
    result = dict(op=op.name, family=op.family, backend=op.backend, seq_len=seq_len, batch=batch,
                  heads=args.heads, head_dim=args.head_dim)
    if op.skip is not None:
        log(f"{op.name} T={seq_len}: skipped: {op.skip}")
        return dict(result, fwd_error=op.skip, fwd_bwd_error=op.skip)
    if op.check is not None:
        try:
            result["check"] = op.check()
        except Exception as error:  # noqa: BLE001 - a check that cannot run fails
            result["check"] = {"failed": describe(error)}
        if "failed" in result["check"]:
            reason = f"not timed: its check failed: {result['check']['failed']}"
            log(f"{op.name} T={seq_len}: {reason}")
            return dict(result, fwd_error=reason, fwd_bwd_error=reason)
    device = torch.device(args.device)
    inputs = None
    try:
        inputs = op.make_inputs(batch, seq_len, args.heads, args.head_dim)
        result["inputs_gib"] = sum(t.numel() * t.element_size() for t in inputs.values()) / 2**30

        def forward():
            with torch.no_grad():
                op.run(**inputs)

        log(f"{op.name} T={seq_len} B={batch}: forward (the first calls may autotune and compile)")
        result["fwd_ms"], result["fwd_peak_gib"], result["fwd_reps"] = time_ms(
            forward, warmup=args.warmup, reps=args.reps, device=device, slow_s=args.slow_call_s)
    except Exception as error:  # noqa: BLE001 - every failure is a result
        result["fwd_error"] = result["fwd_bwd_error"] = describe(error)
        log(f"{op.name} T={seq_len}: forward failed: {result['fwd_error']}")
    else:
        # Every input is a leaf that takes a gradient, except RetNet's and Lightning's constant
        # per-head decays (decay_constant): fixed in the models, and fla-core has no gradient for them.
        leaves = {name: t.requires_grad_(not (op.family == "decay_constant" and name == "g"))
                  for name, t in inputs.items()}

        def forward_backward():
            o = op.run(**leaves)
            torch.autograd.grad(o, [t for t in leaves.values() if t.requires_grad], torch.ones_like(o))

        try:
            log(f"{op.name} T={seq_len}: forward+backward")
            result["fwd_bwd_ms"], result["fwd_bwd_peak_gib"], result["fwd_bwd_reps"] = time_ms(
                forward_backward, warmup=args.warmup, reps=args.reps, device=device,
                slow_s=args.slow_call_s)
            if device.type == "cuda" and result["fwd_bwd_reps"] > 1:
                result["fwd_bwd_back_to_back_ms"] = back_to_back_ms(
                    forward_backward, reps=result["fwd_bwd_reps"], device=device)
            if args.profile and device.type == "cuda":
                result["fwd_bwd_profile"] = kernel_times(forward_backward)
        except Exception as error:  # noqa: BLE001
            result["fwd_bwd_error"] = describe(error)
            log(f"{op.name} T={seq_len}: forward+backward failed: {result['fwd_bwd_error']}")
    del inputs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    timings = ", ".join(f"{key} {result[key]:.3f}" for key in ("fwd_ms", "fwd_bwd_ms") if key in result)
    log(f"{op.name} T={seq_len}: {timings or 'no timings'}")
    return result


def kernel_times(fn, top: int = 12) -> dict[str, dict[str, float]]:
    """Where one call of ``fn`` spends its time, from torch.profiler: ``kernels``, GPU ms per
    kernel (summed over its launches, and over kernels whose names share their first 120
    characters), and ``host``, the host's own ms per op, the ``top`` of each; and ``wall_ms`` of
    the profiled call. The timings above include any time the GPU waits for the host (each timed
    call starts on an idle GPU), so a wall time well above the kernels' sum points at the host."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.key_averages()

    def longest(times: dict) -> dict:
        # names cut to 120 characters: kernels whose names differ only after that are summed
        cut = {}
        for name, ms in times:
            cut[name[:120]] = cut.get(name[:120], 0.0) + ms
        return dict(sorted(cut.items(), key=lambda item: item[1], reverse=True)[:top])

    # the GPU's own events only: every host op also carries its kernels' device time
    on_gpu = [(e.key, e.self_device_time_total / 1e3) for e in events
              if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    on_host = [(e.key, e.self_cpu_time_total / 1e3) for e in events
               if e.device_type == torch.autograd.DeviceType.CPU]
    return dict(kernels=longest(on_gpu), kernels_total_ms=sum(ms for _, ms in on_gpu),
                host=longest(on_host), wall_ms=wall_ms)


def environment(device: torch.device, commit: str | None = None) -> dict:
    """The results' stamp (:func:`megatron_ext.doctor.stamp`), the device and fla-core's
    version."""
    fla = importlib.util.find_spec("fla") and getattr(__import__("fla"), "__version__", "?")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(stamp(commit), device=name, fla=fla or None)


def plot(record: dict, path: pathlib.Path) -> None:
    """Per sequence length, for every op that ran: fwd and fwd+bwd ms (log scale, with the reason
    where fwd+bwd failed) and, on CUDA, the peak memory of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in record["results"] if "fwd_ms" in r]
    seq_lens = sorted({r["seq_len"] for r in ran})
    panels = [("ms", "ms (median)")] + ([("peak_gib", "peak GiB")] if any(r.get("fwd_peak_gib") for r in ran) else [])
    fig, axes = plt.subplots(len(panels), len(seq_lens), figsize=(6.5 * len(seq_lens), 0.35 * len(ran) + 3),
                             squeeze=False)
    for column, seq_len in enumerate(seq_lens):
        rows = [r for r in ran if r["seq_len"] == seq_len]
        positions = list(range(len(rows)))
        for (suffix, label), axis in zip(panels, axes[:, column]):
            for offset, phase, color in ((-0.2, "fwd", "#9cf"), (0.2, "fwd_bwd", "#27a")):
                axis.barh([p + offset for p in positions], [r.get(f"{phase}_{suffix}") or 0 for r in rows],
                          height=0.4, color=color, label=phase.replace("_", "+"))
            for position, r in zip(positions, rows):
                if "fwd_bwd_error" in r:  # x in axes coordinates, y in data coordinates
                    axis.text(0.01, position + 0.2, f"fwd+bwd: {r['fwd_bwd_error'][:70]}", fontsize=6,
                              va="center", transform=axis.get_yaxis_transform())
            if suffix == "ms":
                axis.set_xscale("log")
                axis.set_title(f"T = {seq_len}, B = {rows[0]['batch']}")
            axis.set_xlabel(label)
            axis.set_yticks(positions, [r["op"] for r in rows], fontsize=8)
            axis.invert_yaxis()
            axis.legend(fontsize=7)
    settings = record["settings"]
    key_heads = settings.get("key_heads") or settings["heads"]
    grouped = f", Hk = {key_heads}" if key_heads != settings["heads"] else ""
    fig.suptitle(f"{record['device']}: H = {settings['heads']}{grouped}, D = {settings['head_dim']}, "
                 f"B*T = {settings['batch_tokens']}, bf16 inputs")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="2048,4096,8192,16384,32768",
                        help="comma-separated T values")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="B * T, the same for every T")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--key-heads", type=int,
                        help="q/k heads of the linear ops, key/value heads of SDPA (default: --heads; "
                             "hybrid-350m's GDN layers: --heads 16 --key-heads 4 --head-dim 64)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ops", default="all",
                        help="comma-separated families, backends or ops, e.g. 'kda,triton,gdn2/fla,sdpa' "
                             "(default: all)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 2; 1 on CPU)")
    parser.add_argument("--reps", type=int, help="timed calls, the median counts (default: 10; 3 on CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/results/kernels_h200.json")
    add_commit_argument(parser)
    parser.add_argument("--profile", action="store_true",
                        help="also profile one fwd+bwd call: GPU time per kernel, host time "
                             "per op")
    parser.add_argument("--resume", action="store_true",
                        help="keep the results already in --out and measure only what is missing "
                             "(to finish a run that was cut short, or to add ops)")
    add_slow_call_argument(parser)
    args = finish_timing_args(parser, parser.parse_args(argv))
    args.key_heads = args.key_heads or args.heads
    if args.heads % args.key_heads:
        parser.error(f"--key-heads {args.key_heads} must divide --heads {args.heads}")
    return args


def add_slow_call_argument(parser) -> None:
    parser.add_argument("--slow-call-s", type=float, default=10.0,
                        help="seconds: an op whose second warm-up call takes longer is timed "
                             "once, and one whose timed call takes longer is not run at the "
                             "longer T (recorded with the reason)")


def finish_timing_args(parser, args):
    """Device-dependent --warmup / --reps defaults and --seq-lens as integers that divide
    --batch-tokens (shared with the other kernel benchmarks)."""
    on_cpu = torch.device(args.device).type == "cpu"
    args.warmup = (1 if on_cpu else 2) if args.warmup is None else args.warmup
    args.reps = (3 if on_cpu else 10) if args.reps is None else args.reps
    args.seq_lens = [int(value) for value in args.seq_lens.split(",")]
    for seq_len in args.seq_lens:
        if args.batch_tokens % seq_len:
            parser.error(f"--batch-tokens {args.batch_tokens} is not a multiple of T = {seq_len}")
    return args


def select_ops(ops: list[Op], spec: str) -> list[Op]:
    """The ops that ``--ops`` names ("all", or comma-separated families, backends or ops)."""
    if spec == "all":
        return ops
    wanted = set(spec.split(","))
    known = {op.family for op in ops} | {op.backend for op in ops} | {op.name for op in ops}
    if wanted - known:
        raise SystemExit(f"unknown --ops {sorted(wanted - known)}; known: {sorted(known)}")
    return [op for op in ops if {op.family, op.backend, op.name} & wanted]


# Arguments that say how a run runs, not what it measures: a resumed run may change them.
RUN_ARGS = {"seq_lens", "ops", "warmup", "reps", "device", "out", "commit", "profile", "resume", "slow_call_s"}


def measure_all(ops: list[Op], args, env: dict, out: pathlib.Path) -> dict:
    """Measure every op at every T of ``args.seq_lens`` and return the record (``env``, the
    settings and one row per op and T), written to ``out`` after every row. With
    ``args.resume``, the rows ``out`` already holds are kept and not measured again."""
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(env, settings=vars(args), results=[])
    if args.resume and out.exists():
        kept = json.loads(out.read_text())
        theirs = dict(kept["settings"])
        if "key_heads" in vars(args):  # files from before --key-heads: as many as heads
            theirs["key_heads"] = theirs.get("key_heads") or theirs["heads"]
        mine = json.loads(json.dumps(vars(args)))
        differ = sorted(k for k in theirs.keys() & mine.keys() - RUN_ARGS if theirs[k] != mine[k])
        if kept.get("device") != env["device"] or differ:
            raise SystemExit(f"--resume: {out} was measured on {kept.get('device')} with "
                             f"{ {k: theirs[k] for k in differ} }, not on {env['device']} with "
                             f"{ {k: mine[k] for k in differ} }")
        # The stamp is this run's; the rows kept keep their own commit (None: not recorded), the
        # settings the first run's, and each resumed run's arguments are listed after them.
        record["results"] = [dict(row, commit=row.get("commit", kept.get("commit")))
                             for row in kept["results"]]
        record["settings"] = theirs
        record["resumed"] = kept.get("resumed", []) + [vars(args)]
    done = {(r["op"], r["seq_len"]) for r in record["results"]}
    versions = ", ".join(f"{name} {value}" for name, value in env.items() if name != "device")
    log(f"{record['device']}: {versions}; {len(done)} results kept from {out}")
    started = time.time()
    too_slow = {}  # op name -> why its longer T are not measured
    for seq_len in args.seq_lens:
        for op in ops:
            if (op.name, seq_len) in done:
                continue
            if op.name in too_slow:  # measure's skip path: logged, with the reason in the row
                result = measure(dataclasses.replace(op, skip=too_slow[op.name]), seq_len, args)
            else:
                result = measure(op, seq_len, args)
                slowest = max(result.get("fwd_ms", 0), result.get("fwd_bwd_ms", 0)) / 1e3
                if slowest > args.slow_call_s:
                    too_slow[op.name] = (f"one call took {slowest:.1f} s at T = {seq_len}, over "
                                         f"--slow-call-s {args.slow_call_s:g}")
            record["results"].append(dict(result, commit=env["commit"]))
            out.write_text(json.dumps(record, indent=1))
    log(f"wrote {out} after {time.time() - started:.0f} s")
    return record


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    ops = select_ops(build_ops(device, args.key_heads), args.ops)
    out = pathlib.Path(args.out)
    record = measure_all(ops, args, environment(device, args.commit), out)
    try:
        plot(record, out.with_suffix(".png"))
        log(f"wrote {out.with_suffix('.png')}")
    except ImportError as error:
        log(f"no plot: {error}")


if __name__ == "__main__":
    main()
