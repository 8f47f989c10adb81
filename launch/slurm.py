"""``megatron-ext launch``: render an sbatch script for a preset on a cluster, and submit it.

    megatron-ext launch --cluster {alps-gh200,h100-ib,generic} --nodes N --preset NAME
        [--pattern P] [--run-dir DIR] [--time HH:MM:SS] [--account A] [--partition P]
        [--gpus-per-node G] [--cpus-per-task C] [--environment EDF]
        [--container-image IMAGE] [--container-mounts SRC:DST,...] [--venv DIR]
        [--env NAME=VALUE ...] [--signal-seconds S] [--trainer pretrain|train] [--dry-run]

The script comes from ``slurm/job.sbatch.tmpl`` and the cluster profile
(:mod:`megatron_ext.launch.clusters`). Before anything is submitted the launch is checked:
GPUs x nodes against the preset's tensor x pipeline sizes, the global batch against
micro-batch x data-parallel size, the preset itself (pattern length, schedule), the data inputs.
On submit, the run directory receives ``preset.yaml`` (the preset with ``--pattern`` applied
and data paths made absolute), ``job.sbatch`` and ``logs/``; every task runs
``megatron-ext pretrain --preset RUN_DIR/preset.yaml --run-dir RUN_DIR`` (Megatron's training
loop, which resumes from RUN_DIR/checkpoints by itself), or with ``--trainer train``
``megatron-ext train ... [--resume]`` (our small loop, which also runs on CPUs).
``--dry-run`` prints the script and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import re
import shlex
import shutil
import string
import subprocess
import sys

import yaml

from megatron_ext.config import ConfigError
from megatron_ext.launch.clusters import PROFILES, ClusterProfile, get_profile

# The templates live in the source tree's slurm/ folder, next to launch/.
# slurm/ is installed as megatron_ext.slurm (setup.py), so the template ships with the package.
TEMPLATE_DIR = pathlib.Path(importlib.import_module("megatron_ext.slurm").__file__).parent
TEMPLATE = "job.sbatch.tmpl"

DEFAULT_TIME = "12:00:00"
DEFAULT_SIGNAL_SECONDS = 600  # swiss-ai's Alps launcher: --signal=SIGUSR2@600

_TIME = re.compile(r"^(?:(\d+)-)?(\d+):(\d{2}):(\d{2})$")  # [D-]HH:MM:SS
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Slurm expands % in --output paths and sbatch splits #SBATCH lines at whitespace.
_UNSAFE_PATH = re.compile(r"[\s%'\"\\$`]")


class SbatchTemplate(string.Template):
    """``${lower_case}`` names are placeholders; bash's ``$VAR`` and ``${UPPER_CASE}`` pass
    through untouched, so the template is written as plain bash."""

    flags = 0
    pattern = r"""
        \$(?:
          (?P<escaped>(?!)) |
          (?P<named>(?!)) |
          \{(?P<braced>[a-z][a-z0-9_]*)\} |
          (?P<invalid>(?!))
        )
    """


@dataclasses.dataclass
class LaunchOptions:
    """What ``megatron-ext launch`` takes besides the cluster, nodes, preset and run dir."""

    pattern: str | None = None
    time: str = DEFAULT_TIME
    account: str | None = None
    partition: str | None = None
    gpus_per_node: int | None = None  # default: the profile's
    cpus_per_task: int | None = None  # default: the profile's
    environment: str | None = None  # CSCS EDF (alps-gh200)
    container_image: str | None = None  # pyxis (h100-ib, generic)
    container_mounts: str | None = None
    venv: str | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    signal_seconds: int = DEFAULT_SIGNAL_SECONDS
    trainer: str = "pretrain"  # one of TRAINERS
    mock_data: bool = False  # pretrain: Megatron's mock data (a speed run)
    megatron_args: list[str] = dataclasses.field(default_factory=list)  # pretrain: after "--"


TRAINERS = {
    # Megatron's loop; it resumes from RUN_DIR/checkpoints when a checkpoint is there. Besides
    # SIGUSR1, Megatron's own clock stops it (saving first) when the signal would have come.
    "pretrain": ('    exec megatron-ext pretrain --preset "$RUN_DIR/preset.yaml" --run-dir "$RUN_DIR"'
                 '{mock_data} -- --exit-duration-in-mins {exit_minutes}{megatron_args}\n'),
    "train": ('    if [ "$MEGATRON_EXT_RESUME" = 1 ]; then\n'
              '        exec megatron-ext train --preset "$RUN_DIR/preset.yaml" --run-dir "$RUN_DIR" '
              '--resume\n'
              '    fi\n'
              '    exec megatron-ext train --preset "$RUN_DIR/preset.yaml" --run-dir "$RUN_DIR"\n'),
}
"""The training command every task runs, by ``--trainer`` (``{exit_minutes}``: the minutes from
the start of the job to Slurm's warning signal; ``{mock_data}`` and ``{megatron_args}``: the
launch's ``--mock-data`` and its Megatron flags after ``--``, which win over the preset's)."""

CHECKPOINT_TRACKERS = ("latest", "latest_checkpointed_iteration.txt")
"""Written into RUN_DIR/checkpoints after each complete save: by megatron-ext train, and by
Megatron's loop (megatron-ext pretrain)."""


@dataclasses.dataclass
class MemoryEstimate:
    """Memory per GPU of the fullest pipeline stage (see :func:`memory_per_gpu`)."""

    parameters: int  # the whole model
    stage_parameters: list[int]  # one GPU of each pipeline stage
    state_gib: float  # weights, gradients and optimizer state: exact
    activation_gib: float  # activations and logits: an estimate

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activation_gib


@dataclasses.dataclass
class Job:
    """A checked launch: everything :func:`render` writes into the script."""

    profile: ClusterProfile
    nodes: int
    preset_name: str
    run_dir: pathlib.Path
    settings: object  # megatron_ext.train.RunSettings
    options: LaunchOptions
    memory: MemoryEstimate | None = None  # set by check()

    @property
    def gpus_per_node(self) -> int:
        return self.options.gpus_per_node or self.profile.gpus_per_node

    @property
    def cpus_per_task(self) -> int:
        return self.options.cpus_per_task or self.profile.cpus_per_task

    @property
    def script_path(self) -> pathlib.Path:
        return self.run_dir / "job.sbatch"


# ---------------------------------------------------------------------------- checks
def _seconds(time: str) -> int:
    match = _TIME.match(time)
    if match is None:
        raise ConfigError(f"--time {time!r} is not of the form HH:MM:SS (or D-HH:MM:SS)")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    if minutes > 59 or seconds > 59:
        raise ConfigError(f"--time {time!r}: minutes and seconds must be below 60")
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _preset_stem(preset_name: str) -> str:
    path = pathlib.Path(preset_name)
    return path.stem if path.suffix in (".yaml", ".yml") else path.name


def load_run_settings(preset_name: str, pattern: str | None = None):
    """The preset's RunSettings with the pattern override and data paths made absolute."""
    from megatron_ext.launch.presets import load_preset
    from megatron_ext.train import RunSettings

    settings = RunSettings.from_dict(load_preset(preset_name))
    if pattern is not None:
        settings.ext.pattern = pattern
    d = settings.data
    if d.inputs is not None:
        inputs = [d.inputs] if isinstance(d.inputs, str) else list(d.inputs)
        d.inputs = [str(pathlib.Path(p).expanduser().resolve()) for p in inputs]
    if d.output_dir is not None:
        d.output_dir = str(pathlib.Path(d.output_dir).expanduser().resolve())
    return settings


def check(job: Job) -> Job:
    """Everything that would make the job fail on the cluster; errors name the fix."""
    p, o, s = job.profile, job.options, job.settings
    if o.trainer not in TRAINERS:
        raise ConfigError(f"--trainer {o.trainer!r} is not one of {list(TRAINERS)}")
    if job.nodes < 1:
        raise ConfigError(f"--nodes {job.nodes}: a job needs at least one node")
    if job.gpus_per_node is None:
        raise ConfigError(f"cluster profile {p.name!r} has no fixed GPU count per node: "
                          "give --gpus-per-node")
    if job.gpus_per_node < 1 or job.cpus_per_task < 1:
        raise ConfigError("--gpus-per-node and --cpus-per-task must be >= 1")
    if _UNSAFE_PATH.search(str(job.run_dir)):
        raise ConfigError(f"--run-dir {str(job.run_dir)!r} contains whitespace, quotes, '$', '\\' "
                          "or '%' (Slurm expands % in log paths): choose a plainer path")
    limit = _seconds(o.time)
    if not 0 < o.signal_seconds < limit:
        raise ConfigError(f"--signal-seconds {o.signal_seconds} must be > 0 and below the time "
                          f"limit --time {o.time} ({limit} s)")

    tp, pp, cp = s.parallel.tensor, s.parallel.pipeline, s.parallel.context
    world = job.nodes * job.gpus_per_node
    if world % (tp * pp * cp):
        raise ConfigError(
            f"{job.nodes} node(s) x {job.gpus_per_node} GPUs = {world} GPUs is not a multiple of "
            f"parallel.tensor ({tp}) x parallel.pipeline ({pp}) x parallel.context ({cp}) = "
            f"{tp * pp * cp}: change --nodes, or the preset's parallel section so that their "
            f"product divides {world}")
    dp = world // (tp * pp * cp)

    # The preset: schedule, batch vs micro-batch, pattern vs layers, head counts vs TP, mixer
    # settings, data.
    s.validate()
    if o.trainer == "pretrain":
        from megatron_ext.pretrain import check_data_source

        check_data_source(s, mock_data=o.mock_data, megatron_args=o.megatron_args)
    elif o.mock_data or o.megatron_args:
        raise ConfigError("--mock-data and Megatron flags after -- are for --trainer pretrain")
    t = s.train
    if t.global_batch_size % (t.micro_batch_size * dp):
        step = t.micro_batch_size * dp
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size ({t.micro_batch_size}) x data-parallel size ({dp} = {world} "
            f"GPUs / (tensor {tp} x pipeline {pp} x context {cp})) = {step}: set global_batch_size to "
            f"{max(step, t.global_batch_size // step * step)}, lower micro_batch_size, or "
            f"change --nodes")
    for path in s.data.inputs or ():
        if not pathlib.Path(path).exists():
            raise ConfigError(f"data input {path} does not exist: fix data.inputs in the preset "
                              "(paths are relative to the directory you launch from)")

    # Containers: each profile has one kind.
    if p.container != "edf" and o.environment:
        raise ConfigError(f"--environment (a CSCS container EDF) is for alps-gh200; on "
                          f"{p.name} use --container-image (pyxis)")
    if p.container != "pyxis" and (o.container_image or o.container_mounts):
        raise ConfigError(f"--container-image/--container-mounts are pyxis options; on "
                          f"{p.name} give the container as --environment EDF")
    if o.container_mounts and not o.container_image:
        raise ConfigError("--container-mounts needs --container-image")
    if o.environment and _is_path(o.environment) and not pathlib.Path(o.environment).is_file():
        raise ConfigError(f"--environment {o.environment}: no such EDF file (give a .toml path, "
                          "or the name of an EDF in ~/.edf)")
    if o.venv and not (pathlib.Path(o.venv) / "bin" / "activate").is_file():
        raise ConfigError(f"--venv {o.venv}: no bin/activate there; give a virtual environment "
                          "with megatron-ext installed (visible inside the container)")
    for name in o.env:
        if not _ENV_NAME.match(name):
            raise ConfigError(f"--env {name}=...: {name!r} is not a variable name")

    # A run directory that already holds a run continues it: the settings must be the same.
    existing = job.run_dir / "preset.yaml"
    has_checkpoints = any((job.run_dir / "checkpoints" / tracker).exists()
                          for tracker in CHECKPOINT_TRACKERS)
    if has_checkpoints and existing.exists():
        with open(existing) as f:
            if yaml.safe_load(f) != s.to_dict():
                raise ConfigError(
                    f"{job.run_dir} holds checkpoints of a run with other settings "
                    f"({existing}); use a new --run-dir, or the same preset and --pattern")

    # The model as each pipeline stage builds it (the constructors' own checks), and whether
    # its training state fits.
    job.memory = memory_per_gpu(job)
    capacity = p.gpu_memory_gb * 1e9 / 2**30 if p.gpu_memory_gb else None
    if capacity is not None and job.memory.state_gib > capacity:
        raise ConfigError(
            f"the weights, gradients and optimizer state of one GPU take "
            f"{job.memory.state_gib:.1f} GiB, more than a {p.name} GPU's {capacity:.1f} GiB: "
            "turn on parallel.distributed_optimizer (with data parallelism), or raise "
            "parallel.tensor or parallel.pipeline")
    return job


# Bytes a layer keeps for the backward per token, in units of the hidden size, at TP = 1 with
# flash attention: Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
# Transformer Models", table 2) less the score-matrix terms; with TP t: 10 + 24 / t, and with
# sequence parallelism 34 / t.
LAYER_BYTES_PER_HIDDEN = 34
# Bytes per token per vocabulary entry of the output layer: its bf16 logits and, in the backward,
# their bf16 gradient (megatron_ext.cross_entropy keeps no fp32 copy of either).
LOGIT_BYTES = 4


def memory_per_gpu(job: Job) -> MemoryEstimate:
    """Memory per GPU of the job's fullest pipeline stage.

    State (exact, from the stage's parameters built on the meta device by
    :func:`megatron_ext.launch.presets.stage_parameters`): bf16 weights (2 bytes a parameter),
    fp32 gradients (4) and Adam's fp32 master weights and two moments (12), the last divided over
    the data-parallel ranks with the distributed optimizer.

    Activations (an estimate): per layer and token of a micro-batch
    :data:`LAYER_BYTES_PER_HIDDEN` x hidden size (divided as above under TP / SP; context
    parallelism divides the tokens), for the micro-batches 1F1B keeps in flight on the stage
    (pipeline size - stage index); full recompute keeps each layer's input and one layer's
    activations; plus the last stage's logits (:data:`LOGIT_BYTES` x vocabulary / TP per token).
    Every layer is counted as a transformer layer: against the 1-GPU peaks measured by
    ``benchmarks/throughput.py`` (``benchmarks/results/throughput_h200.json``) the estimate is
    within a few percent for all-softmax models and low for hybrids, whose linear-recurrent
    layers keep more per token (tests/recipes/test_launch.py checks it against those rows).
    """
    from megatron_ext.launch.presets import parameter_count, stage_parameters

    s, o = job.settings, job.options
    p, t = s.parallel, s.train
    data_parallel = job.nodes * job.gpus_per_node // (p.tensor * p.pipeline * p.context)
    distributed = ("--use-distributed-optimizer" in o.megatron_args or p.distributed_optimizer
                   or (p.distributed_optimizer is None and data_parallel > 1))
    stages = stage_parameters(s)
    state = max(stages) * (2 + 4 + 12 / (data_parallel if distributed else 1))
    micro_batches = t.global_batch_size // (t.micro_batch_size * data_parallel)
    activations = max(activation_bytes(s, stage, micro_batches) for stage in range(p.pipeline))
    return MemoryEstimate(parameter_count(s), stages, state / 2**30, activations / 2**30)


def activation_bytes(settings, stage: int = 0, micro_batches: int = 1) -> float:
    """The activation estimate of :func:`memory_per_gpu` for one GPU of pipeline ``stage``."""
    from megatron_ext.train import _padded_vocab

    p, m = settings.parallel, settings.model
    tokens = settings.train.micro_batch_size * m.seq_length / p.context
    sequence_parallel = p.sequence_parallel and p.tensor > 1
    per_hidden = (LAYER_BYTES_PER_HIDDEN / p.tensor if sequence_parallel or p.tensor == 1
                  else 10 + 24 / p.tensor)
    layer = per_hidden * m.hidden_size * tokens
    layers = m.num_layers // p.pipeline
    if p.recompute == "full":  # the layers' inputs, and one layer recomputed at a time
        kept = layers * 2 * m.hidden_size * tokens / (p.tensor if sequence_parallel else 1)
        per_micro_batch, once = kept, layer
    else:
        per_micro_batch, once = layers * layer, 0.0
    in_flight = min(p.pipeline - stage, micro_batches)
    total = per_micro_batch * in_flight + once
    if stage == p.pipeline - 1:
        total += LOGIT_BYTES * tokens * _padded_vocab(settings.data.vocab_size, p.tensor) / p.tensor
    return total


def _is_path(environment: str) -> bool:
    return "/" in environment or environment.endswith(".toml")


# ---------------------------------------------------------------------------- rendering
def prepare(profile: ClusterProfile | str, nodes: int, preset_name: str,
            run_dir: str | pathlib.Path | None = None, **options) -> Job:
    """The checked :class:`Job` (``options``: the fields of :class:`LaunchOptions`)."""
    if isinstance(profile, str):
        profile = get_profile(profile)
    o = LaunchOptions(**options)
    if o.environment and _is_path(o.environment):
        o.environment = str(pathlib.Path(o.environment).expanduser().resolve())
    if o.venv:
        o.venv = str(pathlib.Path(o.venv).expanduser().resolve())
    stem = _preset_stem(preset_name)
    run_dir = pathlib.Path(run_dir if run_dir is not None else f"runs/{stem}")
    job = Job(profile=profile, nodes=nodes, preset_name=preset_name,
              run_dir=run_dir.expanduser().resolve(),
              settings=load_run_settings(preset_name, o.pattern), options=o)
    return check(job)


def _srun_options(job: Job) -> list[str]:
    o = job.options
    options = list(job.profile.srun_options)
    if o.environment:
        options.append(f"--environment={o.environment}")
    if o.container_image:
        # The run directory's parent holds the run and the default data folder (../data).
        mounts = [m for m in (o.container_mounts or "").split(",") if m]
        mounts.append(f"{job.run_dir.parent}:{job.run_dir.parent}")
        mounts += [f"{path}:{path}" for path in job.settings.data.inputs or ()]
        if o.venv:
            mounts.append(f"{o.venv}:{o.venv}")
        options += [f"--container-image={o.container_image}",
                    f"--container-mounts={','.join(mounts)}",
                    # enroot's root file system is read-only by default (ENROOT_ROOTFS_WRITABLE)
                    "--container-writable"]
    return options


def render_job(job: Job) -> str:
    # The training's exit status after saving on SIGUSR1/SIGTERM: the script requeues on it.
    from megatron_ext.train import PREEMPTED_EXIT_CODE

    o, p = job.options, job.profile
    optional = [f"#SBATCH --{name}={value}" for name, value in
                (("account", o.account), ("partition", o.partition)) if value]
    env_lines = [f"# {line}" for line in p.env_notes]
    # Triton's compiled kernels and megatron-ext's kernel self-checks, shared by the runs under
    # the same parent folder (not the home directory, slow or small on most clusters).
    cache = job.run_dir.parent / ".megatron-ext-cache"
    env = {"TRITON_CACHE_DIR": str(cache / "triton"),
           "MEGATRON_EXT_CACHE_DIR": str(cache / "megatron-ext"), **p.env, **o.env}
    if o.venv:
        env["MEGATRON_EXT_VENV"] = o.venv
    env_lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
    values = {
        "profile": p.name,
        "script_path": shlex.quote(str(job.script_path)),
        "job_name": _preset_stem(job.preset_name),
        "nodes": job.nodes,
        "gpus_per_node": job.gpus_per_node,
        "cpus_per_task": job.cpus_per_task,
        "time": o.time,
        "signal_seconds": o.signal_seconds,
        "run_dir": str(job.run_dir),
        "run_dir_quoted": shlex.quote(str(job.run_dir)),
        "preempted_exit_code": PREEMPTED_EXIT_CODE,
        "optional_sbatch": "\n".join(optional),
        "cluster_env": "\n".join(env_lines),
        "srun_options": "".join(f"    {shlex.quote(opt)} \\\n" for opt in _srun_options(job)),
        "activate": ('    . "$MEGATRON_EXT_VENV/bin/activate"\n' if o.venv else ""),
        "train_command": TRAINERS[o.trainer].format(
            exit_minutes=max(1, (_seconds(o.time) - o.signal_seconds) // 60),
            mock_data=" --mock-data" if o.mock_data else "",
            megatron_args="".join(f" {shlex.quote(arg)}" for arg in o.megatron_args)),
    }
    template = (TEMPLATE_DIR / TEMPLATE).read_text()
    # A placeholder alone on its line that renders empty leaves no blank line behind.
    lines = [line for line in template.splitlines(keepends=True)
             if not (line.strip().startswith("${") and line.strip().endswith("}")
                     and values.get(line.strip()[2:-1]) == "")]
    return SbatchTemplate("".join(lines)).substitute(values)


def render(profile: ClusterProfile | str, nodes: int, preset_name: str,
           run_dir: str | pathlib.Path | None = None, **options) -> str:
    """The sbatch script for ``preset_name`` on ``nodes`` nodes of ``profile``, after
    :func:`check`. ``options``: the fields of :class:`LaunchOptions`."""
    return render_job(prepare(profile, nodes, preset_name, run_dir, **options))


def preset_yaml(job: Job) -> str:
    header = (f"# Written by megatron-ext launch from preset {job.preset_name!r}"
              + (f" with --pattern {job.options.pattern!r}" if job.options.pattern else "")
              + ".\n# The job trains with exactly these settings; edit with care once it has "
              "checkpoints.\n")
    return header + yaml.safe_dump(job.settings.to_dict(), sort_keys=False)


def write_run_dir(job: Job) -> pathlib.Path:
    """Writes preset.yaml, job.sbatch and logs/ into the run directory; returns the script."""
    (job.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (job.run_dir / "preset.yaml").write_text(preset_yaml(job))
    job.script_path.write_text(render_job(job))
    return job.script_path


def submit(script_path: str | pathlib.Path) -> str:
    """``sbatch --parsable SCRIPT``; returns the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("sbatch is not on PATH: run on a Slurm login node, or use --dry-run "
                          "to print the script")
    result = subprocess.run([sbatch, "--parsable", str(script_path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise ConfigError(f"sbatch failed (exit {result.returncode}): "
                          f"{(result.stderr or result.stdout).strip()}")
    # --parsable prints "JOBID" or "JOBID;CLUSTER".
    job_id = result.stdout.strip().splitlines()[-1].split(";")[0] if result.stdout.strip() else ""
    if not job_id.isdigit():
        raise ConfigError(f"sbatch printed no job id: {result.stdout!r}")
    return job_id


# ---------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", required=True, choices=list(PROFILES),
                        help="cluster profile (see slurm/README.md)")
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--preset", required=True, help="preset name or YAML file")
    parser.add_argument("--pattern", default=None, help="override the preset's layer pattern")
    parser.add_argument("--run-dir", default=None,
                        help="default: runs/<preset> under the current directory")
    parser.add_argument("--time", default=DEFAULT_TIME, help="wall time, HH:MM:SS or D-HH:MM:SS")
    parser.add_argument("--account", default=None)
    parser.add_argument("--partition", default=None)
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="required for --cluster generic; default: the profile's")
    parser.add_argument("--cpus-per-task", type=int, default=None,
                        help="CPU cores per GPU task; default: the profile's")
    parser.add_argument("--environment", default=None, metavar="EDF",
                        help="alps-gh200: CSCS container environment file (srun --environment)")
    parser.add_argument("--container-image", default=None,
                        help="h100-ib/generic: pyxis image (srun --container-image)")
    parser.add_argument("--container-mounts", default=None, metavar="SRC:DST,...",
                        help="extra pyxis mounts; the run directory's parent and the data inputs "
                             "are always mounted")
    parser.add_argument("--venv", default=None,
                        help="virtual environment with megatron-ext, activated by every task")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="export this in the job (repeatable), e.g. NCCL_IB_HCA=mlx5_0")
    parser.add_argument("--signal-seconds", type=int, default=DEFAULT_SIGNAL_SECONDS,
                        help="SIGUSR1 this many seconds before the time limit (checkpoint, requeue)")
    parser.add_argument("--trainer", choices=list(TRAINERS), default="pretrain",
                        help="pretrain: Megatron's training loop (default); train: megatron-ext's "
                             "small loop (also runs on CPUs)")
    parser.add_argument("--mock-data", action="store_true",
                        help="pretrain on Megatron's mock data (a speed run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the script; write nothing, submit nothing")
    parser.add_argument("megatron_args", nargs=argparse.REMAINDER,
                        help="after --: Megatron flags for every task's `megatron-ext pretrain` "
                             "(e.g. -- --use-distributed-optimizer --data-path ...)")


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r} is not NAME=VALUE")
        env[name] = value
    return env


def run(args: argparse.Namespace) -> int:
    """``megatron-ext launch`` with parsed arguments (:func:`add_arguments`); the exit code."""
    try:
        job = prepare(
            args.cluster, args.nodes, args.preset, args.run_dir, pattern=args.pattern,
            time=args.time, account=args.account, partition=args.partition,
            gpus_per_node=args.gpus_per_node, cpus_per_task=args.cpus_per_task,
            environment=args.environment, container_image=args.container_image,
            container_mounts=args.container_mounts, venv=args.venv,
            env=_parse_env(args.env), signal_seconds=args.signal_seconds, trainer=args.trainer,
            mock_data=args.mock_data,
            megatron_args=args.megatron_args[1:] if args.megatron_args[:1] == ["--"]
            else args.megatron_args)
        memory = job.memory
        print(f"megatron-ext launch: {memory.parameters / 1e6:,.1f}M parameters; per GPU "
              f"(fullest pipeline stage, {max(memory.stage_parameters) / 1e6:,.1f}M): "
              f"{memory.state_gib:.1f} GiB of weights, gradients and optimizer state + "
              f"~{memory.activation_gib:.1f} GiB of activations (estimate) = "
              f"~{memory.total_gib:.1f} GiB", file=sys.stderr)
        if job.profile.gpu_memory_gb and memory.total_gib * 2**30 > job.profile.gpu_memory_gb * 1e9:
            print(f"megatron-ext launch: warning: that is more than a {job.profile.name} GPU's "
                  f"{job.profile.gpu_memory_gb:g} GB; if the job runs out of memory, lower "
                  "train.micro_batch_size or set parallel.recompute (or raise parallel.tensor / "
                  "parallel.pipeline)", file=sys.stderr)
        if args.dry_run:
            print(render_job(job), end="")
            return 0
        script = write_run_dir(job)
        job_id = submit(script)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"megatron-ext launch: error: {error}", file=sys.stderr)
        return 2
    print(f"submitted job {job_id}: {script}")
    print(f"log: {job.run_dir / 'logs' / f'{_preset_stem(job.preset_name)}-{job_id}.out'}")
    return 0

