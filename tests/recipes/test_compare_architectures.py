"""benchmarks/compare_architectures.py end to end on the CPU at a tiny scale: two variants, two
seeds, the same data; a JSON with each run's curves and per-variant summaries, and a plot; a
second command appending a variant to it."""

import json
import sysconfig
from pathlib import Path

import yaml

import harness

ROOT = Path(__file__).resolve().parents[2]


def test_two_variants_two_seeds(tmp_path):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    preset = tmp_path / "tiny.yaml"
    preset.write_text(yaml.safe_dump({
        "model": {"num_layers": 3, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 64,
                  "position_embedding_type": "none"},
        "ext": {"pattern": "G*G"},
        "data": {"vocab_size": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "steps": 10, "lr": 3e-3,
                  "min_lr": 3e-4, "warmup_steps": 1},
    }))
    out = tmp_path / "architectures.json"
    bench = harness.load_script(ROOT / "benchmarks" / "compare_architectures.py", "compare")
    common = ["--preset", str(preset), "--steps", "4", "--eval-interval", "2",
              "--eval-batches", "1", "--device", "cpu", "--out", str(out),
              "--out-dir", str(tmp_path / "runs"), "--commit", "test",
              "--inputs", str(stdlib / "email"), str(stdlib / "json")]
    assert bench.main(["--variants", "*,GG*+mhc", "--seeds", "1,2", *common]) == 0
    record = json.loads(out.read_text())
    assert record["corpus"]["files"] > 10 and record["corpus"]["tokens"] > 10_000
    assert [(r["variant"], r["seed"]) for r in record["rows"]] == [
        ("*", 1), ("*", 2), ("GG*+mhc", 1), ("GG*+mhc", 2)]
    for row in record["rows"]:
        assert [step for step, _ in row["valid"]] == [2, 4]
        assert len(row["train"]) == 4 and row["tokens_per_s"] > 0
    first, second = (r["valid"][-1][1] for r in record["rows"][:2])
    assert first != second  # the seeds differ
    stats = record["summary"]["*"]
    assert stats["valid_min"] <= stats["valid_loss"] <= stats["valid_max"] and stats["seeds"] == 2
    written = yaml.safe_load((tmp_path / "runs" / "presets" / "GGx_mhc_seed2.yaml").read_text())
    assert written["ext"]["pattern"] == "GG*" and written["ext"]["residual"] == "mhc"
    assert written["train"]["seed"] == 2
    assert out.with_suffix(".png").stat().st_size > 0
    # A second command adds GG* (seed 1) and skips the runs already there.
    assert bench.main(["--variants", "*,GG*", "--seeds", "1", "--append", *common]) == 0
    record = json.loads(out.read_text())
    assert [(r["variant"], r["seed"]) for r in record["rows"]][-2:] == [("GG*+mhc", 2), ("GG*", 1)]
    assert len(record["commands"]) == 2 and record["summary"]["GG*"]["seeds"] == 1
