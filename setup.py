"""megatron-ext: token mixers, residual schemes and parallel wrappers for megatron-core, as layer specs.

The top-level folders ``kernels/`` and ``launch/`` are installed as ``megatron_ext.kernels`` and
``megatron_ext.launch`` (names like ``kernels`` exist on PyPI and must not be importable top level).
"""
from setuptools import find_packages, setup

# Import name -> folder of each installed tree. Sub-packages are discovered (any folder with an
# __init__.py below these); setuptools maps them by the longest matching prefix.
_ROOTS = {
    "megatron_ext": "megatron_ext",
    "megatron_ext.kernels": "kernels",
    "megatron_ext.launch": "launch",
    "megatron_ext.slurm": "slurm",
}


def _packages() -> list[str]:
    found = []
    for name, folder in _ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)
                  if f"{name}.{sub}" not in _ROOTS]
    return sorted(set(found))


setup(
    name="megatron-ext",
    version="0.1.0",
    description="Hybrid token mixers and residual schemes for megatron-core, as layer specs",
    python_requires=">=3.12",
    packages=_packages(),
    package_dir=_ROOTS,
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
        # `megatron-ext export` (megatron_ext.export.HF_PACKAGES) and loading its output.
        "hf": ["transformers", "safetensors"],
        "te": ["transformer-engine[pytorch]"],
        # setuptools: tests/recipes/test_install.py builds the wheel without build isolation;
        # transformers: the Hugging Face tokenizer data path (tests/recipes/test_pretrain.py).
        # pytest-xdist: scripts/test.sh's two workers.
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist", "setuptools>=70.1", "transformers"],
    },
    entry_points={"console_scripts": ["megatron-ext=megatron_ext.cli:main"]},
)
