"""The ``megatron-ext`` command.

    megatron-ext train [--preset NAME|FILE] [--run-dir DIR] [--resume] [--steps N] [--pattern P]
    megatron-ext pretrain [--preset NAME|FILE] [--run-dir DIR] [--mock-data] [-- MEGATRON FLAGS]
    megatron-ext prepare-data [INPUT ...] --output-dir DIR [--tokenizer-model M | --vocab-size N]
    megatron-ext doctor [--device auto|cpu|cuda] [--json PATH]
    megatron-ext launch --cluster {alps-gh200,h100-ib,generic} --nodes N --preset NAME [--dry-run]
    megatron-ext presets
"""

from __future__ import annotations

import argparse
import os
import sys

from megatron_ext.config import ConfigError


def _train(args) -> int:
    from megatron_ext.train import PREEMPTED_EXIT_CODE, train

    summary = train(_settings(args), _run_dir(args), resume=args.resume, device=args.device,
                    max_steps=args.stop_after)
    return PREEMPTED_EXIT_CODE if summary["preempted"] else 0


def _settings(args):
    """The preset's settings with the command line's overrides."""
    from megatron_ext.launch.presets import load_preset
    from megatron_ext.train import RunSettings

    settings = RunSettings.from_dict(load_preset(args.preset))
    if args.steps is not None:
        settings.train.set_steps(args.steps)
    if args.pattern is not None:
        settings.ext.pattern = args.pattern
    return settings


def _run_dir(args) -> str:
    return args.run_dir or f"runs/{args.preset.replace('/', '_').removesuffix('.yaml')}"


def _pretrain(args) -> int:
    from megatron_ext.pretrain import pretrain

    extra = args.megatron_args[1:] if args.megatron_args[:1] == ["--"] else args.megatron_args
    return pretrain(_settings(args), _run_dir(args), mock_data=args.mock_data,
                    megatron_args=extra)


def _prepare_data(args) -> int:
    from megatron_ext.data import prepare_data

    prepare_data(inputs=args.inputs or None, output_dir=args.output_dir,
                 vocab_size=args.vocab_size, overwrite=args.overwrite,
                 tokenizer_model=args.tokenizer_model, workers=args.workers)
    return 0


def _export(args) -> int:
    from megatron_ext.export import export

    export(args.source, args.out_dir, tokenizer_model=args.tokenizer_model)
    return 0


def _presets(_args) -> int:
    from megatron_ext.launch.presets import list_presets, parameter_count

    for name in list_presets():
        print(f"{name:<14} {parameter_count(name) / 1e6:>10,.1f}M parameters")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-ext", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a preset (default: tiny-hybrid on the stdlib corpus)")
    p.add_argument("--preset", default="tiny-hybrid", help="preset name or YAML file")
    p.add_argument("--run-dir", default=None, help="default: runs/<preset>")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--steps", type=int, default=None, help="override the preset's total steps (warmup and decay scale with it)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="save and stop at this step without changing the schedule")
    p.add_argument("--pattern", default=None, help="override the preset's layer pattern")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.set_defaults(func=_train)

    p = sub.add_parser("pretrain", help="train a preset with Megatron's own training loop "
                       "(megatron.training.pretrain; CUDA)")
    p.add_argument("--preset", default="tiny-hybrid", help="preset name or YAML file")
    p.add_argument("--run-dir", default=None,
                   help="default: runs/<preset>; checkpoints in RUN_DIR/checkpoints (a run there "
                        "is resumed)")
    p.add_argument("--steps", type=int, default=None, help="override the preset's total steps (warmup and decay scale with it)")
    p.add_argument("--pattern", default=None, help="override the preset's layer pattern")
    p.add_argument("--mock-data", action="store_true",
                   help="Megatron's mock data instead of the preset's corpus")
    p.add_argument("megatron_args", nargs=argparse.REMAINDER,
                   help="after --: Megatron flags, applied after (and over) the preset's")
    p.set_defaults(func=_pretrain)

    p = sub.add_parser("prepare-data",
                       help="tokenize a corpus into a Megatron indexed dataset (with an existing "
                            "sentencepiece model, or one trained on the corpus)")
    p.add_argument("inputs", nargs="*", help="text/jsonl files or folders (default: the stdlib)")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--tokenizer-model", default=None,
                   help="an existing sentencepiece .model to tokenize with (default: train one)")
    p.add_argument("--vocab-size", type=int, default=4096,
                   help="the vocabulary of a tokenizer trained here")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizing processes (default: this machine's CPU count)")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_prepare_data)

    p = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model "
                       "directory (AutoModelForCausalLM with trust_remote_code=True)")
    p.add_argument("source", help="a run directory (its newest checkpoint) or a checkpoint "
                                  "folder checkpoints/iter_NNNNNNN in one")
    p.add_argument("out_dir")
    p.add_argument("--tokenizer-model", default=None,
                   help="the sentencepiece model to ship (default: the run's, when found)")
    p.set_defaults(func=_export)

    from megatron_ext import doctor

    p = sub.add_parser("doctor",
                       help="check every kernel backend here against the fp32 reference")
    doctor.add_arguments(p)
    p.set_defaults(func=doctor.run)

    from megatron_ext.launch import slurm

    p = sub.add_parser("launch",
                       help="render an sbatch script for a preset on a cluster and submit it")
    slurm.add_arguments(p)
    p.set_defaults(func=slurm.run)

    p = sub.add_parser("presets", help="list the bundled presets and their sizes")
    p.set_defaults(func=_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as e:
        print(f"megatron-ext: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
