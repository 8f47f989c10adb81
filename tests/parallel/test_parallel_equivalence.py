"""Multi-process (gloo) runs must equal the single-process run in loss and gradients: TP=2,
TP=2 + SP, PP=2, PP=2 x VPP=2, the `hybrid_layer` spec object, and cross-layer routing
(CLVR, CLER-H) under TP.

The single-process run saves a Megatron dist checkpoint; every parallel layout starts from
random weights of its own and loads that checkpoint, resharded to its TP/PP/VPP split. (Fresh
initialisation cannot be compared across PP: each stage draws only its own layers' weights.)
So these tests are also the checkpoint save -> load -> reshard tests. All layouts run in one
two-process spawn, after one single-process spawn for the references.
The model is a tiny hybrid with every linear mixer kind of the registry and '*'. The helpers (building a
layout, running Megatron's schedule, gathering gradients) live in tests/harness.py.
"""

import pytest

import harness

pytestmark = pytest.mark.dist

# Every mixer of the registry but the sparse softmax ones (MoBA, NSA: their own sizes and
# options, in test_sparse_attention_tp.py): GDN, KDA, attention, GDN-2, DeltaNet, MLA, GLA,
# RetNet, Hedgehog, Lightning, Mamba-2, HGRN-2, RWKV-7; then attention, GDN and RWKV-7 again, to
# make 16 layers (PP=2 x VPP=2 takes a multiple of 4).
PATTERN = "GK*QN+ARYLMWV*GV"
# MLA at the tiny model's scale (latents of 32 and 16, 16 + 8 query/key dims per head).
MLA = dict(mla_q_lora_rank=32, mla_kv_lora_rank=16, mla_qk_head_dim=16,
           mla_qk_pos_emb_head_dim=8, mla_v_head_dim=16)


# name -> (tp, pp, vpp, sequence_parallel, spec, routing)
LAYOUTS = {
    "tp2": (2, 1, None, False, "block", "none"),              # tensor parallel
    "tp2-sp": (2, 1, None, True, "block", "none"),            # + sequence parallel
    "pp2": (1, 2, None, False, "block", "none"),              # pipeline parallel, 1F1B
    "pp2-vpp2": (1, 2, 2, False, "block", "none"),            # interleaved virtual pipeline
    "pp2-hybrid_layer": (1, 2, None, False, "layer", "none"),  # `--spec ... hybrid_layer` object
    "tp2-sp-clvr": (2, 1, None, True, "block", "clvr"),       # cross-layer value routing
    "tp2-hybrid_layer-cler_h": (2, 1, None, False, "layer", "cler_h"),  # write-residual routing
}
ROUTINGS = ("none", "clvr", "cler_h")


def _ext(routing):
    from megatron_ext.config import ExtConfig

    return ExtConfig(pattern=PATTERN, cross_layer_routing=routing, **MLA)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process run of each routing setting (saving its checkpoint), then every
    two-process layout (loading it): two spawns in all. Routing projections start at zero;
    the saved weights give them values, so the term is tested."""
    root = tmp_path_factory.mktemp("parallel_equivalence")
    for routing in ROUTINGS:
        (root / routing).mkdir()
    single = harness.spawn_layouts(1, [
        (routing, str(root / routing), _ext(routing),
         dict(save=True, perturb="routing_projection")) for routing in ROUTINGS])
    parallel = harness.spawn_layouts(2, [
        (name, str(root / routing), _ext(routing),
         dict(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, spec=spec))
        for name, (tp, pp, vpp, sp, spec, routing) in LAYOUTS.items()])
    return single, parallel


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_from_single_process_checkpoint_matches(runs, layout):
    single, parallel = runs
    harness.assert_same_run(single[LAYOUTS[layout][-1]], parallel[layout])
