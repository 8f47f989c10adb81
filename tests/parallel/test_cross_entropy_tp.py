"""Vocab-parallel cross-entropy (kernels.fused.cross_entropy, the loss `megatron-ext pretrain`
computes): two ranks, each holding half of the vocabulary's logits, give the loss over the whole
vocabulary and their columns of its gradient (the PyTorch pieces over gloo; the Triton kernels
equal those pieces on one shard: the fused kernels' first-use cases, on the interpreter in
tests/ops/test_triton_interpret_fused.py and on a GPU in tests/ops/test_fused_layer_ops.py)."""

import pytest
import torch

import harness

pytestmark = pytest.mark.dist

TOKENS, VOCAB = (7, 3), 50  # 25 columns a rank; the targets fall on both ranks


def _inputs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*TOKENS, VOCAB, generator=gen) * 3
    target = torch.randint(0, VOCAB, TOKENS, generator=gen)
    dloss = torch.randn(*TOKENS, generator=gen)
    return logits, target, dloss


def shard_loss_and_grad(rank, world_size):
    from megatron_ext.kernels.fused import cross_entropy

    logits, target, dloss = _inputs()
    width = VOCAB // world_size
    shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_()
    loss = cross_entropy(shard, target, rank * width, torch.distributed.group.WORLD,
                         backend="reference")
    (loss * dloss).sum().backward()
    return loss.detach(), shard.grad


def test_two_vocabulary_shards_give_the_whole_vocabularys_loss_and_gradient():
    from megatron_ext.kernels.fused import reference

    logits, target, dloss = _inputs()
    assert (target < VOCAB // 2).any() and (target >= VOCAB // 2).any()
    whole = logits.clone().requires_grad_()
    expected = reference.cross_entropy(whole, target)
    (expected * dloss).sum().backward()
    (loss0, grad0), (loss1, grad1) = harness.spawn(shard_loss_and_grad, 2)
    torch.testing.assert_close(loss0, expected.detach())
    torch.testing.assert_close(loss1, expected.detach())
    torch.testing.assert_close(torch.cat([grad0, grad1], dim=-1), whole.grad)
