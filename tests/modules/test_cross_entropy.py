"""megatron_ext.cross_entropy: the loss slot `megatron-ext pretrain` fills, and the op's
PyTorch path against the definition (the Triton kernels: tests/ops/test_triton_interpret_fused.py
and the GPU tests; two vocabulary shards: tests/parallel/test_cross_entropy_tp.py)."""

import torch

from megatron_ext.kernels.fused import cross_entropy, reference


def test_provide_fills_megatrons_fused_cross_entropy_slot(monkeypatch):
    from megatron.core.models.common.language_module import language_module

    from megatron_ext.cross_entropy import provide_fused_cross_entropy, vocab_parallel_cross_entropy

    monkeypatch.setattr(language_module, "fused_vocab_parallel_cross_entropy",
                        language_module.fused_vocab_parallel_cross_entropy)
    provide_fused_cross_entropy()
    assert language_module.fused_vocab_parallel_cross_entropy is vocab_parallel_cross_entropy


def test_one_shard_is_the_definition_forward_and_backward():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 2, 40, generator=gen) * 3
    target = torch.randint(0, 40, (6, 2), generator=gen)
    probe = torch.randn(6, 2, generator=gen)
    grads = []
    for function in (lambda x: cross_entropy(x, target, backend="reference"),
                     lambda x: reference.cross_entropy(x, target)):
        leaf = logits.clone().requires_grad_()
        (function(leaf) * probe).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(cross_entropy(logits, target, backend="reference"),
                               reference.cross_entropy(logits, target))
    torch.testing.assert_close(grads[0], grads[1])
