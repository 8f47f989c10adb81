"""A normal (non-editable) install, as users get it from ``pip install``.

The editable install the test suite runs on maps the source folders straight onto the import
path, so it cannot show a module that the wheel leaves out. These tests build the wheel, check
that it carries every module of the source tree, install it into a separate virtual
environment (dependencies shared with this one through a ``.pth`` line, which does not activate
the editable install's finder) and, from a folder outside the repository, import every module
and train a tiny hybrid for two steps with the installed ``megatron-ext`` command.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Source folder -> the import name it is installed under (see setup.py).
TREES = {"megatron_ext": "megatron_ext", "kernels": "megatron_ext/kernels",
         "launch": "megatron_ext/launch", "slurm": "megatron_ext/slurm"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    # From a copy of the sources: setuptools reuses a build/ folder left in the tree, which can
    # hold modules that setup.py no longer (or never) packages.
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in TREES:
        shutil.copytree(ROOT / folder, source / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(source)], check=True, cwd=out)
    (path,) = out.glob("megatron_ext-*.whl")
    return path


def _source_files() -> set[str]:
    """Every module of the source trees and the data files the package needs, as wheel paths."""
    files = set()
    for folder, installed in TREES.items():
        found = [*(ROOT / folder).rglob("*.py")]
        found += {"launch": [*(ROOT / folder / "presets").glob("*.yaml")],
                  "slurm": [*(ROOT / folder).glob("*.tmpl"), ROOT / folder / "README.md"]}.get(folder, [])
        files |= {f"{installed}/{path.relative_to(ROOT / folder).as_posix()}" for path in found}
    return files


def test_wheel_carries_every_module(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_files() - names)
    assert not missing, f"the wheel leaves out {missing}"


def test_installed_wheel_imports_and_trains(wheel, tmp_path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # This environment's packages (torch, megatron-core, ...) without the editable install.
    (pathlib.Path(site) / "shared_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)

    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    imports = subprocess.run([str(python), "-c", """
import importlib, pathlib, pkgutil
import megatron_ext
assert "site-packages" in megatron_ext.__file__, megatron_ext.__file__
names = [m.name for m in pkgutil.walk_packages(megatron_ext.__path__, "megatron_ext.")]
for name in names:
    importlib.import_module(name)
print(len(names))
"""], cwd=work, env=env, capture_output=True, text=True)
    assert imports.returncode == 0, imports.stderr
    assert int(imports.stdout.split()[-1]) > 50

    trained = subprocess.run(
        [str(env_dir / "bin" / "megatron-ext"), "train", "--steps", "2", "--run-dir", "run"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-4000:]
    assert (work / "run" / "metrics.jsonl").exists()
