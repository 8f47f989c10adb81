"""Fused RoPE in Megatron's loop (megatron_ext.rope.provide_fused_rope): with
``apply_rope_fusion`` on, Megatron's ``apply_rotary_pos_emb`` runs our op where it fits and its own
unfused path otherwise, with the results of the unfused path (outputs and gradients). The Triton
kernel itself is checked against the reference on Triton's interpreter
(tests/ops/test_triton_interpret_fused.py) and on a GPU (tests/ops/test_fused_layer_ops.py)."""
from types import SimpleNamespace

import harness
import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils

from megatron_ext import rope


@pytest.fixture
def empty_slots(monkeypatch):
    """Megatron's fused-RoPE slots as without Transformer Engine (restored afterwards)."""
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", None)


def megatron_config(fused: bool, interleaved: bool = False):
    return SimpleNamespace(apply_rope_fusion=fused, rotary_interleaved=interleaved,
                           mrope_section=None, multi_latent_attention=False)


def rotated(t, freqs, fused, interleaved=False, cu_seqlens=None):
    """Megatron's RoPE of ``t`` and the gradient of a fixed probe through it."""
    t = t.detach().clone().requires_grad_()
    out = rope_utils.apply_rotary_pos_emb(
        t, freqs, megatron_config(fused, interleaved), cu_seqlens=cu_seqlens,
        cp_group=rope._ContextParallelRank(1, 0))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * probe).sum().backward()
    return out, t.grad


def table(length, dim):
    theta = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * theta
    return torch.cat((angles, angles), dim=-1).view(length, 1, 1, dim)


def test_slots_filled_only_where_empty(empty_slots):
    rope.provide_fused_rope()
    assert rope_utils.fused_apply_rotary_pos_emb is rope.fused_rotary_pos_emb
    harness.tiny_config(apply_rope_fusion=True)  # Megatron's config accepts the fusion now
    kept = object()
    rope_utils.fused_apply_rotary_pos_emb = kept  # as Transformer Engine's
    rope.provide_fused_rope()
    assert rope_utils.fused_apply_rotary_pos_emb is kept


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate-half", "interleaved"])
def test_fused_equals_megatrons_unfused_path(empty_slots, interleaved):
    rope.provide_fused_rope()
    gen = torch.Generator().manual_seed(0)
    # A strided [s, b, H, D] slice, as Megatron's query is of its fused QKV projection.
    t = torch.randn(37, 2, 6, 32, generator=gen)[:, :, 1:4]
    freqs = table(37, 32)
    for fused, unfused in zip(rotated(t, freqs, True, interleaved),
                              rotated(t, freqs, False, interleaved)):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)


def test_packed_sequences_take_megatrons_unfused_path(empty_slots):
    rope.provide_fused_rope()
    t = torch.randn(9, 3, 16, generator=torch.Generator().manual_seed(1))  # thd
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    freqs = table(9, 16)
    for fused, unfused in zip(rotated(t, freqs, True, cu_seqlens=cu_seqlens),
                              rotated(t, freqs, False, cu_seqlens=cu_seqlens)):
        torch.testing.assert_close(fused, unfused)
