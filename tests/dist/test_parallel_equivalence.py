"""Multi-process (gloo) runs must equal the single-process run in loss and gradients: TP=2,
TP=2 + SP, PP=2, PP=2 x VPP=2, the `hybrid_layer` spec object, and cross-layer routing
(CLVR, CLER-H) under TP.

The single-process run saves a Megatron dist checkpoint; every parallel layout starts from
random weights of its own and loads that checkpoint, resharded to its TP/PP/VPP split. (Fresh
initialisation cannot be compared across PP: each stage draws only its own layers' weights.)
So these tests are also the checkpoint save -> load -> reshard tests.
The model is a tiny hybrid with every linear mixer kind of the registry and '*'. The helpers (building a
layout, running Megatron's schedule, gathering gradients) live in tests/harness.py.
"""

import pytest

import harness

# Every mixer of the registry but the sparse softmax ones (MoBA, NSA: their own sizes and
# options, in test_sparse_attention_tp.py): GDN, KDA, attention, GDN-2, DeltaNet, GLA, RetNet,
# Lightning, Mamba-2.
PATTERN = "GK*QN*AR*LM*"


def _ext(routing):
    from megatron_ext.config import ExtConfig

    return ExtConfig(pattern=PATTERN, cross_layer_routing=routing)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The one-process run for a routing setting (saved checkpoint, merged results), cached.
    Routing projections start at zero; the saved weights give them values, so the term is
    tested."""
    runs = {}

    def run(routing):
        if routing not in runs:
            ckpt = str(tmp_path_factory.mktemp(f"tp1_pp1_{routing}"))
            runs[routing] = ckpt, harness.merge_layout(harness.spawn(
                harness.run_layout, 1, ckpt, _ext(routing), 1, 1, None, False, True, "block",
                "routing_projection"))
        return runs[routing]

    return run


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
    parallel = harness.merge_layout(harness.spawn(harness.run_layout, tp * pp, ckpt,
                                                  _ext(routing), tp, pp, vpp, sp, False, spec))
    harness.assert_same_run(reference, parallel)
