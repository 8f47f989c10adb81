"""Presets: model, data, training and parallel settings as YAML data files.

A preset is looked up by name in ``presets/`` next to this file (``tiny-hybrid`` ->
``presets/tiny-hybrid.yaml``) or given as a path to a YAML file of the same shape.
"""

from __future__ import annotations

import pathlib

import yaml

PRESET_DIR = pathlib.Path(__file__).parent / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> pathlib.Path:
    path = pathlib.Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise FileNotFoundError(f"preset file {name_or_path!r} does not exist")
        return path
    path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ValueError(
            f"unknown preset {name_or_path!r}; known presets: {', '.join(list_presets())} "
            "(or give a path to a .yaml file)"
        )
    return path


def load_preset(name_or_path: str) -> dict:
    """The preset as a dict of sections (model, ext, data, train, parallel)."""
    with open(preset_path(name_or_path)) as f:
        return yaml.safe_load(f) or {}
