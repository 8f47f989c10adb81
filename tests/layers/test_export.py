"""``megatron-ext export``: a checkpoint as a Hugging Face model directory that ``transformers``
loads (``trust_remote_code=True``) and whose logits equal megatron-ext's (fp32, CPU): for a
hybrid of every mixer, for mHC and attention residuals, from a dist checkpoint saved at TP = 2,
and end to end from a ``megatron-ext train`` run with its tokenizer."""

import pathlib
import subprocess
import sys

import pytest
import torch
import yaml

import harness
from megatron_ext import train
from megatron_ext.export import export
from megatron_ext.registry import MIXERS

pytestmark = pytest.mark.usefixtures("megatron_single_process")

EVERY_MIXER = "".join(m.symbol for m in MIXERS)


def logits(model, tokens):
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1), None)


def tokens_fed(hf) -> list[int]:
    """The number of tokens each later forward of the wrapped GPTModel is given."""
    fed = []
    hf.model.register_forward_pre_hook(lambda module, args: fed.append(args[0].shape[1]))
    return fed


TOKENS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("pattern, ext", [
    (EVERY_MIXER, {}),
    ("G*M*", {"residual": "mhc"}),
    ("G*M*", {"residual": "attnres_block"}),
], ids=["every-mixer", "mhc", "attnres"])
def test_exported_logits_equal_megatron_ext(tmp_path, pattern, ext):
    model, hf = harness.exported_random_model(tmp_path, harness.settings_of(pattern, **ext))
    with torch.no_grad():
        got = hf(TOKENS).logits
    torch.testing.assert_close(got, logits(model, TOKENS), atol=0, rtol=0)
    assert hf.generate(TOKENS[:1, :12], max_new_tokens=4, do_sample=False).shape == (1, 16)


def test_generate_decodes_incrementally(tmp_path):
    """``generate`` with its cache on runs the prompt once and then one token a step through
    Megatron's inference context, and gives the tokens and logits of recomputing the whole
    sequence at every step (``use_cache=False``); so does a second prompt after the first.
    (Linear mixers: on a CPU, softmax layers recompute, see the next test.)"""
    _, hf = harness.exported_random_model(tmp_path, harness.settings_of("GKMANQ"))
    fed = tokens_fed(hf)
    for prompt in (TOKENS[:1, :9], TOKENS[1:, :5]):
        runs = {}
        for use_cache in (True, False):
            fed.clear()
            runs[use_cache] = hf.generate(prompt, max_new_tokens=6, do_sample=False,
                                          use_cache=use_cache, output_logits=True,
                                          return_dict_in_generate=True)
            lengths = list(fed)
        assert lengths == list(range(prompt.shape[1], prompt.shape[1] + 6))  # recomputed
        torch.testing.assert_close(runs[True].sequences, runs[False].sequences, rtol=0, atol=0)
        torch.testing.assert_close(torch.stack(runs[True].logits), torch.stack(runs[False].logits),
                                   rtol=1e-4, atol=2e-5)
    fed.clear()
    hf.generate(TOKENS[:1, :7], max_new_tokens=5, do_sample=False)
    assert fed == [7, 1, 1, 1, 1]  # the prompt once, then one token a step


def test_generate_with_softmax_layers_on_a_cpu_recomputes(tmp_path, monkeypatch):
    """megatron-core 0.19 allocates the KV cache on the CUDA device: on a CPU a model with '*'
    layers runs the whole sequence at every step (the test harness's CUDA shim is taken away,
    as a user's CPU has none)."""
    _, hf = harness.exported_random_model(tmp_path, harness.settings_of("G*"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 / 0)  # any use would fail
    fed = tokens_fed(hf)
    hf.generate(TOKENS[:1, :7], max_new_tokens=3, do_sample=False)
    assert fed == [7, 8, 9]


def _save_at_tp2(rank, world_size, settings_dict, source, target):
    """Rank of a TP = 2 layout: the TP = 1 dist checkpoint ``source`` resharded to TP = 2, saved
    as Megatron's own checkpoints are (the model under "model")."""
    from megatron.core import dist_checkpointing

    settings = train.RunSettings.from_dict(settings_dict)
    settings.parallel.tensor = 2
    harness.init_parallel(tp=2)
    runtime = train.Runtime(device=torch.device("cpu"), rank=rank, world_size=world_size)
    model = train.build_model(settings, train.transformer_config(settings, runtime),
                              train._padded_vocab(settings.data.vocab_size, 1))
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), source))
    dist_checkpointing.save({"model": model.sharded_state_dict()}, target)


@pytest.mark.dist
@pytest.mark.skipif(not harness.can_spawn(2), reason="needs 2 ranks")
def test_export_of_a_tensor_parallel_dist_checkpoint(tmp_path):
    from megatron.core import dist_checkpointing

    settings = harness.settings_of("GKM*")
    model = harness.random_model(settings)
    source = tmp_path / "tp1"
    source.mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(source))
    run, folder = harness.run_dir_with(tmp_path, settings)
    (run / "checkpoints" / "latest").rename(run / "checkpoints" / "latest_checkpointed_iteration.txt")
    harness.spawn(_save_at_tp2, 2, settings.to_dict(), str(source), str(folder))
    hf = harness.load_exported(export(run, tmp_path / "hf"))
    with torch.no_grad():
        got = hf(TOKENS).logits
    torch.testing.assert_close(got, logits(model, TOKENS), atol=1e-6, rtol=1e-5)


def test_train_run_exports_with_its_tokenizer(tmp_path):
    """``megatron-ext train`` on the CPU, ``megatron-ext export`` of its run directory; the
    tokenizer gives training's ids and the model generates."""
    import sysconfig

    from transformers import AutoTokenizer

    from megatron_ext.data import SentencePieceTokenizer

    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    settings = harness.settings_of("G*").to_dict()
    settings["model"]["hidden_size"] = 64
    settings["data"] = {"vocab_size": 512, "output_dir": str(tmp_path / "data"),
                        "inputs": [str(stdlib / "email"), str(stdlib / "json")]}
    settings["train"].update(steps=2, warmup_steps=1, save_interval=2, eval_interval=2,
                             eval_batches=1)
    preset = tmp_path / "preset.yaml"
    preset.write_text(yaml.safe_dump(settings))
    for command in (["train", "--preset", str(preset), "--run-dir", str(tmp_path / "run"),
                     "--device", "cpu"],
                    ["export", str(tmp_path / "run"), str(tmp_path / "hf")]):
        done = subprocess.run([sys.executable, "-m", "megatron_ext.cli", *command],
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    text = "import json\ndef load(path):\n    return json.loads(path)\n"
    trained = SentencePieceTokenizer(str(tmp_path / "data" / "tokenizer.model"))
    assert tokenizer(text).input_ids == trained.tokenize(text)
    model = harness.load_exported(tmp_path / "hf")
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 6)
    assert isinstance(tokenizer.decode(out[0]), str)


@pytest.mark.parametrize("missing", ["transformers", "safetensors"])
def test_export_without_the_hf_packages_says_what_to_install(tmp_path, missing):
    """A plain ``pip install megatron-ext`` lacks transformers and safetensors: ``megatron-ext
    export`` then stops with an error that names the extra to install, not a traceback."""
    script = (f"import sys; sys.modules[{missing!r}] = None\n"  # makes `import {missing}` fail
              "from megatron_ext.cli import main\n"
              f"sys.exit(main(['export', {str(tmp_path / 'run')!r}, {str(tmp_path / 'hf')!r}]))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "install megatron-ext[hf]" in done.stderr and missing in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
