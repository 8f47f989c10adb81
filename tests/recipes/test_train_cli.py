"""`megatron-ext train` end to end on the CPU: it trains, saves, and a stopped run resumed from
its checkpoint continues exactly the curve of an uninterrupted run."""

import json
import subprocess
import sys

import pytest
import yaml

import harness

PRESET = harness.tiny_preset(steps=6, eval_interval=3, save_interval=3)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    import sysconfig
    from pathlib import Path

    root = tmp_path_factory.mktemp("train")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    settings = dict(PRESET)
    # A small corpus keeps tokenizer training and indexing to a few seconds.
    settings["data"] = dict(PRESET["data"], output_dir=str(root / "data"),
                            inputs=[str(stdlib / "email"), str(stdlib / "json")])
    path = root / "preset.yaml"
    path.write_text(yaml.safe_dump(settings))
    return root, path


def _train(preset_path, run_dir, *extra):
    cmd = [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(preset_path),
           "--run-dir", str(run_dir), "--device", "cpu", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _train_losses(run_dir):
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_train_saves_curve_and_resume_continues_the_same_run(preset):
    root, preset_path = preset
    straight = root / "straight"
    _train(preset_path, straight)
    assert (straight / "checkpoints" / "latest").read_text().strip() == "6"
    curve = json.loads((straight / "loss_curve.json").read_text())
    assert len(curve["train"]) == 6 and len(curve["valid"]) == 2
    assert (straight / "loss_curve.png").stat().st_size > 1000

    stopped = root / "stopped"
    _train(preset_path, stopped, "--stop-after", "3")
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "3"
    assert not (stopped / "loss_curve.png").exists()
    refused = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(preset_path),
         "--run-dir", str(stopped), "--device", "cpu"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--resume" in refused.stderr
    _train(preset_path, stopped, "--resume")

    a, b = _train_losses(straight), _train_losses(stopped)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6), step
    assert a[6] < a[1]

    # --resume on a finished run trains nothing and says so.
    again = _train(preset_path, straight, "--resume")
    assert "had finished all 6 steps" in again.stdout
    assert _train_losses(straight) == a


def test_unknown_preset_and_mistyped_values_are_errors_not_tracebacks(preset, tmp_path):
    root, preset_path = preset

    def train(preset_arg):
        return subprocess.run(
            [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", preset_arg,
             "--run-dir", str(tmp_path / "run"), "--device", "cpu"], capture_output=True,
            text=True)

    done = train("hybrid-35m")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown preset 'hybrid-35m'; known presets: hybrid-1.3b" in done.stderr
    for section, name, value, message in (
            ("train", "lr", "3e-4", "train.lr='3e-4' is a str, expected float (YAML reads"),
            ("train", "global_batch_size", 0, "train.global_batch_size=0 must be >= 1"),
            ("train", "bf16", "yes", "train.bf16='yes' is a str, expected bool"),
            ("ext", "linear_conv_kernel", 2.5, "ext.linear_conv_kernel=2.5 is a float, expected int")):
        bad = yaml.safe_load(preset_path.read_text())
        bad[section][name] = value
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(bad))
        done = train(str(path))
        assert done.returncode == 2 and message in done.stderr, done.stderr[-2000:]


def test_bad_settings_fail_before_training(preset, tmp_path):
    root, preset_path = preset
    bad = yaml.safe_load(preset_path.read_text())
    bad["ext"]["pattern"] = "G*X"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(path),
         "--run-dir", str(tmp_path / "run"), "--device", "cpu"], capture_output=True, text=True)
    assert done.returncode == 2
    assert "unknown token mixer 'X'" in done.stderr


def test_sigusr1_saves_a_checkpoint_and_resume_continues_the_same_run(preset):
    """What Slurm's `--signal=B:USR1@...` does before the time limit: the run saves at the end
    of the current step, exits with PREEMPTED_EXIT_CODE, and --resume continues the curve."""
    import signal
    import time

    from megatron_ext.train import PREEMPTED_EXIT_CODE

    root, preset_path = preset
    straight = root / "straight_for_signal"
    _train(preset_path, straight, "--steps", "12")

    run_dir = root / "signalled"
    cmd = [sys.executable, "-m", "megatron_ext.cli", "train", "--preset", str(preset_path),
           "--run-dir", str(run_dir), "--device", "cpu", "--steps", "12"]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    out, err = process.communicate(timeout=300)
    assert process.returncode == PREEMPTED_EXIT_CODE, out[-2000:] + err[-2000:]
    stopped_at = int((run_dir / "checkpoints" / "latest").read_text())
    assert 2 <= stopped_at < 12

    _train(preset_path, run_dir, "--steps", "12", "--resume")
    a, b = _train_losses(straight), _train_losses(run_dir)
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6), step
