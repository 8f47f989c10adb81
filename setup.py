"""megatron-ext: token mixers, residual schemes and parallel wrappers for megatron-core, as layer specs.

The top-level folders ``kernels/`` and ``launch/`` are installed as ``megatron_ext.kernels`` and
``megatron_ext.launch`` (names like ``kernels`` exist on PyPI and must not be importable top level).
"""
from setuptools import setup

_SUBPACKAGES = {
    "megatron_ext": "megatron_ext",
    "megatron_ext.mixers": "megatron_ext/mixers",
    "megatron_ext.residual": "megatron_ext/residual",
    "megatron_ext.kernels": "kernels",
    "megatron_ext.kernels.delta_rule": "kernels/delta_rule",
    "megatron_ext.kernels.decay": "kernels/decay",
    "megatron_ext.kernels.residual": "kernels/residual",
    "megatron_ext.kernels.sparse": "kernels/sparse",
    "megatron_ext.launch": "launch",
    "megatron_ext.slurm": "slurm",
}

setup(
    name="megatron-ext",
    version="0.1.0",
    description="Hybrid token mixers and residual schemes for megatron-core, as layer specs",
    python_requires=">=3.12",
    packages=list(_SUBPACKAGES),
    package_dir=_SUBPACKAGES,
    package_data={"megatron_ext.launch": ["presets/*.yaml"],
                  "megatron_ext.slurm": ["*.tmpl", "README.md"]},
    install_requires=[
        "torch>=2.6",
        # Tested with 0.19.2; the spec and pipeline facts we rely on are those of the 0.19 line.
        "megatron-core>=0.19.0,<0.20",
        "einops",
        "sentencepiece",
        "numpy",
        "psutil",  # megatron's dist-checkpoint writer needs it
        "pyyaml",
        "tqdm",
        "matplotlib",
    ],
    extras_require={
        "fla": ["fla-core>=0.6"],
        "te": ["transformer-engine[pytorch]"],
        "dev": ["pytest>=8", "pytest-timeout"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
