"""README.md's performance table, made from the benchmark results kept in benchmarks/results/.

Each benchmark script writes one JSON there (and some a plot next to it). This script reads them
and rewrites the part of README.md between the markers ``<!-- performance:begin -->`` and
``<!-- performance:end -->``: one table row per measurement's JSON (what was measured, on which
machine, the key numbers, the file, and the commit, GPU, torch and Triton it records, "not
recorded" where it records none), one line per check's JSON under it, then the plots.

    python benchmarks/report.py            # rewrite README.md's block
    python benchmarks/report.py --check    # exit 1 if README.md's block is not what it would write
    python benchmarks/report.py --plots    # also redraw the scripts' plots from their JSONs

The table needs the standard library only; ``--plots`` imports the benchmark scripts (torch,
matplotlib). A new result file needs an entry in :data:`ROWS` or :data:`CHECKS`:
``tests/recipes/test_report.py`` fails while a JSON in benchmarks/results/ has none.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
BEGIN, END = "<!-- performance:begin -->", "<!-- performance:end -->"
NOT_RECORDED = "not recorded"
# The machine part of a result file's name, <benchmark>_<machine>.json.
MACHINES = {"h100": "one H100", "h200": "one H200", "h200x2": "two H200s of one host (NCCL)"}
# Plots shown in README.md, in this order; the others are linked.
EMBEDDED = ("throughput_h100.png", "throughput_h200.png", "sparse_attention_h200.png", "residual_step_h200.png")


def _row_commits(record: dict) -> str | None:
    """"commits A (n rows), B (m rows)" where a file's rows record different commits (a resumed
    run's), else None."""
    rows = record.get("results")
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "commit" in row for row in rows):
        return None
    counts = collections.Counter(row["commit"] or NOT_RECORDED for row in rows)
    if len(counts) < 2:
        return None
    return "commits " + ", ".join(f"{commit} ({count} row{'s' * (count > 1)})" for commit, count in counts.items())


def stamp(record: dict) -> str:
    """The commit (each row's where a resumed run's rows differ), GPU, torch and Triton a result
    file records."""
    env = record.get("environment", {})
    device = record.get("device")
    gpu = env.get("gpu") or env.get("device_name")
    if gpu is None and device not in (None, "cuda", "auto"):
        gpu = "no GPU (CPU)" if device == "cpu" else device
    commits = _row_commits(record)
    if commits is None:
        commits = f"commit {env.get('commit') or record.get('commit') or NOT_RECORDED}"
    torch = env.get("torch") or record.get("torch")
    triton = env.get("triton") or record.get("triton")
    return (f"{commits}; {gpu or 'GPU ' + NOT_RECORDED}; "
            f"torch {torch or NOT_RECORDED}; Triton {triton or NOT_RECORDED}")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x"


# One function per result format: record -> (what was measured, its key numbers).

def throughput(r):
    runs = {(row["preset"], row["pattern"] == "*", row["seq_length"]): row for row in r["rows"]}
    parts = []
    for (preset, all_softmax, seq), row in runs.items():
        base = runs.get((preset, True, seq))
        if not all_softmax:
            versus = (f"{ratio(row['tokens_per_s'], base['tokens_per_s'])} its all-`*` variant, "
                      if base else "")
            parts.append(f"{preset} at T = {seq}: {row['tokens_per_s'] / 1e3:.1f}k tokens/s "
                         f"({versus}MFU {row['mfu']:.1%})")
        elif "megatron_mfu" in row:
            parts.append(f"{preset}'s all-`*` variant at T = {seq}: MFU {row['megatron_mfu']:.1%} "
                         f"by Megatron's formula")
    tokens = r["rows"][0]["global_batch"] * r["rows"][0]["seq_length"]
    graphed = all(row.get("cuda_graph") for row in r["rows"])
    graph = ", one CUDA graph an iteration" if graphed else ""
    what = (f"training throughput in Megatron's loop (`megatron-ext pretrain --mock-data`, "
            f"{tokens:,} tokens an iteration, bf16{graph})")
    return what, "; ".join(parts)


def attention_core(r):
    s, by = r["settings"], {row["backend"]: row for row in r["results"]}
    local, sdpa = by["local"], by["sdpa"]
    what = (f"attention core, Megatron's local core vs ours (SDPA): GPT "
            f"{local['params'] / 1e6:.0f}M, {s['layers']} layers, seq {s['seq']}, micro-batch "
            f"{s['batch']}, bf16, fwd+bwd")
    result = (f"local {local['ms_per_step']:.1f} ms a step, {local['peak_memory_gib']:.1f} GiB; "
              f"SDPA {sdpa['ms_per_step']:.1f} ms ({sdpa['gpu_kernel_ms_per_step']:.1f} ms of GPU "
              f"time), {sdpa['peak_memory_gib']:.1f} GiB: "
              f"{ratio(local['ms_per_step'], sdpa['ms_per_step'])} faster "
              f"({ratio(local['gpu_kernel_ms_per_step'], sdpa['gpu_kernel_ms_per_step'])} in GPU "
              f"time), {ratio(local['peak_memory_gib'], sdpa['peak_memory_gib'])} less memory")
    return what, result


LINEAR_OPS = {"deltanet": "DeltaNet", "gdn": "Gated DeltaNet", "kda": "KDA", "gdn2": "GDN-2",
              "decay_none": "linear attention", "decay_constant": "RetNet",
              "decay_scalar": "Mamba-2", "decay_channel": "GLA (HGRN-2)", "dplr": "RWKV-7 (DPLR)"}


def kernels(r, seq=4096):
    s = r["settings"]
    rows = {(row["family"], row["backend"]): row for row in r["results"] if row["seq_len"] == seq}

    def times(backend):
        return ", ".join(f"{name} {rows[family, backend]['fwd_bwd_ms']:.2f}"
                         if rows[family, backend].get("fwd_bwd_ms") else f"{name} refused"
                         for family, name in LINEAR_OPS.items() if (family, backend) in rows)

    key_heads = s.get("key_heads") or s["heads"]
    grouped = f" ({key_heads} q/k heads)" if key_heads != s["heads"] else ""
    what = (f"linear-recurrence ops fwd+bwd, B*T {s['batch_tokens']}, {s['heads']} heads{grouped} of "
            f"{s['head_dim']}, bf16, T = {seq}")
    result = f"ours (Triton), ms: {times('triton')}"
    if any(backend == "fla" for _, backend in rows):
        result += f"; fla-core: {times('fla')}"
    return what, result + f"; SDPA causal {rows['sdpa', 'torch']['fwd_bwd_ms']:.2f}"


def sparse_attention(r, seq=16384):
    s = r["settings"]
    names = {"swa_sink": f"sliding window {s['window']} + sink", "causal_sink": "causal + sink",
             "moba": "MoBA", "nsa": "NSA", "dsa": "DSA", "hca": "HCA", "csa": "CSA", "fox": "FoX"}
    rows = [row for row in r["results"] if row["seq_len"] == seq and row["backend"] != "fla"]
    sdpa = next(row["fwd_bwd_ms"] for row in rows if row["family"] == "sdpa")
    ops = [f"{names[row['family']]} {row['fwd_bwd_ms']:.1f} ms ({ratio(row['fwd_bwd_ms'], sdpa)})"
           for row in sorted(rows, key=lambda row: row["fwd_bwd_ms"]) if row["family"] != "sdpa"]
    what = (f"windowed and sparse attention fwd+bwd, B*T {s['batch_tokens']}, {s['heads']} "
            f"heads ({s['kv_heads']} key/value) of {s['head_dim']}, bf16, T = {seq}")
    return what, ", ".join(ops) + f"; SDPA causal {sdpa:.1f} ms"


def dsa_stages(r):
    s, row = r["settings"], r["results"][0]
    top_k, heads, dim = s["dsa"]
    attention = s["attention"][0]
    what = (f"DSA's sparse stage by part, T = {row['seq_len']}, B*T {s['batch_tokens']}, "
            f"{s['heads']} heads, top-{top_k}, indexer {heads} x {dim}, bf16")
    result = (f"selection {row['select']:.1f} ms; attention ({attention}) "
              f"{row[attention + '_attention_fwd']:.1f} fwd / "
              f"{row[attention + '_attention_fwd_bwd']:.1f} fwd+bwd; indexer loss "
              f"{row['loss_fwd']:.1f} / {row['loss_fwd_bwd']:.1f}, given the attention's "
              f"log-sum-exp {row['loss_given_lse_fwd']:.1f} / {row['loss_given_lse_fwd_bwd']:.1f}")
    return what, result


def residual_step(r):
    s, by = r["settings"], {row["variant"]: row for row in r["results"]}
    names = {"mhc": "mHC (4 streams)", "mhc_recompute": "mHC recomputed",
             "attnres_block": "block AttnRes", "attnres_full": "full AttnRes"}
    base = by["standard"]
    parts = [(f"standard {base['gpu_kernel_ms_per_step']:.1f} ms of GPU time a step "
              f"({base['ms_per_step']:.1f} wall), {base['peak_memory_gib']:.1f} GiB")]
    parts += [f"{names[variant]} {over['gpu_kernel_time_pct']:+.1f}% GPU time "
              f"({over['step_time_pct']:+.1f}% wall), {over['peak_memory_gib']:+.2f} GiB"
              for variant, over in r["overhead_vs_standard"].items()]
    what = (f"residual schemes, a training step of a {base['params'] / 1e6:.0f}M GPT "
            f"({s['layers']} layers, hidden {s['hidden']}, seq {s['seq']}, micro-batch "
            f"{s['batch']}, bf16)")
    return what, "; ".join(parts)


def residual_ops(r):
    s = r["settings"]
    names = {"pre_forward": "mHC pre fwd", "pre_backward": "pre bwd",
             "update_forward": "update fwd", "update_backward": "update bwd",
             "depth_forward": "AttnRes depth fwd", "depth_backward": "depth bwd"}
    parts = [f"{names.get(row['op'], row['op'])} {row['triton_kernel_ms']:.2f} ms "
             f"({row['triton_kernel_gb_per_s'] / 1e3:.2f} TB/s; PyTorch {row['pytorch_ms']:.2f})"
             for row in r["results"]]
    what = (f"residual-stream ops alone, our Triton kernels' GPU time vs eager PyTorch, "
            f"{s['tokens']} tokens, hidden {s['hidden']}, {s['streams']} streams, "
            f"{s['depth_sources']} depth sources, bf16")
    return what, "; ".join(parts)


def context_parallel(r):
    s = r["settings"]
    names = {"G": "Gated DeltaNet", "M": "Mamba-2", "*": "attention", "B": "MoBA", "S": "NSA"}
    methods = {"state_passing": "state passing", "all_to_all": "all-to-all",
               "kv_all_gather": "K/V all-gather"}
    runs: dict[tuple, list] = {}
    for row in r["results"]:
        runs.setdefault((row["mixer"], row["method"]), []).append(row)
    parts = [f"{names[mixer]} {methods[method]} "
             + " / ".join(f"{row['fwd_bwd_ms']:.1f}" for row in rows) + " ms ("
             + " / ".join(f"{row['comm_bytes_per_rank'] / 1e6:.1f}" for row in rows)
             + " MB a rank)" for (mixer, method), rows in runs.items()]
    shares = [row["comm_ms"] / row["fwd_bwd_ms"] for row in r["results"]]
    parts.append(f"the CP collectives {min(shares):.1%}-{max(shares):.1%} of a layer's time")
    what = (f"context parallelism, one layer fwd+bwd, CP = {r['cp']}, T = "
            f"{s['seq_lens'].replace(',', ' / ')}, hidden {s['hidden']}, bf16")
    return what, "; ".join(parts)


def parallel_splits(r):
    names = {"tp": "TP", "pp": "PP", "cp": "CP", "dp": "DP"}
    methods = {"state_passing": "state passing", "all_to_all": "all-to-all"}
    splits = [split for split in r["splits"] if split.get("returncode") == 0]
    base = next(split for split in splits if split["dp"] == int(r["gpus"]))

    def label(split):
        sizes = " x ".join(f"{name} = {split[key]}" for key, name in names.items()
                           if split[key] > 1)
        sp = " + SP" if split["tp"] > 1 else ""
        method = f" ({methods[split['cp_method']]})" if split["cp_method"] else ""
        versus = ("" if split is base else
                  f", {ratio(split['tokens_per_s'], base['tokens_per_s'])} DP's")
        return (f"{sizes}{sp}{method} {split['median_ms_per_iteration']:.1f} ms an iteration "
                f"({split['tokens_per_s']:,} tokens/s{versus})")

    what = (f"{r['preset']} through `megatron-ext pretrain` split over {r['gpus']} GPUs, "
            f"{r['global_batch_size']} x {r['seq_length']} tokens an iteration, mock data")
    result = "; ".join(label(split) for split in splits)
    return what, result + f"; MFU {base['mfu']:.1%} at DP = {base['dp']}"


STOPS = {"exit-interval": "Megatron's `--exit-interval`", "signal": "SIGUSR1"}


def pretrain_run(r):
    s, phases = r["summary"], r["phases"]
    command = phases[0]["command"]
    backend = ""
    if "--ext-kernel-backend" in command:
        backend = f", `--ext-kernel-backend {command[command.index('--ext-kernel-backend') + 1]}`"
    what = (f"{s['preset']} ({s['parameters'] / 1e6:.0f}M) through `megatron-ext pretrain`, "
            f"seq {s['seq_length']}, {s['global_batch_size']:.0f} sequences an iteration, mock "
            f"data{backend}, stopped and resumed")
    result = (f"stopped after iteration {s['stopped_after_iteration']} by "
              f"{STOPS.get(s['stopped_with'], s['stopped_with'])} (exit "
              f"{phases[0]['returncode']}), resumed at {s['resumed_at_iteration']}, exit "
              f"{phases[-1]['returncode']} at the end; {s['median_ms_per_iteration']:.1f} ms an "
              f"iteration, {s['tokens_per_s']:,} tokens/s, MFU {s['mfu']:.1%}")
    return what, result


def doctor(r):
    rows = r["results"]
    ops = ", ".join(f"`{op}`" for op in dict.fromkeys(row["op"] for row in rows))
    backends = ", ".join(dict.fromkeys(row["backend"] for row in rows))
    dtypes = " and ".join(dict.fromkeys(row["dtype"] for row in rows))
    passed = sum(row["status"] == "pass" for row in rows)
    verdict = r["summary"].splitlines()[-1].removeprefix("ok: ")
    what = f"`megatron-ext doctor`: {ops} against the fp32 reference, backends {backends}, {dtypes}"
    return what, f"{len(rows)} checks, {passed} passed; {verdict}"


def train(r):
    loss, valid = r["loss_curve"]["train"], r["loss_curve"]["valid"]
    what = (f"`{r['command'].split('  ')[0]}` (tiny-hybrid preset, {r['params'] / 1e6:.2f}M "
            f"parameters), fresh clone")
    result = (f"{r['wall_time_s']:.0f} s; loss {loss[0][1]:.2f} (step {loss[0][0]}) -> "
              f"{loss[-1][1]:.2f} (step {loss[-1][0]}), validation {valid[-1][1]:.2f}")
    return what, result


def export_check(r):
    what = (f"a `pretrain` run's checkpoint ({r['parameters'] / 1e6:.0f}M, {r['checkpoint']}) "
            "exported to Hugging Face and loaded with transformers, against megatron-ext's "
            "loading of it")
    fp32, bf16 = r["fp32"], r["bf16"]
    generated = r["generate_fp32"], r["generate_bf16"]
    result = (f"fp32 logits differ by {fp32['max_abs_diff']:g}; bf16 by "
              f"{bf16['relative_max_diff']:.2%} of the largest logit, same top token at "
              f"{bf16['top1_agreement']:.1%} of positions; incremental `generate` == recomputing: "
              f"fp32 {'yes' if generated[0]['same_tokens_as_recomputing'] else 'no'}, bf16 "
              f"{generated[1]['tokens_equal_to_recomputing']} of {generated[1]['of']} tokens")
    return what, result


def architectures(r):
    corpus = r["corpus"]
    what = (f"architecture comparison at {r['preset']}'s sizes: {r['steps']} steps of "
            f"`megatron-ext train` each on the same {corpus['tokens'] / 1e6:.0f}M-token corpus "
            "of Python sources, final held-out loss (mean [min, max] over seeds)")
    ranked = sorted(r["summary"].items(), key=lambda kv: kv[1]["valid_loss"])
    result = "; ".join(
        f"`{variant}` {s['valid_loss']:.3f}" + (
            f" [{s['valid_min']:.3f}, {s['valid_max']:.3f}] ({s['seeds']} seeds)"
            if s["seeds"] > 1 else "")
        for variant, s in ranked)
    return what, result


# The JSONs kept in benchmarks/results/, each with its format: measurements as table rows, in
# this order, and checks (a run that had to work, with what it showed) as a list under it.
ROWS = {
    "throughput_h100.json": throughput,
    "throughput_h200.json": throughput,
    "attention_core_h200.json": attention_core,
    "kernels_h200.json": kernels,
    "sparse_attention_h200.json": sparse_attention,
    "dsa_stages_h200.json": dsa_stages,
    "residual_step_h200.json": residual_step,
    "residual_ops_h200.json": residual_ops,
    "context_parallel_h200x2.json": context_parallel,
    "parallel_splits_h200x2.json": parallel_splits,
    "architectures_h200.json": architectures,
    "train_tiny_hybrid_cpu.json": train,
}
CHECKS = {
    "pretrain_run_h200.json": pretrain_run,
    "doctor_h200.json": doctor,
    "export_check_h200.json": export_check,
}


def where(name: str, record: dict) -> str:
    """The machine: the record's "machine", or the file's name (``<benchmark>_<machine>.json``)."""
    if "machine" in record:
        return record["machine"].split(" (")[0]
    return MACHINES[name.removesuffix(".json").rsplit("_", 1)[1]]


def link(path: pathlib.Path) -> str:
    return f"[{path.name}]({path.relative_to(ROOT).as_posix()})"


def render(results: pathlib.Path = RESULTS) -> str:
    """The block between the markers (markers excluded)."""
    lines = [("<!-- Written by `python benchmarks/report.py` from benchmarks/results/: "
              "edit that script, not this table. -->"),
             "",
             "| what | where | result | source: commit; GPU; torch; Triton |",
             "|---|---|---|---|"]
    for name, extract in ROWS.items():
        record = json.loads((results / name).read_text())
        what, result = extract(record)
        lines.append(f"| {what} | {where(name, record)} | {result} | {link(results / name)}: "
                     f"{stamp(record)} |")
    lines += ["", "Checks:", ""]
    for name, extract in CHECKS.items():
        record = json.loads((results / name).read_text())
        what, result = extract(record)
        lines.append(f"- {what} ({where(name, record)}): {result}. {link(results / name)}: "
                     f"{stamp(record)}")
    plots = sorted(results.glob("*.png"))
    lines.append("")
    lines += [f"![{path.stem}]({path.relative_to(ROOT).as_posix()})"
              for name in EMBEDDED for path in plots if path.name == name]
    others = [link(path) for path in plots if path.name not in EMBEDDED]
    if others:
        lines += ["", "Other plots: " + ", ".join(others) + "."]
    return "\n".join(lines)


def update(text: str, block: str) -> str:
    """README text with the block between the markers replaced."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + "\n" + text[end:]


def redraw_plots(results: pathlib.Path = RESULTS, out_dir: pathlib.Path | None = None) -> list:
    """Each script's plot drawn again from its JSON, by the script's own ``plot``
    (train_tiny_hybrid_cpu.png is the run's own loss_curve.png, drawn by ``megatron-ext train``)."""
    def script(name):
        # Registered (for its dataclasses) under a name no package has: "kernels" is PyPI's too.
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark",
                                                      ROOT / "benchmarks" / f"{name}.py")
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def residual_title(r):
        s = r["settings"]
        return (f"GPT {r['results'][0]['params'] / 1e6:.0f}M, {s['layers']} layers, "
                f"seq {s['seq']}, micro-batch {s['batch']}: residual schemes")

    plots = {  # result file -> (script, its plot's arguments)
        "throughput_h100.json": ("throughput", lambda r, path: (r, path)),
        "throughput_h200.json": ("throughput", lambda r, path: (r, path)),
        "attention_core_h200.json": ("attention_core", lambda r, path: (r["results"], path)),
        "kernels_h200.json": ("kernels", lambda r, path: (r, path)),
        "sparse_attention_h200.json": ("sparse_attention", lambda r, path: (r, path)),
        "residual_step_h200.json": ("residual_step",
                                    lambda r, path: (r["results"], path, residual_title(r))),
        "architectures_h200.json": ("compare_architectures", lambda r, path: (r, path)),
    }
    written = []
    for name, (module, arguments) in plots.items():
        record = json.loads((results / name).read_text())
        path = (out_dir or results) / pathlib.Path(name).with_suffix(".png").name
        script(module).plot(*arguments(record, path))
        written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if README.md's block differs from the results")
    parser.add_argument("--plots", action="store_true", help="also redraw the plots")
    args = parser.parse_args(argv)
    text = README.read_text()
    new = update(text, render())
    if args.check:
        if new != text:
            print("README.md's performance block is out of date: run python benchmarks/report.py",
                  file=sys.stderr)
        return int(new != text)
    if args.plots:
        for path in redraw_plots():
            print(f"wrote {path.relative_to(ROOT)}")
    if new != text:
        README.write_text(new)
        print("rewrote README.md's performance block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
