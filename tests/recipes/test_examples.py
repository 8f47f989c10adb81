"""The examples run as shown."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_own_script_example_trains_three_steps():
    # A fresh rendezvous: this pytest process may hold MASTER_PORT for its own gloo group.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "own_script.py")],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "['DeltaRuleMixer', 'DeltaRuleMixer', 'SelfAttention', 'DeltaRuleMixer']" in done.stdout
    losses = [float(line.split()[-1]) for line in done.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]


def test_example_yaml_is_a_valid_config():
    from megatron_ext.config import ExtConfig

    ExtConfig.from_yaml(ROOT / "examples" / "hybrid.yaml").validate(num_layers=20)
