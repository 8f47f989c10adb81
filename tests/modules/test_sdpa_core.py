"""The SDPA core attention against Megatron's local attention and an explicit softmax."""

import math

import pytest
import torch

import harness
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

pytestmark = pytest.mark.usefixtures("megatron_single_process")


def _model(backend, pattern="*", **cfg):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2, **cfg)
    torch.manual_seed(7)
    return GPTModel(config, block_spec(config, ext=ExtConfig(pattern=pattern,
                                                             attention_backend=backend)),
                    vocab_size=96, max_sequence_length=40, position_embedding_type="none")


@pytest.mark.parametrize("groups", [4, 2, 1])
def test_sdpa_model_equals_local_attention_model(groups):
    """Same weights, fp32: Megatron's unfused core and SDPA give the same loss and gradients."""
    local, sdpa = _model("local", num_query_groups=groups), _model("sdpa", num_query_groups=groups)
    assert type(sdpa.decoder.layers[0].self_attention.core_attention).__name__ == "SDPACoreAttention"
    assert type(local.decoder.layers[0].self_attention.core_attention).__name__ == "DotProductAttention"
    sdpa.load_state_dict(local.state_dict())
    tokens = torch.randint(0, 96, (3, 37))  # odd length
    positions = torch.arange(37).expand(3, -1)
    losses = []
    for m in (local, sdpa):
        loss = m(tokens, positions, None, labels=tokens.roll(-1, 1)).mean()
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(local.named_parameters(), sdpa.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def _explicit_attention(q, k, v, allowed):
    """softmax(q k^T / sqrt(d) masked) v for [s, b, h, d] inputs, heads already matched."""
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v)


def _core(mask_type=AttnMaskType.causal):
    from megatron_ext.mixers.attention import SDPACoreAttention

    return SDPACoreAttention(harness.tiny_config(), layer_number=1, attn_mask_type=mask_type)


def test_gqa_causal_matches_explicit_softmax():
    s, b, hq, hkv, d = 19, 2, 4, 2, 8
    q, k, v = torch.randn(s, b, hq, d), torch.randn(s, b, hkv, d), torch.randn(s, b, hkv, d)
    out = _core()(q, k, v, None)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    expected = _explicit_attention(q, k.repeat_interleave(2, 2), v.repeat_interleave(2, 2), causal)
    torch.testing.assert_close(out, expected.reshape(s, b, -1), rtol=1e-5, atol=1e-5)


def test_padding_mask_follows_megatron_convention():
    """attention_mask True = masked out; with the causal type both masks apply."""
    s, b, h, d = 11, 1, 2, 8
    q, k, v = (torch.randn(s, b, h, d) for _ in range(3))
    blocked = torch.zeros(b, 1, s, s, dtype=torch.bool)
    blocked[..., 3] = True  # nobody may attend to key 3
    out = _core()(q, k, v, blocked)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() & ~blocked[0, 0]
    allowed[3, 3] = True  # keep row 3 non-empty in the expectation below, then drop it
    expected = _explicit_attention(q, k, v, allowed)
    keep = [i for i in range(s) if i != 3]
    torch.testing.assert_close(out[keep], expected.reshape(s, b, -1)[keep], rtol=1e-5, atol=1e-5)


def test_packed_sequences_equal_separate_sequences():
    lengths = [5, 9, 3]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    h, d = 2, 8
    q, k, v = (torch.randn(17, h, d, requires_grad=True) for _ in range(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=9, max_seqlen_kv=9)
    packed = _core()(q, k, v, None, packed_seq_params=params)
    assert packed.shape == (17, h * d)
    pieces = []
    for start, n in zip(cu[:-1].tolist(), lengths):
        sl = slice(start, start + n)
        pieces.append(_core()(q[sl, None], k[sl, None], v[sl, None], None)[:, 0])
    torch.testing.assert_close(packed, torch.cat(pieces), rtol=1e-5, atol=1e-5)
    (packed.square().sum()).backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.cat(pieces).square().sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


def test_unsupported_options_fail_clearly():
    from megatron_ext.mixers.attention import SDPACoreAttention

    config = harness.tiny_config(window_size=(8, 0), attention_dropout=0.1)
    with pytest.raises(NotImplementedError,
                       match=r"attention_dropout=0.1 is not supported with a sliding window"):
        SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
