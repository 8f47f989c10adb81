"""benchmarks/report.py: README.md's performance table is what the kept results give, each row
names its result file, and every result file has a row."""

import pathlib
import re

import pytest

import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def report():
    return harness.load_script(ROOT / "benchmarks" / "report.py", "report_script")


def table_rows(block):
    return [line for line in block.splitlines() if line.startswith("| ") and "---" not in line][1:]


def test_readme_table_is_current(report):
    """Fails when a result changed and README.md was not regenerated: run
    ``python benchmarks/report.py``."""
    text = (ROOT / "README.md").read_text()
    assert report.update(text, report.render()) == text
    assert report.main(["--check"]) == 0


def test_every_row_names_its_source_and_every_result_has_a_row(report):
    block = report.render()
    rows = table_rows(block)
    assert 0 < len(rows) <= 12  # one row per measurement's file; the README stays short
    checks = [line for line in block.splitlines() if line.startswith("- ")]
    assert len(checks) == len(report.CHECKS)
    named = [re.search(r"\]\(benchmarks/results/([^)]+\.json)\)", line).group(1)
             for line in checks]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        assert len(cells) == 4, row
        links = re.findall(r"\]\((benchmarks/results/[^)]+\.json)\)", cells[3])
        assert len(links) == 1, row
        assert (ROOT / links[0]).is_file()
        # commit, GPU, torch and Triton, each a value or "not recorded"
        assert re.search(r": commit ([0-9a-f]{7,40}|not recorded); [^;]+; torch [^;]+; Triton [^;]+$",
                         cells[3]), row
        named.append(pathlib.Path(links[0]).name)
    assert sorted(named) == sorted(path.name for path in RESULTS.glob("*.json"))


def test_stale_block_is_found(report):
    text = f"intro\n{report.BEGIN}\n| old | table |\n{report.END}\noutro\n"
    new = report.update(text, report.render())
    assert new != text
    assert new.startswith(f"intro\n{report.BEGIN}\n") and new.endswith(f"\n{report.END}\noutro\n")
    assert report.update(new, report.render()) == new


def test_stamp_says_what_is_not_recorded(report):
    assert report.stamp({"environment": {"commit": "abc1234", "gpu": "NVIDIA H200",
                                         "torch": "2.11.0", "triton": "3.6.0"}}) == (
        "commit abc1234; NVIDIA H200; torch 2.11.0; Triton 3.6.0")
    assert report.stamp({"device": "NVIDIA H200", "torch": "2.11.0"}) == (
        "commit not recorded; NVIDIA H200; torch 2.11.0; Triton not recorded")
    assert report.stamp({}) == (
        "commit not recorded; GPU not recorded; torch not recorded; Triton not recorded")
    resumed = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "commit": "def5678",
               "results": [{"commit": None}, {"commit": "def5678"}, {"commit": None}]}
    assert report.stamp(resumed) == (
        "commits not recorded (2 rows), def5678 (1 row); NVIDIA H200; torch 2.11.0; Triton 3.6.0")


def test_embedded_plots_exist(report):
    for name in report.EMBEDDED:
        assert (RESULTS / name).is_file()
        assert f"![{pathlib.Path(name).stem}](benchmarks/results/{name})" in report.render()


def test_plots_are_redrawn_from_the_results(report, tmp_path):
    written = report.redraw_plots(out_dir=tmp_path)
    assert sorted(path.name for path in written) == sorted(
        path.name for path in RESULTS.glob("*.png") if path.name != "train_tiny_hybrid_cpu.png")
    assert all(path.stat().st_size > 0 for path in written)
