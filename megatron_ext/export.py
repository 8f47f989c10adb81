"""``megatron-ext export RUN_OR_CHECKPOINT OUT_DIR``: a trained model as a Hugging Face model
directory.

Input: a run directory of ``megatron-ext train`` or ``pretrain`` (its ``config.yaml`` and newest
checkpoint), or one checkpoint folder inside it (``checkpoints/iter_NNNNNNN``). Checkpoints are
``train``'s (a plain state dict on a CPU, a Megatron dist checkpoint on GPUs) or Megatron's own
from ``pretrain`` (dist checkpoints); dist checkpoints load at TP = PP = 1 whatever TP / PP they
were saved with.

Output (``OUT_DIR``): ``config.json`` (:class:`megatron_ext.hf.MegatronExtConfig`, with the run's
settings), ``model.safetensors`` (the weights in the checkpoint's dtype), two remote-code files
that import :mod:`megatron_ext.hf`, and the run's sentencepiece tokenizer (as
``tokenizer.model`` with a ``LlamaTokenizer`` config) when it used one.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
import yaml

from megatron_ext.config import ConfigError

# What export needs beyond megatron-ext's own dependencies (the extra "hf" in setup.py).
HF_PACKAGES = ("transformers", "safetensors")
# The remote-code files: transformers imports them from the model directory.
CONFIG_FILE = "configuration_megatron_ext.py"
MODEL_FILE = "modeling_megatron_ext.py"
TOKENIZER_FILE = "tokenization_megatron_ext.py"
_REMOTE_CODE = {
    CONFIG_FILE: "from megatron_ext.hf import MegatronExtConfig  # noqa: F401\n",
    MODEL_FILE: "from megatron_ext.hf import MegatronExtForCausalLM  # noqa: F401\n",
    TOKENIZER_FILE: "from megatron_ext.hf import MegatronExtTokenizer  # noqa: F401\n",
}


def find_checkpoint(source: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """(run directory, checkpoint folder) of a run directory or of a checkpoint folder in one."""
    source = source.resolve()
    if (source / "config.yaml").exists():
        run_dir, root = source, source / "checkpoints"
        step = None
        for tracker in ("latest", "latest_checkpointed_iteration.txt"):  # train's, Megatron's
            if (root / tracker).exists():
                step = int((root / tracker).read_text().strip())
        if step is None:
            raise ConfigError(f"{root} has no checkpoint (no 'latest' or "
                              "'latest_checkpointed_iteration.txt'); train until one is saved")
        return run_dir, root / f"iter_{step:07d}"
    if source.name.startswith("iter_") and (source.parents[1] / "config.yaml").exists():
        return source.parents[1], source
    raise ConfigError(f"{source} is neither a run directory (with config.yaml) nor a checkpoint "
                      "folder iter_NNNNNNN of one")


def load_weights(model, checkpoint: pathlib.Path) -> None:
    """Load ``checkpoint`` (train's plain ``model/model.pt``, or a dist checkpoint in
    ``checkpoint`` or ``checkpoint/model``) into ``model`` (TP = PP = 1)."""
    from megatron.core import dist_checkpointing

    plain = checkpoint / "model" / "model.pt"
    if plain.exists():
        state = torch.load(plain, map_location="cpu", weights_only=True)
    elif (checkpoint / "model" / "model_rank00000.pt").exists():
        raise ConfigError(f"{checkpoint} is a CPU checkpoint of a tensor-parallel run (one file "
                          "per rank), which only that layout reads; export a GPU run's "
                          "checkpoint, or train on one process")
    elif (checkpoint / "model").is_dir():  # train's dist checkpoint: the model's state dict
        state = dist_checkpointing.load(model.sharded_state_dict(), str(checkpoint / "model"))
    else:  # Megatron's (pretrain): the model under "model" ("model0", ... per VPP chunk; the
        # tensors' keys are global, so the whole model reads them all from "model")
        state = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                        str(checkpoint))["model"]
    model.load_state_dict(state)


def _tokenizer_model(settings, run_dir: pathlib.Path) -> pathlib.Path | None:
    """The sentencepiece model the run tokenized with, if it can be found."""
    from megatron_ext.train import data_dir

    for candidate in (settings.data.tokenizer_model,
                      data_dir(settings, run_dir) / "tokenizer.model"):
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    return None


def export(source: str | pathlib.Path, out_dir: str | pathlib.Path,
           tokenizer_model: str | pathlib.Path | None = None) -> pathlib.Path:
    """Write the Hugging Face directory of ``source`` (see the module docstring) to
    ``out_dir``; ``tokenizer_model``: a sentencepiece model to ship instead of the run's."""
    try:
        from safetensors.torch import save_file

        from megatron_ext.hf import MegatronExtConfig, build_gpt_model
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in HF_PACKAGES:
            raise
        raise ConfigError(f"export writes a Hugging Face model directory and needs "
                          f"{' and '.join(HF_PACKAGES)}, which are not installed ({error}); "
                          f"install megatron-ext[hf]") from error
    from megatron_ext import train

    run_dir, checkpoint = find_checkpoint(pathlib.Path(source))
    if not checkpoint.is_dir():
        raise ConfigError(f"checkpoint {checkpoint} does not exist")
    settings = train.RunSettings.from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    vocab = train._padded_vocab(settings.data.vocab_size, settings.parallel.tensor)
    model = build_gpt_model(settings, vocab)
    load_weights(model, checkpoint)

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = {f"model.{name}": tensor.contiguous() for name, tensor in model.state_dict().items()
               if isinstance(tensor, torch.Tensor) and not name.endswith("_extra_state")}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = MegatronExtConfig(settings=settings.to_dict(), vocab_size=vocab,
                               architectures=["MegatronExtForCausalLM"])
    config.auto_map = {"AutoConfig": f"{CONFIG_FILE[:-3]}.MegatronExtConfig",
                       "AutoModelForCausalLM": f"{MODEL_FILE[:-3]}.MegatronExtForCausalLM"}
    config.save_pretrained(out)
    for name, text in _REMOTE_CODE.items():
        (out / name).write_text(text)
    spm = pathlib.Path(tokenizer_model) if tokenizer_model else _tokenizer_model(settings, run_dir)
    if spm is not None:
        shutil.copy(spm, out / "tokenizer.model")
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "MegatronExtTokenizer",
             "auto_map": {"AutoTokenizer": [f"{TOKENIZER_FILE[:-3]}.MegatronExtTokenizer", None]}},
            indent=1))
    print(f"[export] {run_dir.name}: {checkpoint.name} -> {out} "
          f"({sum(t.numel() for t in weights.values()) / 1e6:,.1f}M parameters"
          f"{', tokenizer' if spm is not None else ', no tokenizer found'})", flush=True)
    return out
