"""A small-scale architecture comparison: the same model sizes, tokens, corpus and schedule,
with different token mixers and residual schemes, through ``megatron-ext train``.

Variants (``--variants``, default all): ``*`` (softmax attention in every layer), ``NN*``
(DeltaNet), ``GG*`` (Gated DeltaNet), ``KK*`` (KDA), ``QQ*`` (GDN-2), each pattern repeated over
the preset's layers, and ``GG*`` with mHC (``GG*+mhc``) and with block attention residuals
(``GG*+attnres``). Each runs ``--steps`` steps of the preset (its sizes and learning rate; the
corpus of ``data.inputs``, tokenized once into ``--out-dir``/data and shared) for every seed
of ``--seeds``, evaluating every ``--eval-interval`` steps on the held-out split. The corpus is
the preset's ``data.inputs`` or ``--inputs`` (files or folders; None: the Python standard
library), tokenized once before the runs with one worker per CPU.

Output (``--out``, JSON): per variant and seed the train and validation loss curves and
tokens/s; per variant the final validation loss's mean and spread (min, max) over seeds; a
plot of the validation curves next to it (``.png``). The JSON is rewritten after every run;
with ``--append`` a later command adds its runs to it (runs already in it are skipped), so a
comparison can be split over several jobs. A run that fails is reported and skipped, and the
script then exits with status 1. Runs live in ``--out-dir`` (not kept).

    python benchmarks/compare_architectures.py --preset hybrid-350m --steps 300 \\
        --out benchmarks/results/architectures_h200.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import time

import yaml

from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.launch.presets import load_preset

VARIANTS = {
    "*": ("*", "standard"),
    "NN*": ("NN*", "standard"),
    "GG*": ("GG*", "standard"),
    "KK*": ("KK*", "standard"),
    "QQ*": ("QQ*", "standard"),
    "GG*+mhc": ("GG*", "mhc"),
    "GG*+attnres": ("GG*", "attnres_block"),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def variant_preset(base: dict, variant: str, seed: int, args, data_dir: pathlib.Path) -> dict:
    """The preset of one run: the base preset with the variant's pattern (repeated over the
    layers) and residual, the seed, the steps and evaluation cadence, the shared data."""
    unit, residual = VARIANTS[variant]
    preset = json.loads(json.dumps(base))
    layers = preset["model"]["num_layers"]
    preset["ext"]["pattern"] = (unit * math.ceil(layers / len(unit)))[:layers]
    preset["ext"]["residual"] = residual
    if residual == "attnres_block":
        preset["ext"]["attnres_block_layers"] = min(
            preset["ext"].get("attnres_block_layers", 4), layers)
    train = preset["train"]
    train.update(steps=args.steps, seed=seed, eval_interval=args.eval_interval,
                 eval_batches=args.eval_batches, save_interval=args.steps, log_interval=1,
                 warmup_steps=min(train.get("warmup_steps", 0), args.steps // 10))
    if train.get("decay_style") == "WSD":  # the presets' last 20% of the steps
        train["wsd_decay_steps"] = max(1, args.steps // 5)
    for name in ("micro_batch_size", "global_batch_size"):
        if getattr(args, name):
            train[name] = getattr(args, name)
    preset["data"]["output_dir"] = str(data_dir)
    for name in ("paths", "tokenizer_type", "tokenizer_model"):
        preset["data"].pop(name, None)  # `train` tokenizes data.inputs itself
    if args.inputs:
        preset["data"]["inputs"] = args.inputs
    if args.vocab_size:
        preset["data"]["vocab_size"] = args.vocab_size
    preset["parallel"] = {"tensor": 1, "pipeline": 1}
    return preset


def run(variant: str, seed: int, base: dict, args, root: pathlib.Path) -> dict:
    name = f"{variant.replace('*', 'x').replace('+', '_')}_seed{seed}"
    run_dir = root / "runs" / name
    preset_path = root / "presets" / f"{name}.yaml"
    preset_path.parent.mkdir(parents=True, exist_ok=True)
    preset_path.write_text(yaml.safe_dump(variant_preset(base, variant, seed, args, root / "data")))
    command = [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(preset_path),
               "--run-dir", str(run_dir), "--device", args.device]
    if (run_dir / "checkpoints" / "latest").exists():
        command.append("--resume")  # a run this script started before: continue it
    log(f"{name}: {' '.join(command[2:])}")
    start = time.time()
    # From the run folder: a checkout's folders must not shadow installed packages.
    done = subprocess.run(command, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    valid = [(r["step"], r["loss"]) for r in records if r["kind"] == "valid"]
    speeds = [r["tokens_per_s"] for r in records if r["kind"] == "train"][1:]  # after the first
    row = {"variant": variant, "seed": seed, "train": train, "valid": valid,
           "tokens_per_s": statistics.median(speeds) if speeds else None,
           "wall_s": round(time.time() - start, 1)}
    log(f"{name}: valid {valid[-1][1]:.4f}, {row['tokens_per_s'] or 0:,.0f} tokens/s")
    return row


def summary(rows: list[dict]) -> dict:
    """Per variant: the final validation loss's mean, min and max over seeds, tokens/s."""
    out = {}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        finals = [r["valid"][-1][1] for r in rows if r["variant"] == variant]
        speeds = [r["tokens_per_s"] for r in rows if r["variant"] == variant and r["tokens_per_s"]]
        out[variant] = {"valid_loss": statistics.mean(finals), "valid_min": min(finals),
                        "valid_max": max(finals), "seeds": len(finals),
                        "tokens_per_s": statistics.mean(speeds) if speeds else None}
    return out


def plot(record: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant, stats in record["summary"].items():
        curves = [r["valid"] for r in record["rows"] if r["variant"] == variant]
        steps = [step for step, _ in curves[0]]
        mean = [statistics.mean(curve[i][1] for curve in curves) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o", markersize=3,
                label=f"{variant}: {stats['valid_loss']:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean over seeds)")
    env = record["environment"]
    ax.set_title(f"{record['preset']}, {record['steps']} steps, {env['gpu'] or 'CPU'} "
                 f"({env['commit']})", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prepare_corpus(base: dict, args, data_dir: pathlib.Path) -> dict:
    """Tokenize the runs' corpus once, with a worker per CPU (the runs then reuse it)."""
    from megatron_ext.data import prepare_data
    from megatron_ext.train import RunSettings

    settings = RunSettings.from_dict(variant_preset(base, "*", 0, args, data_dir))
    prepared = prepare_data(inputs=settings.data.inputs, output_dir=data_dir,
                            vocab_size=settings.data.vocab_size, workers=os.cpu_count() or 1)
    counts = prepared.meta["counts"]
    log(f"corpus: {counts['files']:,} files, {counts['tokens']:,} tokens, vocabulary "
        f"{prepared.meta['vocab_size']:,}")
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="hybrid-350m")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument("--seeds", default="1234", help="comma-separated")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-interval", type=int, default=50)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    parser.add_argument("--inputs", nargs="+", default=None, metavar="PATH",
                        help="the corpus: text files or folders (default: the preset's "
                             "data.inputs)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the tokenizer trained on the corpus (default: the preset's)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true",
                        help="add to --out's runs (same preset and steps) instead of replacing")
    parser.add_argument("--out-dir", default="/tmp/megatron-ext-architectures")
    add_commit_argument(parser)
    args = parser.parse_args(argv)

    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; choose from {list(VARIANTS)}")
    base = load_preset(args.preset)
    root = pathlib.Path(args.out_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    out = pathlib.Path(args.out)
    command = "python " + " ".join(sys.argv)
    record = {"environment": stamp(args.commit), "commands": [command],
              "preset": args.preset, "steps": args.steps, "rows": []}
    if args.append and out.exists():
        record = json.loads(out.read_text())
        if (record["preset"], record["steps"]) != (args.preset, args.steps):
            parser.error(f"{out} holds {record['preset']} at {record['steps']} steps")
        record["commands"].append(command)
    out.parent.mkdir(parents=True, exist_ok=True)
    record["corpus"] = prepare_corpus(base, args, root / "data")
    done = {(r["variant"], r["seed"]) for r in record["rows"]}
    failed = []
    for variant in variants:
        for seed in (int(s) for s in args.seeds.split(",")):
            if (variant, seed) in done:
                log(f"{variant} seed {seed}: already in {out}")
                continue
            try:
                record["rows"].append(run(variant, seed, base, args, root))
            except RuntimeError as error:
                log(str(error))
                failed.append((variant, seed))
                continue
            record["summary"] = summary(record["rows"])
            out.write_text(json.dumps(record, indent=1))  # as it goes
    if record["rows"]:
        plot(record, out.with_suffix(".png"))
    for variant, stats in sorted(record.get("summary", {}).items(),
                                 key=lambda kv: kv[1]["valid_loss"]):
        log(f"{variant:<12} valid {stats['valid_loss']:.4f} [{stats['valid_min']:.4f}, "
            f"{stats['valid_max']:.4f}] over {stats['seeds']} seed(s), "
            f"{stats['tokens_per_s'] or 0:,.0f} tokens/s")
    if failed:
        log(f"failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
