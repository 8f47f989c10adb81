"""``megatron-ext launch`` without a cluster: every profile x preset renders a script that bash
and shellcheck accept; a launch that would fail on the cluster is refused before submitting,
with the fix in the message; --dry-run submits nothing; a submit (through a fake ``sbatch`` on
PATH) returns the job id and leaves the script and the preset in the run directory."""

import os
import re
import shutil
import subprocess

import pytest
import yaml

from megatron_ext import cli
from megatron_ext.config import ConfigError
from megatron_ext.launch import clusters, presets, slurm
from megatron_ext.train import PREEMPTED_EXIT_CODE, RunSettings

CLUSTERS = list(clusters.PROFILES)
PRESETS = presets.list_presets()
SHELLCHECK = shutil.which("shellcheck")


def launch_options(cluster, preset, tmp_path, trainer="pretrain"):
    """A valid launch of ``preset`` on ``cluster`` (with a container where the profile has one;
    Megatron's mock data for the large presets, which refuse the standard-library corpus)."""
    options = {"mock_data": trainer == "pretrain" and preset != "tiny-hybrid"}
    if cluster == "generic":
        options["gpus_per_node"] = 8
    if clusters.PROFILES[cluster].container == "edf":
        edf = tmp_path / "image.toml"
        edf.write_text('image = "example/ngc-pytorch"\n')
        options["environment"] = str(edf)
    else:
        options.update(container_image="nvcr.io#nvidia/pytorch:25.01-py3",
                       container_mounts="/data:/data")
    nodes = 2
    if preset == "tiny-hybrid":  # global batch 16 = 8 x 2: at most 2 data-parallel ranks
        nodes, options["gpus_per_node"] = 1, 2
    return nodes, options


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("trainer", list(slurm.TRAINERS))
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("cluster", CLUSTERS)
def test_every_cluster_and_preset_renders_a_valid_script(cluster, preset, trainer, in_tmp):
    nodes, options = launch_options(cluster, preset, in_tmp, trainer)
    script = slurm.render(cluster, nodes, preset, account="a01", trainer=trainer, **options)
    run_dir = in_tmp / "runs" / preset
    profile = clusters.PROFILES[cluster]
    gpus = options.get("gpus_per_node", profile.gpus_per_node)
    for line in (f"#SBATCH --nodes={nodes}", f"#SBATCH --ntasks-per-node={gpus}",
                 f"#SBATCH --gpus-per-node={gpus}", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "#SBATCH --account=a01",
                 f"#SBATCH --signal=B:USR1@{slurm.DEFAULT_SIGNAL_SECONDS}",
                 f"#SBATCH --output={run_dir}/logs/%x-%j.out", f"RUN_DIR={run_dir}",
                 f"PREEMPTED_EXIT_CODE={PREEMPTED_EXIT_CODE}"):
        assert line in script.splitlines(), line
    assert "--partition" not in script  # only when given
    for option in profile.srun_options:
        assert f"    {option} \\" in script
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in script
    assert "RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS" in script
    exit_minutes = (12 * 3600 - slurm.DEFAULT_SIGNAL_SECONDS) // 60  # the default --time 12:00:00
    mock = " --mock-data" if options["mock_data"] else ""
    command = {"pretrain": 'exec megatron-ext pretrain --preset "$RUN_DIR/preset.yaml" '
                           f'--run-dir "$RUN_DIR"{mock} -- --exit-duration-in-mins {exit_minutes}\n',
               "train": 'exec megatron-ext train --preset "$RUN_DIR/preset.yaml" --run-dir '
                        '"$RUN_DIR" --resume\n'}[trainer]
    assert command in script
    assert 'kill -USR1 "$SRUN_PID"' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    # Nothing of this machine but the run directory (and the container given) is in the script.
    assert os.path.expanduser("~") not in script.replace(str(in_tmp), "")
    # #SBATCH lines are only read before the first command.
    first_command = next(i for i, line in enumerate(script.splitlines())
                         if line.strip() and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(script.splitlines())
               if line.startswith("#SBATCH"))

    path = in_tmp / "job.sbatch"
    path.write_text(script)
    subprocess.run(["bash", "-n", str(path)], check=True)
    if SHELLCHECK is None:
        pytest.skip("shellcheck is not installed (apt-get install -y shellcheck); "
                    "bash -n passed")
    result = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_alps_profile_uses_pmix_and_the_edf_on_srun(in_tmp):
    nodes, options = launch_options("alps-gh200", "hybrid-350m", in_tmp)
    script = slurm.render("alps-gh200", nodes, "hybrid-350m", **options)
    assert f"    --environment={options['environment']} \\" in script
    assert "--mpi=pmix" in script and "#SBATCH --environment" not in script
    assert "#SBATCH --cpus-per-task=72" in script
    assert "FI_PROVIDER" not in script.replace("FI_PROVIDER=cxi,", "")  # left to the image


def test_pyxis_mounts_the_run_directory_and_the_data(in_tmp):
    values = presets.load_preset("hybrid-350m")
    values["data"]["inputs"] = ["corpus"]  # relative to the launch directory
    (in_tmp / "corpus").mkdir()
    (in_tmp / "custom.yaml").write_text(yaml.safe_dump(values))
    script = slurm.render("h100-ib", 1, "custom.yaml", run_dir="exp/a",
                          container_image="img.sqsh", env={"NCCL_IB_HCA": "mlx5_0,mlx5_1"})
    exp, corpus = in_tmp / "exp", in_tmp / "corpus"
    assert f"--container-mounts={exp}:{exp},{corpus}:{corpus}" in script
    assert "export NCCL_IB_HCA=mlx5_0,mlx5_1" in script.splitlines()
    assert "#SBATCH --ntasks-per-node=8" in script


@pytest.mark.parametrize("cluster, nodes, options, overrides, message", [
    ("h100-ib", 1, {}, {"parallel": {"tensor": 3}},
     r"8 GPUs is not a multiple of parallel.tensor \(3\) x parallel.pipeline \(1\)"),
    ("h100-ib", 1, {}, {"parallel": {"tensor": 8}},
     r"model.num_query_groups=4 is not divisible by parallel.tensor=8"),
    ("alps-gh200", 2, {}, {"train": {"global_batch_size": 24, "micro_batch_size": 2}},
     r"global_batch_size=24 must be a multiple of .* = 16: set global_batch_size to 16"),
    ("alps-gh200", 1, {"pattern": "GG*"}, {}, r"pattern"),
    ("h100-ib", 3, {}, {"parallel": {"pipeline": 3}},
     r"does not build at parallel.tensor=1, pipeline=3.*\(pipeline stage 0\): num_layers=20"),
    ("h100-ib", 1, {}, {"model": {"hidden_size": 8192}, "ext": {"pattern": "*"},
                        "parallel": {"distributed_optimizer": False}},
     r"optimizer state of one GPU take \d+\.\d GiB, more than a h100-ib GPU's 74.5 GiB"),
    ("alps-gh200", 1, {}, {"data": {"inputs": ["no/such/corpus"]}},
     r"data input .*no/such/corpus does not exist"),
    ("alps-gh200", 0, {}, {}, r"--nodes 0: a job needs at least one node"),
    ("generic", 1, {}, {}, r"give --gpus-per-node"),
    ("h100-ib", 1, {"environment": "x.toml"}, {}, r"use --container-image"),
    ("alps-gh200", 1, {"container_image": "img"}, {}, r"--environment EDF"),
    ("alps-gh200", 1, {"environment": "missing.toml"}, {}, r"no such EDF file"),
    ("alps-gh200", 1, {"time": "90"}, {}, r"HH:MM:SS"),
    ("alps-gh200", 1, {"time": "00:05:00"}, {}, r"--signal-seconds 600 must be"),
])
def test_a_launch_that_would_fail_is_refused_with_the_fix(cluster, nodes, options, overrides,
                                                          message, in_tmp):
    values = presets.load_preset("hybrid-350m")
    for section, settings in overrides.items():
        values[section].update(settings)
    preset = in_tmp / "custom.yaml"
    preset.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError, match=message):
        slurm.render(cluster, nodes, str(preset), mock_data=True, **options)


@pytest.mark.parametrize("tracker", slurm.CHECKPOINT_TRACKERS)
def test_a_run_dir_with_checkpoints_of_other_settings_is_refused(tracker, in_tmp):
    run_dir = in_tmp / "runs" / "hybrid-350m"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / tracker).write_text("500\n")
    job = slurm.prepare("alps-gh200", 2, "hybrid-350m", mock_data=True)
    (run_dir / "preset.yaml").write_text(slurm.preset_yaml(job))
    slurm.render("alps-gh200", 2, "hybrid-350m", mock_data=True)  # the same settings: continues
    with pytest.raises(ConfigError, match="use a new --run-dir"):
        slurm.render("alps-gh200", 2, "hybrid-350m", pattern="GGG*" * 5, mock_data=True)


def fake_sbatch(tmp_path, monkeypatch, job_id="4242"):
    """An ``sbatch`` on PATH that records its arguments and prints a job id, as --parsable does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch_calls"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/sh\necho "$@" >> {calls}\necho "{job_id};cluster"\n')
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_dry_run_prints_the_script_and_submits_nothing(in_tmp, monkeypatch, capsys):
    calls = fake_sbatch(in_tmp, monkeypatch)
    exit_code = cli.main(["launch", "--cluster", "alps-gh200", "--nodes", "2", "--preset", "hybrid-350m",
                            "--mock-data", "--dry-run"])
    out = capsys.readouterr().out
    assert exit_code == 0
    assert out.startswith("#!/bin/bash\n") and "#SBATCH --nodes=2" in out
    assert not calls.exists() and not (in_tmp / "runs").exists()


def test_submit_returns_the_job_id_and_fills_the_run_dir(in_tmp, monkeypatch, capsys):
    calls = fake_sbatch(in_tmp, monkeypatch)
    exit_code = cli.main(["launch", "--cluster", "h100-ib", "--nodes", "1", "--preset", "tiny-hybrid",
                            "--gpus-per-node", "2", "--pattern", "GGG*", "--run-dir", "exp/one",
                            "--partition", "gpu", "--time", "01:00:00"])
    out = capsys.readouterr().out
    run_dir = in_tmp / "exp" / "one"
    assert exit_code == 0, out
    assert "submitted job 4242" in out and f"{run_dir}/logs/tiny-hybrid-4242.out" in out
    assert calls.read_text().split() == ["--parsable", str(run_dir / "job.sbatch")]
    script = (run_dir / "job.sbatch").read_text()
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --time=01:00:00" in script
    assert (run_dir / "logs").is_dir()
    # The preset in the run dir is the one the job trains: --pattern applied, loadable as is.
    settings = RunSettings.from_dict(presets.load_preset(str(run_dir / "preset.yaml")))
    assert settings.ext.pattern == "GGG*"
    assert settings.to_dict() == slurm.prepare(
        "h100-ib", 1, "tiny-hybrid", pattern="GGG*", gpus_per_node=2).settings.to_dict()
    assert slurm.submit(run_dir / "job.sbatch") == "4242"


def test_submit_without_sbatch_names_the_fix(in_tmp, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(in_tmp))  # no sbatch there
    exit_code = cli.main(["launch", "--cluster", "alps-gh200", "--nodes", "2", "--preset",
                            "hybrid-350m", "--mock-data"])
    assert exit_code == 2
    assert re.search(r"sbatch is not on PATH.*--dry-run", capsys.readouterr().err)



def test_large_preset_without_data_is_refused_before_the_queue(in_tmp, capsys):
    exit_code = cli.main(["launch", "--cluster", "alps-gh200", "--nodes", "2", "--preset",
                          "hybrid-350m", "--dry-run"])
    assert exit_code == 2
    err = capsys.readouterr().err
    assert "306M-parameter model would train on the Python standard library" in err
    assert "--data-path" in err and "--mock-data" in err


def test_megatron_flags_pass_through_to_every_task(in_tmp, capsys):
    """Flags after -- reach `megatron-ext pretrain` in the script, quoted; a --data-path among
    them counts as the run's data."""
    exit_code = cli.main(["launch", "--cluster", "h100-ib", "--nodes", "1", "--preset",
                          "hybrid-350m", "--dry-run", "--", "--use-distributed-optimizer",
                          "--data-path", "0.7", "/data/a doc", "0.3", "/data/b",
                          "--tokenizer-type", "SentencePieceTokenizer"])
    out = capsys.readouterr().out
    assert exit_code == 0, out
    assert ("-- --exit-duration-in-mins 710 --use-distributed-optimizer --data-path 0.7 "
            "'/data/a doc' 0.3 /data/b --tokenizer-type SentencePieceTokenizer\n") in out
    cache = in_tmp / "runs" / ".megatron-ext-cache"  # shared by the runs under runs/
    assert f"export TRITON_CACHE_DIR={cache}/triton" in out.splitlines()
    assert f"export MEGATRON_EXT_CACHE_DIR={cache}/megatron-ext" in out.splitlines()
    with pytest.raises(ConfigError, match="for --trainer pretrain"):
        slurm.render("h100-ib", 1, "tiny-hybrid", gpus_per_node=2, trainer="train",
                     megatron_args=["--use-distributed-optimizer"])


def test_memory_per_gpu(in_tmp):
    """hybrid-3b on 2 x 4 GH200 (8 data-parallel ranks): the distributed optimizer is on, so a
    GPU holds 2 + 4 bytes a parameter and 12 / 8 of Adam's; without it all 18."""
    from megatron_ext.launch.presets import parameter_count

    nodes, options = launch_options("alps-gh200", "hybrid-3b", in_tmp)
    job = slurm.prepare("alps-gh200", nodes, "hybrid-3b", **options)
    count = parameter_count("hybrid-3b")
    assert job.memory.parameters == count and job.memory.stage_parameters == [count]
    assert job.memory.state_gib == pytest.approx(count * (6 + 12 / 8) / 2**30)
    job.settings.parallel.distributed_optimizer = False
    assert slurm.memory_per_gpu(job).state_gib == pytest.approx(count * 18 / 2**30)


@pytest.mark.parametrize("parallel", [{"pipeline": 2}, {"pipeline": 2, "virtual_pipeline": 2},
                                      {"tensor": 2, "pipeline": 2}, {"context": 2}])
def test_stages_are_built_at_the_jobs_layout(parallel):
    """Each pipeline stage is built on the meta device as its first rank builds it: the
    stages of a pipeline hold the whole model between them (untied embeddings), and tensor
    parallelism halves what a GPU holds, less the replicated norms."""
    settings = presets.load_settings("hybrid-1.3b")
    for name, value in parallel.items():
        setattr(settings.parallel, name, value)
    stages = presets.stage_parameters(settings)
    whole = presets.parameter_count("hybrid-1.3b")
    assert len(stages) == settings.parallel.pipeline
    tensor = settings.parallel.tensor
    assert whole / tensor <= sum(stages) < whole / tensor * 1.01


def test_activation_estimate_against_the_measured_peaks():
    """The estimate (with the exact state of one GPU without the distributed optimizer) against
    the peak memory benchmarks/throughput.py measured on one H200: the docstring of
    memory_per_gpu says how close it is; this keeps it true for the current results."""
    import json
    import pathlib

    results = pathlib.Path(__file__).parents[2] / "benchmarks/results/throughput_h200.json"
    rows = json.loads(results.read_text())["rows"]
    assert rows
    for row in rows:
        settings = presets.load_settings(row["preset"])
        settings.ext.pattern = row["pattern"]
        settings.model.seq_length = row["seq_length"]
        settings.train.micro_batch_size = row["micro_batch"]
        estimate = (presets.parameter_count(settings) * 18 + slurm.activation_bytes(settings)) / 2**30
        assert -0.2 < estimate / row["peak_gib"] - 1 < 0.05, row
