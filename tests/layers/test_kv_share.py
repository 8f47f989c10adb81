"""Cross-layer key/value sharing (CLA): the later '*' layers of a group attend to the keys and
values of the group's first, have no key/value projection of their own, and train; groups
split by the pipeline are refused. TP = 2 (+SP) and PP = 2 equal one process:
tests/parallel/test_kv_share_tp_pp.py."""

import pytest
import torch

import harness
from megatron_ext.config import ConfigError, ExtConfig

pytestmark = pytest.mark.usefixtures("megatron_single_process")


def model_of(pattern, share):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=len(pattern))
    torch.manual_seed(0)
    return GPTModel(config, block_spec(config, ext=ExtConfig(pattern=pattern, attention_kv_share=share)),
                    vocab_size=96, max_sequence_length=64, position_embedding_type="rope")


def test_consumers_attend_to_the_producers_keys_and_values():
    model = model_of("*G**", share=3)
    attentions = [layer.self_attention for layer in model.decoder.layers]
    producer, consumers = attentions[0], attentions[2:]
    assert producer.produces and not any(c.produces for c in consumers)
    q_size = producer.query_projection_size
    assert producer.linear_qkv.weight.shape[0] > q_size
    assert all(c.linear_qkv.weight.shape[0] == q_size for c in consumers)

    seen = []
    for attention in (producer, *consumers):
        attention.core_attention.register_forward_pre_hook(
            lambda module, args: seen.append(args[:3]))
    tokens = torch.randint(0, 96, (2, 17))
    loss = model(tokens, torch.arange(17).expand(2, -1), None, labels=tokens).mean()
    (q0, k0, v0), *rest = seen
    for q, k, v in rest:  # the same rotated keys and values, their own queries
        torch.testing.assert_close(k, k0)
        torch.testing.assert_close(v, v0)
        assert not torch.allclose(q, q0)
    loss.backward()  # the consumers' gradients reach the producer's key/value rows
    grad_with = producer.linear_qkv.weight.grad.clone()
    model.zero_grad()
    for consumer in consumers:
        consumer.core_attention.register_forward_hook(lambda module, args, out: out.detach())
    model(tokens, torch.arange(17).expand(2, -1), None, labels=tokens).mean().backward()
    assert not torch.allclose(grad_with, producer.linear_qkv.weight.grad)


def test_a_hybrid_with_shared_keys_and_values_trains():
    model = model_of("*G*G*G", share=3)
    tokens = torch.randint(0, 96, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = harness.fit(model, tokens)
    assert losses[-1] < losses[0] - 0.5, losses


def test_a_group_split_by_the_pipeline_is_refused():
    from megatron_ext.mixers.kv_share import share_groups
    from megatron_ext.pattern import expand_pattern

    ext = ExtConfig(pattern="*G**", attention_kv_share=2)
    mixers = expand_pattern(ext.pattern, 4)
    assert set(share_groups(mixers, ext, [0, 1, 2, 3])) == {0, 2, 3}
    with pytest.raises(ConfigError, match=r"softmax layers \[1, 3\] share keys"):
        share_groups(mixers, ext, [0, 1])
    with pytest.raises(ConfigError, match="positive integer"):
        ExtConfig(attention_kv_share=0).validate()


def test_decoding_with_shared_keys_and_values():
    """Prefill and then one token per forward (Megatron's static inference context, a KV cache
    per layer) give the logits of one forward."""
    from megatron.core.inference.contexts import StaticInferenceContext

    model = model_of("*G**", share=3).eval()
    tokens = torch.randint(0, 96, (2, 15), generator=torch.Generator().manual_seed(3))
    context = StaticInferenceContext(max_batch_size=2, max_sequence_length=32)
    context.materialize_only_last_token_logits = False
    with torch.no_grad():
        full = model(tokens, torch.arange(15).expand(2, -1), None)
        pieces = [model(tokens[:, :9], torch.arange(9).expand(2, -1), None,
                        inference_context=context)]
        context.sequence_len_offset, _ = 9, context.enable_decode_mode()
        for t in range(9, 15):
            pieces.append(model(tokens[:, t:t + 1], torch.full((2, 1), t), None,
                                inference_context=context))
            context.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=2e-5, rtol=1e-4)
