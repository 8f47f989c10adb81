"""Multi-process (gloo) runs must equal the single-process run in loss and gradients: TP=2,
TP=2 + SP, PP=2, PP=2 x VPP=2, the `hybrid_layer` spec object, and cross-layer routing
(CLVR, CLER-H) under TP.

The single-process run saves a Megatron dist checkpoint; every parallel layout starts from
random weights of its own and loads that checkpoint, resharded to its TP/PP/VPP split. (Fresh
initialisation cannot be compared across PP: each stage draws only its own layers' weights.)
So these tests are also the checkpoint save -> load -> reshard tests.
The model is a tiny hybrid with every mixer kind of the registry.
"""

import pytest
import torch

import harness

# Every mixer of the registry: GDN, KDA, attention, GDN-2, DeltaNet, GLA, RetNet, Lightning,
# Mamba-2.
PATTERN = "GK*QN*AR*LM*"
SEQ, BATCH, VOCAB, MICRO_BATCHES = 24, 2, 96, 2


def _batches():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, BATCH, SEQ + 1), generator=g)
    return [dict(tokens=t[:, :-1], labels=t[:, 1:],
                 position_ids=torch.arange(SEQ).expand(BATCH, SEQ)) for t in tokens]


def _build(tp=1, pp=1, vpp=None, sequence_parallel=False, spec="block", routing="none"):
    """Model chunks of this rank (one per virtual stage), same seed on every layout.

    ``spec="block"``: this stage's per-layer specs (block_spec); ``spec="layer"``: one
    PatternTransformerLayer spec for all layers, which picks its mixer by global layer number.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import PatternTransformerLayer, block_spec

    harness.init_parallel(tp=tp, pp=pp, vpp=vpp)
    config = harness.tiny_config(num_layers=len(PATTERN), tensor_model_parallel_size=tp,
                                 pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp,
                                 sequence_parallel=sequence_parallel)
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        torch.manual_seed(1234)
        if spec == "block":
            layer_spec = block_spec(config, ext=ExtConfig(pattern=PATTERN,
                                                          cross_layer_routing=routing), vp_stage=vp)
        else:
            layer_spec = ModuleSpec(module=PatternTransformerLayer, params={
                "ext": ExtConfig(pattern=PATTERN, cross_layer_routing=routing)})
        chunks.append(GPTModel(
            config, layer_spec,
            vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="none",
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp))
    return chunks, config


def _run_schedule(chunks, config):
    """Megatron's forward-backward schedule over two micro-batches; losses on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        b = next(iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    iterators = [iter(_batches()) for _ in chunks]
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=MICRO_BATCHES, seq_length=SEQ,
        micro_batch_size=BATCH, forward_only=False)
    return [float(r["loss"]) for r in reduced]


def _global_grads(chunks, config):
    """Gradients keyed by global layer number, with TP shards gathered later by the test.

    Under sequence parallelism, replicated weights used on each rank's slice of the sequence
    (norms) hold partial gradients; Megatron's finalize_model_grads sums them over TP, and so
    do we here.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for chunk in chunks:
        for p in chunk.parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    grads = {}
    for v, chunk in enumerate(chunks):
        offset = get_transformer_layer_offset(config, vp_stage=v if len(chunks) > 1 else None)
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            grads[".".join(parts)] = (p.grad.clone(), getattr(p, "partition_dim", None)
                                      if getattr(p, "tensor_model_parallel", False) else None)
    return grads


def run_layout(rank, world_size, ckpt_dir, tp=1, pp=1, vpp=None, sequence_parallel=False,
               save=False, spec="block", routing="none"):
    """Build this layout, load (or, for the reference, save) the checkpoint, run one step."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    chunks, config = _build(tp, pp, vpp, sequence_parallel, spec, routing)
    # Keys inside the checkpoint are global (per-layer numbers), so chunks never collide.
    state = {f"chunk{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
    if save:
        # Routing projections start at zero; give them weight so that the term is tested.
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if "routing_projection" in name:
                    torch.nn.init.normal_(p, std=0.05)
        dist_checkpointing.save(state, ckpt_dir)
    else:
        for chunk in chunks:  # prove that every weight comes from the checkpoint
            for p in chunk.parameters():
                torch.nn.init.normal_(p)
        loaded = dist_checkpointing.load(state, ckpt_dir)
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"chunk{v}"])
    losses = _run_schedule(chunks, config)
    return dict(losses=losses if ps.is_pipeline_last_stage() else None,
                tp_rank=ps.get_tensor_model_parallel_rank(),
                grads=_global_grads(chunks, config))


def _merge(results):
    """Losses from the last stage, and full gradients (TP shards concatenated)."""
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    merged = {}
    for name in {n for r in results for n in r["grads"]}:
        owners = sorted((r for r in results if name in r["grads"]), key=lambda r: r["tp_rank"])
        dim = owners[0]["grads"][name][1]
        shards = [r["grads"][name][0] for r in owners]
        merged[name] = shards[0] if dim is None else torch.cat(
            [shards[i] for i in sorted({r["tp_rank"]: i for i, r in enumerate(owners)}.values())],
            dim=dim)
    return losses, merged


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The one-process run for a routing setting (saved checkpoint, merged results), cached."""
    runs = {}

    def run(routing):
        if routing not in runs:
            ckpt = str(tmp_path_factory.mktemp(f"tp1_pp1_{routing}"))
            runs[routing] = ckpt, _merge(harness.spawn(run_layout, 1, ckpt, 1, 1, None, False,
                                                       True, "block", routing))
        return runs[routing]

    return run


def _assert_same(single, parallel, atol=2e-5):
    losses_1, grads_1 = single
    losses_n, grads_n = parallel
    torch.testing.assert_close(torch.tensor(losses_n), torch.tensor(losses_1), rtol=1e-5, atol=1e-6)
    assert grads_n.keys() == grads_1.keys()
    for name in grads_1:
        torch.testing.assert_close(grads_n[name], grads_1[name], rtol=1e-4, atol=atol, msg=name)


@pytest.mark.parametrize("tp,pp,vpp,sp,spec,routing", [
    (2, 1, None, False, "block", "none"),   # tensor parallel
    (2, 1, None, True, "block", "none"),    # + sequence parallel
    (1, 2, None, False, "block", "none"),   # pipeline parallel, 1F1B
    (1, 2, 2, False, "block", "none"),      # interleaved virtual pipeline
    (1, 2, None, False, "layer", "none"),   # the `--spec ... hybrid_layer` object across stages
    (2, 1, None, True, "block", "clvr"),    # cross-layer value routing under TP + SP
    (2, 1, None, False, "layer", "cler_h"),  # write-residual routing under TP
])
def test_layout_from_single_process_checkpoint_matches(single_process, tp, pp, vpp, sp, spec,
                                                       routing):
    ckpt, reference = single_process(routing)
    parallel = _merge(harness.spawn(run_layout, tp * pp, ckpt, tp, pp, vpp, sp, False, spec,
                                    routing))
    _assert_same(reference, parallel)
