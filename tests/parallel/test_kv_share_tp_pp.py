"""Cross-layer key/value sharing under TP = 2, TP = 2 + SP and PP = 2 (each stage holding whole
groups) equals the single-process run in loss and gradients, from its checkpoint."""

import pytest

import harness

pytestmark = pytest.mark.dist

PATTERN = "**G**G"  # softmax layers 1, 2 | 4, 5: one group of two per pipeline stage
LAYOUTS = {"tp2": dict(tp=2), "tp2-sp": dict(tp=2, sequence_parallel=True), "pp2": dict(pp=2)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_ext.config import ExtConfig

    root = str(tmp_path_factory.mktemp("kv_share"))
    ext = ExtConfig(pattern=PATTERN, attention_kv_share=2)
    single = harness.spawn_layouts(1, [("single", root, ext, dict(save=True))])["single"]
    return single, harness.spawn_layouts(2, [(name, root, ext, options)
                                             for name, options in LAYOUTS.items()])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(runs, layout):
    single, parallel = runs
    harness.assert_same_run(single, parallel[layout])
