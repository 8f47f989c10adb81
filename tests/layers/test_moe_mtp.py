"""DeepSeek-V3's training extras with our layer specs, in `megatron-ext train`'s model and loop
on a CPU: multi-token prediction (Megatron's MTP block around our last layer's spec) and
auxiliary-loss-free expert balancing (the router's expert bias moves after each step by the
update rate, up for experts below the mean load)."""

import pytest
import torch

from megatron_ext import train
from megatron_ext.config import ConfigError

pytestmark = pytest.mark.usefixtures("megatron_single_process")


def settings(**model):
    return train.RunSettings.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "num_query_groups": 2, "seq_length": 32, "position_embedding_type": "none",
                  "num_moe_experts": 4, "moe_router_topk": 2, **model},
        "ext": {"pattern": "G*"}, "data": {"vocab_size": 96},
        "train": {"micro_batch_size": 2, "global_batch_size": 2, "steps": 10, "warmup_steps": 1,
                  "lr": 3e-3, "min_lr": 3e-4},
    }).validate()


def build(s):
    runtime = train.Runtime(device=torch.device("cpu"), rank=0, world_size=1)
    torch.manual_seed(0)
    model = train.build_model(s, train.transformer_config(s, runtime), 128)
    model, optimizer, scheduler = train.build_optimizer(model, s, runtime)
    return model, optimizer, scheduler, runtime


def batches(steps):
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 96, (steps, 2, 33), generator=generator)
    return [[{"tokens": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(32).expand(2, -1),
              "loss_mask": torch.ones(2, 32)}] for t in tokens]


def test_moe_hybrid_with_mtp_and_expert_bias_trains():
    s = settings(mtp_num_layers=1, moe_router_enable_expert_bias=True,
                 moe_router_bias_update_rate=0.01)
    model, optimizer, scheduler, runtime = build(s)
    assert len(model.mtp.layers) == 1
    routers = [m for m in model.modules() if hasattr(m, "expert_bias")]
    assert len(routers) == 3  # two decoder layers' MoE and the MTP layer's
    fixed = batches(1)[0]
    losses = []
    for _ in range(10):
        before = [r.expert_bias.clone() for r in routers]
        loss, _ = train._train_step(model, optimizer, scheduler, fixed, s, runtime)
        losses.append(loss)
        for router, bias in zip(routers, before):
            assert router.local_tokens_per_expert.sum() == 0  # the step's loads, used and reset
            step = (router.expert_bias - bias).abs()
            assert (step > 0).any() and torch.all((step < 1e-6) | ((step - 0.01).abs() < 1e-6))
    assert losses[-1] < losses[0] - 0.3, losses


def test_expert_bias_moves_towards_balance():
    s = settings(moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    model, optimizer, scheduler, runtime = build(s)
    router = next(m for m in model.modules() if hasattr(m, "expert_bias"))
    seen = []
    router.register_forward_hook(lambda module, args, out: seen.append(
        module.local_tokens_per_expert.clone()))
    bias = router.expert_bias.clone()
    train._train_step(model, optimizer, scheduler, batches(1)[0], s, runtime)
    load = seen[-1]
    want = bias + 0.01 * torch.sign(load.mean() - load)
    torch.testing.assert_close(router.expert_bias, want)


def test_mtp_adds_its_scaled_loss_to_the_gradient():
    """The MTP layer's parameters get gradients from the main loss's backward (its loss joins
    through Megatron's MTPLossAutoScaler), and a larger scaling factor gives larger ones."""
    norms = []
    for factor in (0.1, 1.0):
        s = settings(num_moe_experts=None, mtp_num_layers=1, mtp_loss_scaling_factor=factor)
        model, optimizer, _, runtime = build(s)
        train._forward_backward(model, batches(1)[0], s, runtime, forward_only=False)
        grads = [p.grad for n, p in model.named_parameters() if n.startswith("mtp.")]
        assert grads and all(g is not None for g in grads)
        norms.append(torch.stack([g.norm() for g in grads]).norm())
    assert norms[1] > 5 * norms[0]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="set model.num_moe_experts"):
        settings(num_moe_experts=None, moe_router_enable_expert_bias=True)
    with pytest.raises(ConfigError, match="mtp_num_layers=0"):
        settings(mtp_num_layers=0)
