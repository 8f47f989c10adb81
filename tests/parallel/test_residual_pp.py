"""Residual schemes across pipeline stages (gloo): mHC, block and full Attention Residuals in
PP=2 and PP=2 x VPP=2 (and TP=2 + SP) equal the single-process run in loss and gradients, with
the packed state sent between stages; every layout loads the single process's dist checkpoint,
so a checkpoint saved at PP=1 also loads at PP=2 with identical loss.

The model is tiny (4 layers, hidden 32) with a linear mixer ('G') and softmax attention ('*').
All layouts of one world size run in one spawn (harness.spawn_layouts): two spawns in all.
"""

import pytest

import harness

pytestmark = pytest.mark.dist

PATTERN = "G*G*"
CONFIG = dict(num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
              num_query_groups=2)
SCHEMES = {
    "mhc": dict(residual="mhc"),
    # Blocks of 3 layers span the border of two 2-layer stages.
    "attnres_block": dict(residual="attnres_block", attnres_block_layers=3),
    "attnres_full": dict(residual="attnres_full"),
}
# Interleaved schedules exchange the packed state's shape through non-blocking P2P (what
# Megatron's training arguments set for them; megatron_ext.residual.prepare demands it).
VPP = dict(overlap_p2p_comm=True, batch_p2p_comm=False)
# name -> (scheme, (tp, pp, vpp, sequence_parallel, spec), ExtConfig extras, config extras)
CASES = {
    "mhc-pp2": ("mhc", (1, 2, None, False, "block"), {}, {}),
    "mhc-pp2-vpp2": ("mhc", (1, 2, 2, False, "block"), {}, VPP),
    "mhc-pp2-vpp2-recompute": ("mhc", (1, 2, 2, False, "block"), dict(mhc_recompute=True), VPP),
    "mhc-pp2-hybrid_layer": ("mhc", (1, 2, None, False, "layer"), {}, {}),
    "mhc-tp2-sp": ("mhc", (2, 1, None, True, "block"), {}, {}),
    "attnres_block-pp2": ("attnres_block", (1, 2, None, False, "block"), {}, {}),
    "attnres_block-pp2-vpp2": ("attnres_block", (1, 2, 2, False, "block"), {}, VPP),
    "attnres_block-pp2-hybrid_layer": ("attnres_block", (1, 2, None, False, "layer"), {}, {}),
    "attnres_block-tp2-sp": ("attnres_block", (2, 1, None, True, "block"), {}, {}),
    "attnres_full-pp2": ("attnres_full", (1, 2, None, False, "block"), {}, {}),
    "attnres_full-pp2-vpp2": ("attnres_full", (1, 2, 2, False, "block"), {}, VPP),
}


def _ext(scheme, **extra):
    from megatron_ext.config import ExtConfig

    return ExtConfig(pattern=PATTERN, **SCHEMES[scheme], **extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Single-process references (saving the checkpoints) and every two-process layout: two
    spawns in all."""
    root = tmp_path_factory.mktemp("residual_pp")

    def job(name, scheme, layout, ext_extra, config_extra, save=False):
        tp, pp, vpp, sp, spec = layout
        return (name, str(root / scheme), _ext(scheme, **ext_extra),
                dict(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, save=save, spec=spec,
                     perturb="residual.", config_overrides={**CONFIG, **config_extra}))

    for scheme in SCHEMES:
        (root / scheme).mkdir()
    single = harness.spawn_layouts(1, [job(s, s, (1, 1, None, False, "block"), {}, {}, save=True)
                                       for s in SCHEMES])
    parallel = harness.spawn_layouts(2, [job(name, *case) for name, case in CASES.items()])
    return single, parallel


@pytest.mark.parametrize("case", list(CASES))
def test_layout_equals_single_process(runs, case):
    single, parallel = runs
    harness.assert_same_run(single[CASES[case][0]], parallel[case])
