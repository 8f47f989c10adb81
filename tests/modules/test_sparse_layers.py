"""The sparse attention layers inside a Megatron model on the GPU (skipped without CUDA).

The op tests (test_sparse_*.py) check each kernel path against its reference; these check the
layers that call them, as a user's model runs them: a GPTModel with one layer of each sparse
mixer (window + sink '*', MoBA, NSA, DSA, CSA, HCA) and RoPE, whose "auto" backend on CUDA
sends each layer to its fast path (FlexAttention, FlashAttention where installed, the Triton
selection, scores and loss kernels). In fp32 the model's loss and every parameter's gradient
equal those of the same model on the "reference" backend (dense masks), in both DSA training
stages; in bf16 a few optimizer steps train it.
"""

import pytest
import torch

import harness
from megatron_ext.config import ExtConfig

pytestmark = pytest.mark.gpu

PATTERN = "*BSDCH"
SEQ = 333  # no multiple of any block size below, and more than one FlexAttention tile of 128
# Sizes a few blocks long at SEQ, so that every selection has a choice to make.
SIZES = dict(moba_block_size=32, moba_top_k=3, nsa_compress_block=16, nsa_compress_stride=8,
             nsa_select_block=16, nsa_select_top_k=4, nsa_window=64, dsa_top_k=48,
             dsa_indexer_heads=4, dsa_indexer_dim=32, csa_compress_rate=4, csa_top_k=16,
             csa_indexer_heads=4, csa_indexer_dim=32, csa_window=32, hca_compress_rate=16,
             hca_window=32)


def _model(backend: str, dtype=torch.float32, **options):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    half = dtype != torch.float32
    config = harness.tiny_config(num_layers=len(PATTERN), hidden_size=128, ffn_hidden_size=256,
                                 num_attention_heads=4, num_query_groups=2, window_size=(64, 0),
                                 window_attn_skip_freq=[1, 0, 0, 0, 0, 0],
                                 softmax_type="learnable", bf16=half, params_dtype=dtype,
                                 pipeline_dtype=dtype)
    ext = ExtConfig(pattern=PATTERN, attention_backend="sdpa", sparse_backend=backend,
                    **dict(SIZES, **options))
    torch.manual_seed(7)
    model = GPTModel(config, block_spec(config, ext=ext), vocab_size=96, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model.to(device="cuda", dtype=dtype)


def _batch(seed=3):
    tokens = torch.randint(0, 96, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.cuda()
    return tokens[:, :-1], torch.arange(SEQ, device="cuda").expand(2, -1), tokens[:, 1:]


def _loss(model, seed=3):
    tokens, positions, labels = _batch(seed)
    return model(tokens, positions, None, labels=labels).float().mean()


@pytest.mark.parametrize("stage", ["sparse", "dense_warmup"])
def test_auto_equals_the_reference_in_a_model(megatron_on_cuda, unit_scale, stage):
    """fp32: the fast paths give the reference backend's loss and gradients, every parameter
    (the indexers' from their KL losses included)."""
    fast, reference = (_model(backend, dsa_stage=stage) for backend in ("auto", "reference"))
    reference.load_state_dict(fast.state_dict())
    losses = []
    for model in (fast, reference):
        loss = _loss(model)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    indexers = 0
    for (name, a), b in zip(reference.named_parameters(), fast.parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            indexers += ".indexer." in name
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert indexers >= 9  # DSA's 5 and CSA's 4 indexer parameters all got gradients


def test_bf16_model_trains(megatron_on_cuda, unit_scale):
    """bf16 on the fast paths: the first loss is the fp32 reference model's up to bf16
    rounding, and 5 Adam steps on one batch lower it, every parameter receiving a gradient."""
    reference = _model("reference")
    model = _model("auto", torch.bfloat16)
    with torch.no_grad():
        expected = _loss(reference).item()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for step in range(6):
        optimizer.zero_grad(set_to_none=True)
        loss = _loss(model)
        losses.append(loss.item())
        if step == 5:
            break
        loss.backward()
        if step == 0:
            missing = [name for name, p in model.named_parameters() if p.grad is None]
            assert not missing, missing
        optimizer.step()
    assert all(map(torch.isfinite, torch.tensor(losses))), losses
    assert abs(losses[0] - expected) < 0.02 * expected, (losses[0], expected)
    assert losses[-1] < losses[0] - 0.1, losses
