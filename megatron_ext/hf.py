"""A model trained with megatron-ext as a Hugging Face ``transformers`` causal LM.

:class:`MegatronExtForCausalLM` wraps the same Megatron ``GPTModel`` that training builds
(:func:`megatron_ext.train.build_model`, one process, TP = PP = 1), so every mixer and residual
scheme runs the code it trained with: the kernels where the device has them (Triton on CUDA),
the PyTorch paths otherwise. ``megatron-ext export`` writes a model directory whose
``config.json`` points ``AutoConfig`` / ``AutoModelForCausalLM`` here through two small remote-code
files, so ``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads it where
megatron-ext is installed. Models with RoPE run on a GPU only (megatron-core 0.19 builds the
rotary table on the current CUDA device).

:class:`MegatronExtTokenizer` is the run's sentencepiece model as a ``transformers`` tokenizer
(the same ids as training's tokenizer; no BOS is added, as training adds none, and documents end
with the model's ``eos`` piece).

Generation: ``generate`` decodes incrementally through Megatron's inference context (the linear
mixers' recurrent state and convolution tails, the softmax layers' KV cache; docs/evaluation.md):
the model keeps the context of the sequence it is generating and, at each step, runs only the
tokens that sequence gained, so a step does not recompute the prefix. Models whose layers
cannot decode (the sparse mixers), models with softmax layers on a CPU (megatron-core 0.19
allocates the KV cache on the CUDA device) and ``use_cache=False`` run the whole sequence at
each step instead.
"""

from __future__ import annotations

import functools

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel, PreTrainedTokenizer
from transformers.modeling_outputs import CausalLMOutput

MODEL_TYPE = "megatron_ext"


class MegatronExtConfig(PretrainedConfig):
    """``settings``: the run's settings (``RunSettings.to_dict()``, as in its ``config.yaml``);
    ``vocab_size``: the model's padded vocabulary (the output layer's rows)."""

    model_type = MODEL_TYPE

    def __init__(self, settings: dict | None = None, vocab_size: int = 0, **kwargs):
        self.settings = settings or {}
        self.vocab_size = vocab_size
        self.num_hidden_layers = self.settings.get("model", {}).get("num_layers", 0)
        super().__init__(**kwargs)


def _one_process_world() -> None:
    """Megatron's parallel state for a model that runs in this process alone (a one-process
    gloo world on an in-memory store, kept for the process's life), unless one exists."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()


def build_gpt_model(settings, vocab_size: int):
    """The training GPTModel of ``settings`` (a RunSettings) at TP = PP = 1 in fp32 on the CPU;
    its weights are not initialised (they are loaded next)."""
    import copy

    from megatron_ext import train

    settings = copy.deepcopy(settings)
    settings.parallel = train.ParallelSettings()
    _one_process_world()
    runtime = train.Runtime(device=torch.device("cpu"), rank=0, world_size=1)
    return train.build_model(settings, train.unloaded_config(settings, runtime), vocab_size)


class MegatronExtForCausalLM(PreTrainedModel, GenerationMixin):
    """``forward(input_ids [b, s]) -> logits [b, s, vocab]`` (and the mean next-token loss
    when ``labels`` are given, Hugging Face's convention: labels are the inputs, shifted here)."""

    config_class = MegatronExtConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: MegatronExtConfig):
        super().__init__(config)
        from megatron_ext.train import RunSettings

        self.model = build_gpt_model(RunSettings.from_dict(config.settings), config.vocab_size)
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, config=None, dtype=None,
                        torch_dtype=None, device_map=None, **kwargs):
        """The model of an exported directory (or Hub repository): built with real tensors and
        loaded strictly from ``model.safetensors``. (transformers' own loader builds on the meta
        device and then refills only the checkpoint's tensors, which would lose the buffers
        Megatron's modules compute when they are built, such as fixed decays.) ``dtype``
        (``torch_dtype``) and a single-device ``device_map`` are applied after loading."""
        import pathlib

        from safetensors.torch import load_file

        path = pathlib.Path(pretrained_model_name_or_path)
        if not path.is_dir():
            from huggingface_hub import snapshot_download

            path = pathlib.Path(snapshot_download(str(pretrained_model_name_or_path)))
        model = cls(config if config is not None else cls.config_class.from_pretrained(path))
        missing, unexpected = model.load_state_dict(load_file(str(path / "model.safetensors")),
                                                    strict=False)
        # Megatron modules carry an ``_extra_state`` entry (None without Transformer Engine).
        missing = [key for key in missing if not key.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"{path / 'model.safetensors'} does not match the model: missing "
                             f"{missing[:5]}, unexpected {unexpected[:5]}")
        dtype = dtype if dtype is not None else torch_dtype
        if dtype not in (None, "auto"):
            model.to(getattr(torch, dtype) if isinstance(dtype, str) else dtype)
        if isinstance(device_map, (str, torch.device)) and device_map != "auto":
            model.to(device_map)
        return model.eval()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        """No ``transformers`` cache object: the model keeps its own decoding state."""
        return False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, continue_decoding: bool = False,
                **_unused) -> CausalLMOutput:
        """Logits ``[b, s, vocab]`` of ``input_ids [b, s]``; with ``continue_decoding`` (what
        ``generate`` passes) only those of the tokens after the ones decoded so far
        (:meth:`_decode`)."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("MegatronExtForCausalLM takes unpadded batches (causal attention "
                             "over every token); pass sequences of equal length or one at a time")
        logits = self._decode(input_ids) if continue_decoding else None
        if logits is None:
            b, s = input_ids.shape
            positions = torch.arange(s, device=input_ids.device).expand(b, -1)
            logits = self.model(input_ids, positions, None)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, use_cache=True,
                                      **_unused):
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                "continue_decoding": bool(use_cache)}

    @functools.cached_property
    def _has_kv_cache(self) -> bool:
        """Whether the model has softmax layers with Megatron's KV cache, which megatron-core
        0.19 allocates on the current CUDA device (so such models decode on a GPU only)."""
        from megatron.core.transformer.attention import Attention

        return any(isinstance(module, Attention) for module in self.model.modules())

    _decoding = None  # (Megatron's inference context, the tokens [b, n] it has consumed)
    _cannot_decode = False  # set once a layer refused to decode

    def _decode(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        """Logits of the tokens of ``input_ids`` that the decoding state has not consumed: the
        state continues when ``input_ids`` extends its tokens by one (a decode step), and
        starts anew otherwise (a prefill of the whole sequence). None where the model's layers
        cannot decode."""
        from megatron.core.inference.contexts import StaticInferenceContext

        from megatron_ext.config import ConfigError

        if self._cannot_decode or (not input_ids.is_cuda and self._has_kv_cache):
            return None
        b, s = input_ids.shape
        state = self._decoding
        if (state is not None and state[1].shape == (b, s - 1)
                and torch.equal(input_ids[:, :s - 1], state[1])):
            context, start = state[0], s - 1
        else:
            context = StaticInferenceContext(max_batch_size=b,
                                             max_sequence_length=self.model.max_sequence_length)
            context.materialize_only_last_token_logits = False
            start = 0
        positions = torch.arange(start, s, device=input_ids.device).expand(b, -1)
        try:
            logits = self.model(input_ids[:, start:], positions, None, inference_context=context)
        except ConfigError:  # a layer that cannot decode says so; the context is dropped
            self._cannot_decode, self._decoding = True, None
            return None
        context.sequence_len_offset += s - start
        if start == 0:
            context.enable_decode_mode()  # one token per sequence from here on
        self._decoding = (context, input_ids.clone())
        return logits


class MegatronExtTokenizer(PreTrainedTokenizer):
    """A sentencepiece model (``tokenizer.model``) as training used it, for ``AutoTokenizer``."""

    vocab_files_names = {"vocab_file": "tokenizer.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, **kwargs):
        import sentencepiece

        self.vocab_file = vocab_file
        self.sp = sentencepiece.SentencePieceProcessor(model_file=vocab_file)
        eos = self.sp.id_to_piece(self.sp.eos_id()) if self.sp.eos_id() >= 0 else None
        kwargs.setdefault("eos_token", eos)
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def get_vocab(self) -> dict[str, int]:
        return {self.sp.id_to_piece(i): i for i in range(self.vocab_size)}

    def _tokenize(self, text: str, **_unused) -> list[str]:
        return self.sp.encode(text, out_type=str)

    def _convert_token_to_id(self, token: str) -> int:
        return self.sp.piece_to_id(token)

    def _convert_id_to_token(self, index: int) -> str:
        return self.sp.id_to_piece(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return self.sp.decode_pieces(tokens)

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        import os
        import shutil

        out = os.path.join(save_directory, (filename_prefix or "") + "tokenizer.model")
        if os.path.abspath(out) != os.path.abspath(self.vocab_file):
            shutil.copy(self.vocab_file, out)
        return (out,)
