"""RoPE scaling for context extension: the model's rotary table (every softmax layer that uses
RoPE reads it) for positions beyond the ``original`` length L0 it was trained at, by a factor s.

With head dim d, base b and the frequencies ``theta_i = b^(-2i/d)``, i < d/2:

- ``linear`` (position interpolation, Chen et al. 2023): positions divided by s.
- ``ntk`` (NTK-aware scaling): the base raised to ``b' = b s^(d / (d - 2))``, so the lowest
  frequency is interpolated by s and the highest kept.
- ``dynamic_ntk``: ``ntk`` with the factor that the current length T asks for,
  ``b' = b (s T / L0 - (s - 1))^(d / (d - 2))`` when T > L0, the plain table otherwise.
- ``yarn`` (Peng et al. 2023, "YaRN"): per frequency, by its rotations over L0,
  ``r_i = L0 theta_i / (2 pi)``: kept where ``r_i > beta = 32``, divided by s where
  ``r_i < alpha = 1``, and blended linearly in r between; the attention logits are scaled by
  ``t^2``, ``t = 0.1 ln s + 1`` (the paper's ``sqrt(1/temperature)`` on q and k).

:func:`apply_rope_scaling` installs it in a built GPTModel (``megatron-ext train`` and the
exported model call it from the preset's ``model.rope_scaling*`` settings).

Fused RoPE in Megatron's loop: Megatron applies the rotation through
``rope_utils.fused_apply_rotary_pos_emb`` when ``apply_rope_fusion`` is on, a slot that
Transformer Engine fills where it is installed. :func:`provide_fused_rope` fills an empty slot
with :func:`fused_rotary_pos_emb` (``megatron_ext.kernels.fused.rope``: one Triton kernel each
way instead of Megatron's unfused chain of multiplies, a negation and concatenations), and the
packed (``thd``) slot with Megatron's unfused path; ``megatron-ext pretrain`` does so.
"""

from __future__ import annotations

import math

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_ext.config import ConfigError

METHODS = ("none", "linear", "ntk", "dynamic_ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0


def scaled_inv_freq(dim: int, base: float, method: str, factor: float, original: int,
                    length: int | None = None) -> torch.Tensor:
    """The frequencies ``[dim / 2]`` (fp32) of ``method`` (``linear`` keeps them: it scales
    positions); ``length``: the current length, for ``dynamic_ntk``."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if method == "ntk" or (method == "dynamic_ntk" and length is not None and length > original):
        stretch = factor if method == "ntk" else factor * length / original - (factor - 1)
        base = base * stretch ** (dim / (dim - 2))
    theta = base ** -exponents
    if method == "yarn":
        rotations = original * theta / (2 * math.pi)
        kept = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        theta = kept * theta + (1 - kept) * theta / factor
    return theta.float()


def yarn_logit_scale(factor: float) -> float:
    """YaRN's factor on the attention logits: ``(0.1 ln s + 1)^2``."""
    return (0.1 * math.log(factor) + 1) ** 2 if factor > 1 else 1.0


class ScaledRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding with the frequencies (and, for ``linear``, positions) of one
    scaling method; ``dynamic_ntk`` recomputes them for each length it is asked for."""

    def __init__(self, dim: int, base: float, method: str, factor: float, original: int,
                 cp_group=None):
        super().__init__(dim, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True,
                         cp_group=cp_group)
        self.dim, self.base, self.method = dim, base, method
        self.factor, self.original = factor, original
        self.inv_freq = scaled_inv_freq(dim, base, method, factor, original)
        if method == "linear":
            self.seq_len_interpolation_factor = factor

    def get_freqs_non_repeated(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        if self.method == "dynamic_ntk":
            self.inv_freq = scaled_inv_freq(self.dim, self.base, self.method, self.factor,
                                            self.original, max_seq_len + offset
                                            ).to(self.inv_freq.device)
        return super().get_freqs_non_repeated(max_seq_len, offset)


def check(method: str, factor: float, original: int | None, position_embedding_type: str):
    if method not in METHODS:
        raise ConfigError(f"model.rope_scaling={method!r} is not one of {list(METHODS)}")
    if method == "none":
        return
    if position_embedding_type != "rope":
        raise ConfigError(f"model.rope_scaling={method!r} scales RoPE, but "
                          f"position_embedding_type={position_embedding_type!r}; use 'rope'")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
        raise ConfigError(f"model.rope_scaling_factor={factor!r} must be a number >= 1 (the "
                          "ratio of the new context to the trained one)")
    if original is not None and original < 1:
        raise ConfigError(f"model.rope_original_length={original} must be >= 1")


def apply_rope_scaling(model, config, method: str, factor: float, original: int,
                       base: float) -> None:
    """Install the scaled rotary table in ``model`` (a GPTModel built with RoPE), and for
    ``yarn`` the logit scale in every softmax core of ours."""
    from megatron_ext.mixers.attention import SoftmaxCoreAttention

    if method == "none":
        return
    model.rotary_pos_emb = ScaledRotaryEmbedding(
        config.kv_channels, base, method, factor, original,
        cp_group=model.rotary_pos_emb.cp_group)
    if method == "yarn":
        for module in model.modules():
            if isinstance(module, SoftmaxCoreAttention):
                scale = module.softmax_scale or config.kv_channels ** -0.5
                module.softmax_scale = scale * yarn_logit_scale(factor)


def fused_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                         **_unused) -> torch.Tensor:
    """Megatron's fused-RoPE contract (``t [s, b, H, D]``, ``freqs [s, 1, 1, D]``): the fused op
    where :func:`megatron_ext.kernels.fused.rope_fits` and the rotation is rotate-half (its
    Triton kernel on CUDA once it has passed its first-use check), Megatron's unfused path
    otherwise (interleaved pairs, a partial rotary dim, multi-dim tables)."""
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_ext.kernels import fused

    if interleaved or not fused.rope_fits(t, freqs):
        return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    return fused.rope(t, freqs)


class _ContextParallelRank:
    """The size and rank that Megatron's unfused ``thd`` RoPE reads from a CP group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def _unfused_rotary_pos_emb_thd(t, cu_seqlens, freqs, cp_size: int = 1, cp_rank: int = 0,
                                interleaved: bool = False):
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils._apply_rotary_pos_emb_thd(
        t, cu_seqlens, freqs, rotary_interleaved=interleaved,
        cp_group=_ContextParallelRank(cp_size, cp_rank))


def provide_fused_rope() -> None:
    """Fill Megatron's empty fused-RoPE slots (no Transformer Engine) so that
    ``apply_rope_fusion`` runs :func:`fused_rotary_pos_emb`; slots already filled are kept."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rotary_pos_emb
    if rope_utils.fused_apply_rotary_pos_emb_thd is None:
        rope_utils.fused_apply_rotary_pos_emb_thd = _unfused_rotary_pos_emb_thd
