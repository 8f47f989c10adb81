"""Residual schemes inside our transformer layer (megatron_ext.residual), in one process:

- mHC with its gating factors at zero is a fixed mixing of the streams around the layer's own
  sublayers (closed form below); with zero gates and biases it IS the standard residual;
- one block of Attention Residuals is the standard residual plus an isolated embedding source;
- full and block Attention Residuals and mHC equal a plain loop over the sublayers written
  from the papers' equations / the official pseudo-code with the reference ops;
- mHC recomputation gives the same gradients and keeps no stream tensor for backward;
- every mixer and MoE FFNs run inside a scheme, every scheme trains (also through
  `megatron-ext train`); bad settings fail early and name the field.
"""

import pytest
import torch

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.kernels.residual import EPS, reference

pytestmark = pytest.mark.usefixtures("megatron_single_process")

SEQ, BATCH, VOCAB, HIDDEN, STREAMS = 12, 2, 64, 32, 4


def _config(num_layers=4, **overrides):
    return harness.tiny_config(num_layers=num_layers, hidden_size=HIDDEN, ffn_hidden_size=64,
                               **overrides)


def _model(config, pattern="G*G*", seed=0, **ext):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    torch.manual_seed(seed)
    return GPTModel(config, block_spec(config, ext=ExtConfig(pattern=pattern, **ext)),
                    vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="none")


def _tokens(seed=1):
    return torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _loss(model, tokens=None):
    tokens = _tokens() if tokens is None else tokens
    return model(tokens[:, :-1], torch.arange(SEQ).expand(BATCH, -1), None,
                 labels=tokens[:, 1:]).mean()


def _like_standard(scheme_model, standard_model):
    """Give the scheme's model the standard model's weights (the scheme's own stay)."""
    missing, unexpected = scheme_model.load_state_dict(standard_model.state_dict(), strict=False)
    assert not unexpected and all(".residual." in k for k in missing)
    return scheme_model


def _sublayers(layer):
    """The layer's token mixer and FFN as functions of their input (before their norm)."""
    return (lambda u: layer.self_attention(layer.input_layernorm(u), attention_mask=None)[0],
            lambda u: layer.mlp(layer.pre_mlp_layernorm(u))[0])


def _perturb_residual(model, std=0.3):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".residual." in name:
                p.add_(std * torch.randn_like(p))


# ----------------------------------------------------------------------------------- mHC
def test_mhc_layer_with_zero_gates_is_a_fixed_mixing_of_streams():
    """With gate = 0 the coefficients are their static biases b, for every token:
    H_pre = sigmoid(b_pre) + eps, H_post = 2 sigmoid(b_post), H_res = Sinkhorn(b_res), so a
    middle layer maps X [s, b, n, h] to
        X1[j] = H_post1[j] A(sum_m H_pre1[m] X[m]) + sum_m H_res1[m, j] X[m]
        X2[j] = H_post2[j] M(sum_m H_pre2[m] X1[m]) + sum_m H_res2[m, j] X1[m]
    with A, M the layer's own mixer and FFN (norm included)."""
    model = _model(_config(), residual="mhc")
    layer = model.decoder.layers[1]
    connections = (layer.residual.mixer, layer.residual.ffn)
    with torch.no_grad():
        for connection in connections:
            connection.gate.zero_()
            connection.bias.normal_()
    x = torch.randn(SEQ, BATCH, STREAMS * HIDDEN)
    output, _ = layer(hidden_states=x, attention_mask=None)

    n = STREAMS
    streams = x.unflatten(-1, (n, HIDDEN))
    with torch.no_grad():
        for connection, sublayer in zip(connections, _sublayers(layer)):
            b = connection.bias.float()
            pre, post = torch.sigmoid(b[:n]) + EPS, 2 * torch.sigmoid(b[n:2 * n])
            res = reference.sinkhorn(b[2 * n:].view(n, n))
            y = sublayer(torch.einsum("m,sbmh->sbh", pre, streams))
            streams = post[:, None] * y[..., None, :] + torch.einsum("mj,sbmh->sbjh", res, streams)
    torch.testing.assert_close(output, streams.flatten(-2), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("collapse", ["learned", "mean"])
def test_mhc_with_zero_gates_and_biases_is_the_standard_residual(collapse):
    """Zero gates and biases: H_pre = 1/2 + eps, H_post = 1, H_res = J/n (up to eps). The n
    copies of the embedding stay equal: each sublayer reads n (1/2 + eps) x, which its RMSNorm
    (eps 0 here) maps to norm(x), and writes x + F(norm(x)). The collapse gives c x, which the
    final norm maps to norm(x). So the model is the standard one with the same weights."""
    config = _config(layernorm_epsilon=0.0)
    standard = _model(config)
    mhc = _like_standard(_model(_config(layernorm_epsilon=0.0), residual="mhc",
                                mhc_collapse=collapse), standard)
    with torch.no_grad():
        for name, p in mhc.named_parameters():
            if name.endswith((".gate", ".bias")) and ".residual." in name:
                p.zero_()
    torch.testing.assert_close(_loss(mhc), _loss(standard), rtol=1e-5, atol=1e-5)


def _mhc_reference(model, embedding):
    """mHC per the paper (algorithms.md a), with the reference ops, over the model's sublayers."""
    layers = model.decoder.layers
    streams = embedding.unsqueeze(-2).expand(*embedding.shape[:-1], STREAMS, HIDDEN)
    for layer in layers:
        for connection, sublayer in zip((layer.residual.mixer, layer.residual.ffn),
                                        _sublayers(layer)):
            mixes = reference.rms_project(streams.flatten(-2), connection.weight)
            pre, post, res = reference.mhc_coefficients(mixes, connection.bias, connection.gate,
                                                        STREAMS, connection.sinkhorn_iters)
            streams = reference.stream_update(
                streams, sublayer(reference.stream_mix(streams, pre)), post, res)
    head = layers[-1].residual.collapse
    mixes = reference.rms_project(streams.flatten(-2), head.weight)
    return reference.stream_mix(streams, torch.sigmoid(mixes * head.gate + head.bias) + EPS)


# ------------------------------------------------------------------- Attention Residuals
def _attnres_reference(model, embedding, block_layers):
    """Attention Residuals written from the paper's definition (full) and the official
    pseudo-code (block, with the partial sum starting as the embedding), reference ops."""

    def attend(query, sources):
        return reference.depth_attention(query.weight * query.norm_weight,
                                         [torch.stack(sources, -2)], query.eps)

    layers = model.decoder.layers
    sources, blocks, partial = [embedding], [], embedding
    for i, layer in enumerate(layers):
        queries = (layer.residual.mixer, layer.residual.ffn)
        for k, (query, sublayer) in enumerate(zip(queries, _sublayers(layer))):
            if block_layers is None:
                sources.append(sublayer(attend(query, sources)))
                continue
            h = attend(query, blocks + [partial])
            if k == 0 and i % block_layers == 0:
                blocks, partial = blocks + [partial], None
            partial = sublayer(h) if partial is None else partial + sublayer(h)
    return attend(layers[-1].residual.output,
                  sources if block_layers is None else blocks + [partial])


@pytest.mark.parametrize("scheme,settings", [
    ("attnres_full", {}),
    ("attnres_block", dict(attnres_block_layers=1)),
    ("attnres_block", dict(attnres_block_layers=3)),
    ("mhc", {}),
])
def test_scheme_equals_the_papers_loop(scheme, settings):
    """Output and gradients (of every parameter and of the embedding) of our layers equal those
    of the paper's loop written with the reference ops."""
    model = _model(_config(), residual=scheme, **settings)
    _perturb_residual(model)
    tokens = _tokens()[:, :-1]
    embedding = model.embedding(tokens, torch.arange(SEQ).expand(BATCH, -1)).detach()
    embedding.requires_grad_()
    ours = model.decoder(embedding, attention_mask=None)
    if scheme == "mhc":
        theirs = _mhc_reference(model, embedding)
    else:
        theirs = _attnres_reference(model, embedding, settings.get("attnres_block_layers"))
    theirs = model.decoder.final_layernorm(theirs)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(5))
    leaves = [embedding, *(p for p in model.decoder.parameters() if p.requires_grad)]
    for name, a, b in zip(["embedding", *(n for n, p in model.decoder.named_parameters()
                                          if p.requires_grad)],
                          torch.autograd.grad((ours * weights).sum(), leaves, allow_unused=True),
                          torch.autograd.grad((theirs * weights).sum(), leaves, allow_unused=True)):
        if a is None or b is None:
            assert a is None and b is None, name
            continue
        # fp32 sums in another order: 1e-5 of the gradient's scale (the embedding's reaches ~240)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()),
                                   msg=f"gradient of {name}")


def test_one_attnres_block_is_the_standard_residual_plus_an_isolated_embedding():
    """With one block the sources of every sublayer are the embedding e and the running sum
    S_l = sum_{j<l} f_j of the earlier outputs (the standard residual stream without e), so a
    sublayer reads a e + (1 - a) S_l: the standard residual with a learned weight on the
    embedding. With zero queries a = 1/2 everywhere (the first sublayer reads e alone), and
    with eps 0 the pre-norms map (e + S_l) / 2 to norm(e + S_l): the standard model exactly."""
    config = _config(layernorm_epsilon=0.0)
    standard = _model(config)
    one_block = dict(residual="attnres_block", attnres_block_layers=config.num_layers)
    attnres = _like_standard(_model(_config(layernorm_epsilon=0.0), **one_block), standard)
    torch.testing.assert_close(_loss(attnres), _loss(standard), rtol=1e-5, atol=1e-5)

    # Learned queries: every input is still on the segment between e and S_l.
    _perturb_residual(attnres)
    inputs, outputs = [], []
    for layer in attnres.decoder.layers:
        for norm, sublayer in ((layer.input_layernorm, layer.self_attention),
                               (layer.pre_mlp_layernorm, layer.mlp)):
            norm.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
            sublayer.register_forward_hook(lambda m, args, out: outputs.append(out[0]))
    embedding = attnres.embedding(_tokens()[:, :-1], torch.arange(SEQ).expand(BATCH, -1))
    with torch.no_grad():
        attnres.decoder(embedding, attention_mask=None)
    torch.testing.assert_close(inputs[0], embedding)
    for l in range(1, len(inputs)):
        total = torch.stack(outputs[:l]).sum(0)
        direction = embedding - total
        a = ((inputs[l] - total) * direction).sum(-1, keepdim=True) / direction.square().sum(
            -1, keepdim=True)
        torch.testing.assert_close(inputs[l], total + a * direction, rtol=1e-4, atol=1e-5)
        assert ((a >= 0) & (a <= 1)).all() and a.std() > 1e-3


# --------------------------------------------------------------- recomputation, MoE, training
def test_mhc_recompute_gives_the_same_gradients_and_keeps_no_streams():
    kept = _model(_config(), residual="mhc")
    recomputed = _model(_config(), residual="mhc", mhc_recompute=True)
    _perturb_residual(kept)
    recomputed.load_state_dict(kept.state_dict())
    bytes_kept, loss_kept = harness.saved_bytes(_loss, kept)
    bytes_recomputed, loss_recomputed = harness.saved_bytes(_loss, recomputed)
    loss_kept.backward()
    loss_recomputed.backward()
    assert loss_kept.item() == loss_recomputed.item()
    for (name, a), b in zip(kept.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)
    # Without recomputation every sublayer keeps its input streams and the collapse its own:
    # 2 L + 1 stream tensors of [s, b, n h] (fp32 here).
    stream_bytes = SEQ * BATCH * STREAMS * HIDDEN * 4
    assert bytes_kept - bytes_recomputed >= (2 * 4 + 1) * stream_bytes


def test_moe_layers_with_mhc_build_and_train_a_step():
    config = _config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                     moe_token_dispatcher_type="allgather")
    model = _model(config, pattern="G*", residual="mhc")
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MoELayer"] * 2
    _loss(model).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("scheme", ["mhc", "attnres_block"])
def test_every_mixer_of_the_registry_runs_inside_a_scheme(scheme):
    from megatron_ext.registry import MIXERS

    pattern = "".join(m.symbol for m in MIXERS)
    model = _model(_config(num_layers=len(pattern)), pattern=pattern, residual=scheme,
                   **harness.SHORT_SPARSE)
    _loss(model).backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("settings", [
    dict(residual="mhc", mhc_recompute=True),
    dict(residual="mhc", mhc_collapse="mean", cross_layer_routing="clvr"),
    dict(residual="attnres_block", attnres_block_layers=1),
    dict(residual="attnres_full"),
])
def test_tiny_hybrid_trains_with_each_scheme(settings):
    model = _model(_config(num_layers=2), pattern="G*", **settings)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(8):
        loss = _loss(model, tokens[:BATCH])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("settings,num_layers,match", [
    (dict(residual="hyper"), None, "residual='hyper' is not one of"),
    (dict(mhc_collapse="sum"), None, "mhc_collapse='sum' is not one of"),
    (dict(mhc_streams=0), None, "mhc_streams=0 must be a positive integer"),
    (dict(mhc_sinkhorn_iters=0), None, "mhc_sinkhorn_iters=0"),
    (dict(residual="attnres_block", attnres_block_layers=9), 4, "attnres_block_layers=9 exceeds"),
    (dict(mhc_recompute="yes"), None, "mhc_recompute='yes' must be true or false"),
])
def test_bad_settings_name_the_field(settings, num_layers, match):
    with pytest.raises(ConfigError, match=match):
        ExtConfig(**settings).validate(num_layers)


@pytest.mark.parametrize("overrides,match", [
    (dict(mtp_num_layers=1), "does not support mtp_num_layers=1"),
    (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
          pipeline_dtype=torch.float32), "needs overlap_p2p_comm=True and batch_p2p_comm=False"),
])
def test_model_configs_a_scheme_cannot_carry_are_refused(overrides, match):
    from megatron_ext import residual

    with pytest.raises(ConfigError, match=match):
        residual.prepare(_config(**overrides), ExtConfig(residual="mhc"))


@pytest.mark.parametrize(("backend", "compiled", "kernels"), [
    ("eager", False, False), ("compile", True, False), ("auto", False, True)])
@pytest.mark.parametrize("scheme", ["mhc", "attnres_block"])
def test_residual_backend_picks_how_the_ops_run(scheme, backend, compiled, kernels):
    """eager and compile run the PyTorch bodies only; auto lets our Triton kernels run (on
    CUDA, where each passes its check) and compiles the bodies on CUDA with Triton (not here).
    Every layer's scheme holds that backend."""
    from megatron_ext import residual
    from megatron_ext.kernels.residual import efficient

    ext = ExtConfig(residual=scheme, residual_backend=backend)
    expected = efficient.Backend(compiled=compiled, triton=kernels)
    assert residual.ops_backend(ext) == expected
    model = _model(_config(), residual=scheme, residual_backend=backend)
    schemes = [layer.residual for layer in model.decoder.layers]
    assert len(schemes) == 4 and all(s.backend == expected for s in schemes)


@pytest.mark.parametrize("scheme,settings,ops", [
    ("mhc", dict(mhc_recompute=True), {"mhc_pre", "stream_update", "rms_project", "stream_mix"}),
    ("attnres_block", dict(attnres_block_layers=2), {"depth_attention", "add_into_last_slot"}),
])
def test_every_op_call_runs_with_the_backend_its_scheme_holds(monkeypatch, scheme, settings,
                                                              ops):
    """Forward and backward (mHC: with the stream replay's recomputation) pass each scheme's
    ``backend`` to every residual-stream op, also after it has been replaced on the model."""
    from megatron_ext.kernels.residual import efficient

    model = _model(_config(), residual=scheme, **settings)
    backend = efficient.Backend(triton=False, triton_mhc=False)
    for layer in model.decoder.layers:
        layer.residual.backend = backend
    seen = []

    def recording(name, op):
        def call(*args, **kwargs):
            seen.append((name, kwargs.get("backend")))
            return op(*args, **kwargs)
        return call

    for name in ops:
        monkeypatch.setattr(efficient, name, recording(name, getattr(efficient, name)))
    _loss(model).backward()
    assert {name for name, _ in seen} == ops
    assert all(used is backend for _, used in seen), seen


def test_pipeline_config_gets_shape_exchange():
    from megatron_ext import residual

    config = _config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    residual.prepare(config, ExtConfig(residual="attnres_block"))
    assert config.variable_seq_lengths and config.hetereogenous_dist_checkpoint


def test_a_layer_fed_the_wrong_width_says_why():
    model = _model(_config(), residual="mhc")
    with pytest.raises(RuntimeError, match=r"expected \[s, b, 4 \* 32\].*variable_seq_lengths"):
        model.decoder.layers[1](hidden_states=torch.randn(SEQ, BATCH, HIDDEN), attention_mask=None)


def test_megatron_flags_carry_the_residual_settings():
    import argparse

    from megatron_ext.config import add_megatron_args

    parser = add_megatron_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ext-residual", "mhc", "--ext-mhc-recompute", "true",
                              "--ext-mhc-streams", "2"])
    ext = ExtConfig.from_megatron_args(args)
    assert (ext.residual, ext.mhc_recompute, ext.mhc_streams) == ("mhc", True, 2)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ext-mhc-recompute", "maybe"])


@pytest.fixture(scope="module")
def train_preset(tmp_path_factory):
    """A 2-layer `megatron-ext train` preset on a small corpus (prepared once per module)."""
    import sysconfig
    from pathlib import Path

    root = tmp_path_factory.mktemp("residual_train")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return root, dict(
        model=dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                   num_query_groups=2, seq_length=32, position_embedding_type="none"),
        data=dict(vocab_size=512, output_dir=str(root / "data"),
                  inputs=[str(stdlib / "email"), str(stdlib / "json")]),
        train=dict(micro_batch_size=2, global_batch_size=2, steps=3, warmup_steps=1,
                   log_interval=1, eval_interval=3, eval_batches=1, save_interval=3))


@pytest.mark.parametrize("settings", [
    dict(residual="mhc", mhc_recompute=True),
    dict(residual="attnres_block", attnres_block_layers=1),
    dict(residual="attnres_full"),
])
def test_megatron_ext_train_carries_the_scheme(train_preset, settings):
    import json
    import math
    import subprocess
    import sys

    import yaml

    root, preset = train_preset
    name = settings["residual"]
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(preset, ext=dict(pattern="G*", **settings))))
    done = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "train", "--preset",
                           str(path), "--run-dir", str(root / name), "--device", "cpu"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in open(root / name / "metrics.jsonl")]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert yaml.safe_load((root / name / "config.yaml").read_text())["ext"]["residual"] == name
