"""The rendered Slurm job end to end, on the CPU, with a fake Slurm on PATH.

``megatron-ext launch`` renders the job script for the ``generic`` cluster, 1 node x 2 "GPUs",
on a tiny preset with parallel.tensor=2. The script runs as the batch shell would (bash, with
Slurm's variables); a fake ``srun`` starts the two tasks (two gloo processes, tensor-parallel),
and a fake ``scontrol`` resolves the node list and records a requeue. SIGUSR1 to the batch shell
(Slurm's ``--signal=B:USR1@...``) makes the training save and exit with PREEMPTED_EXIT_CODE, the
script requeues the job, and the requeued job resumes and continues exactly the curve of an
uninterrupted job -- which itself equals a one-process TP=1 run of the same model (the gradient
norm that clipping uses is the full model's on every TP rank).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import yaml

import harness
from megatron_ext.launch import slurm
from megatron_ext.train import PREEMPTED_EXIT_CODE

pytestmark = pytest.mark.dist

STEPS = 12
# clip_grad well below the gradient norm (~1): clipping is active at every step.
PRESET = {**harness.tiny_preset(steps=STEPS, clip_grad=0.1, eval_interval=6, save_interval=3),
          "parallel": {"tensor": 2}}

SRUN = r"""#!/bin/bash
# Fake srun: skip the options, start $SLURM_NTASKS copies of the command, forward SIGUSR1.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
    SLURM_PROCID=$i SLURM_LOCALID=$i "$@" &
    pids+=($!)
done
forward() { kill -USR1 "${pids[@]}" 2>/dev/null; }
trap forward USR1
status=0
for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do wait "$pid"; done
    wait "$pid"
    rc=$?
    if [ "$status" -eq 0 ]; then status=$rc; fi
done
exit "$status"
"""

SCONTROL = r"""#!/bin/bash
# Fake scontrol: one node (this machine); requeues are recorded.
case "$1" in
    show) echo 127.0.0.1 ;;
    requeue) echo "$2" >> "$FAKE_SLURM_REQUEUES" ;;
    *) echo "fake scontrol: $*" >&2; exit 1 ;;
esac
"""


def _free_job_id() -> int:
    """A job id whose MASTER_PORT (20000 + id % 40000, as the script computes it) is free."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if 20000 <= port < 60000:
            return 40000 + port - 20000  # a job id past 40000, for realism
    pytest.skip("no free port in 20000..59999")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm_e2e")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    settings = json.loads(json.dumps(PRESET))
    settings["data"].update(output_dir=str(root / "data"),
                            inputs=[str(stdlib / "email"), str(stdlib / "json")])
    preset = root / "tiny-tp2.yaml"
    preset.write_text(yaml.safe_dump(settings))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL),
                       ("sbatch", "#!/bin/bash\necho 'fake sbatch: not used' >&2\nexit 1\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return root, preset, bin_dir


def _render(setup, name):
    root, preset, _ = setup
    job = slurm.prepare("generic", 1, str(preset), run_dir=root / name, gpus_per_node=2,
                        cpus_per_task=1, time="00:30:00", signal_seconds=60, trainer="train")
    return slurm.write_run_dir(job)


def _start_job(setup, script, job_id, restart=0):
    root, _, bin_dir = setup
    env = dict(os.environ)
    env.update(
        PATH=os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), env["PATH"]]),
        SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="node001", SLURM_CPUS_PER_TASK="1",
        SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_RESTART_COUNT=str(restart),
        FAKE_SLURM_REQUEUES=str(script.parent / "requeues.txt"))
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT"):
        env.pop(name, None)
    log = open(script.parent / "logs" / f"tiny-tp2-{job_id}.out", "a")
    return subprocess.Popen(["bash", str(script)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=root)


def _finish(process, script, timeout=240):
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
    logs = "".join(p.read_text() for p in (script.parent / "logs").glob("*.out"))
    return process.returncode, logs


def _train_losses(run_dir):
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_requeued_job_resumes_the_same_curve_as_an_uninterrupted_job(setup):
    root, preset, _ = setup

    # An uninterrupted job.
    straight = _render(setup, "straight")
    rc, logs = _finish(_start_job(setup, straight, _free_job_id()), straight)
    assert rc == 0, logs[-4000:]
    assert not (straight.parent / "requeues.txt").exists()
    expected = _train_losses(straight.parent)
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert sorted(p.name for p in (straight.parent / "checkpoints" / f"iter_{STEPS:07d}" /
                                   "model").iterdir()) == ["model_rank00000.pt",
                                                           "model_rank00001.pt"]

    # The same job, warned of its time limit after a couple of steps.
    script = _render(setup, "requeued")
    run_dir, job_id = script.parent, _free_job_id()
    process = _start_job(setup, script, job_id)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None and time.time() < deadline, _finish(process, script)
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    rc, logs = _finish(process, script)
    assert rc == PREEMPTED_EXIT_CODE, logs[-4000:]
    assert (run_dir / "requeues.txt").read_text().split() == [str(job_id)], logs[-4000:]
    assert "requeueing job" in logs
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text())
    assert 2 <= stopped_at < STEPS, logs[-4000:]

    # Slurm starts the requeued job: same script, same job id, restart count 1.
    rc, logs = _finish(_start_job(setup, script, job_id, restart=1), script)
    assert rc == 0, logs[-4000:]
    assert f"resuming from step {stopped_at}" in logs
    assert (run_dir / "requeues.txt").read_text().split() == [str(job_id)]
    resumed = _train_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in expected:
        assert resumed[step] == pytest.approx(expected[step], rel=1e-6), step

    # One process with the whole model (TP=1) follows the same curve: TP=2 computes the same
    # model and clips by the same (full-model) gradient norm. Only the order of floating-point
    # sums differs, hence the looser tolerance.
    tp1 = yaml.safe_load(preset.read_text())
    tp1["parallel"]["tensor"] = 1
    tp1_preset = root / "tiny-tp1.yaml"
    tp1_preset.write_text(yaml.safe_dump(tp1))
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(tp1_preset),
         "--run-dir", str(root / "tp1"), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    single = _train_losses(root / "tp1")
    records = [json.loads(line) for line in open(root / "tp1" / "metrics.jsonl")]
    assert all(r["grad_norm"] > 5 * 0.1 for r in records if r["kind"] == "train")  # clipping
    for step in expected:
        assert expected[step] == pytest.approx(single[step], rel=1e-5), step
