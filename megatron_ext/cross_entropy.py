"""The LM loss's cross-entropy in Megatron's loop without Transformer Engine.

With ``--cross-entropy-loss-fusion --cross-entropy-fusion-impl native`` (what ``megatron-ext
pretrain`` passes), Megatron's language models compute the loss with
``language_module.fused_vocab_parallel_cross_entropy``: torch.compile'd pieces that keep the
softmax of the whole ``[tokens, vocabulary]`` logits in fp32 between forward and backward and
make several fp32 passes over it. :func:`provide_fused_cross_entropy` puts
:func:`vocab_parallel_cross_entropy` in that name's place: the same arguments and result
(``[s, b, V / TP]`` logits, ``[s, b]`` targets, the tensor-parallel group; the loss ``[s, b]``
in fp32, the gradient in the logits' dtype), computed by ``megatron_ext.kernels.fused``'s
cross-entropy (one Triton pass over the logits forward and one backward, two all-reduces of
per-token statistics over the TP group, as Megatron's); it hands off to Megatron's own function
off CUDA and where our kernels fail their first-use check. ``megatron-ext pretrain`` calls it.
"""

from __future__ import annotations

from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

from megatron_ext.kernels import registry
from megatron_ext.kernels.fused import cross_entropy


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, tp_group):
    """Megatron's ``fused_vocab_parallel_cross_entropy``, computed by our kernels on CUDA."""
    logits = vocab_parallel_logits
    if registry.choose("cross_entropy", "auto", device=logits.device, dtype=logits.dtype) != "triton":
        return fused_vocab_parallel_cross_entropy(logits, target, tp_group)
    width = logits.shape[-1]
    return cross_entropy(logits, target, tp_group.rank() * width, tp_group, backend="triton")


def provide_fused_cross_entropy() -> None:
    """Make Megatron's language models' fused cross-entropy :func:`vocab_parallel_cross_entropy`."""
    from megatron.core.models.common.language_module import language_module

    language_module.fused_vocab_parallel_cross_entropy = vocab_parallel_cross_entropy
