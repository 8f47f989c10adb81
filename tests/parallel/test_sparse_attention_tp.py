"""MoBA, NSA, FoX, DSA, CSA, HCA and '*' with every softmax option (learnable sink, output
gate, QK-norm, XSA, a sliding window on the MoBA, FoX and '*' layers) under TP=2 and TP=2 + SP
equal the single process in loss and gradients, starting from its dist checkpoint resharded to
two ranks (so this is also the save -> load -> reshard test of the sink, the NSA gate, the
compression weights, FoX's forget gate, the CSA / HCA compressors (sharded over the key/value
heads) and the replicated DSA and CSA indexers, whose loss targets are summed over the ranks'
heads). DSA on MLA layers ('D' under dsa_attention_type: mla) likewise, beside '*'. The layers
are local to a pipeline stage; PP is tested with the other mixers
(test_parallel_equivalence.py). Helpers: tests/harness.py."""

import pytest

import harness

pytestmark = pytest.mark.dist

PATTERN = "BSFDCH*"
SPARSE = dict(harness.SHORT_SPARSE, attention_xsa=True)
OPTIONS = dict(softmax_type="learnable", attention_output_gate=True, qk_layernorm=True,
               window_size=(9, 0), window_attn_skip_freq=[1, 0, 1, 0, 0, 0, 1])


def _ext(**extra):
    from megatron_ext.config import ExtConfig

    return ExtConfig(**{"pattern": PATTERN, **SPARSE, **extra})


# The dense warm-up of DSA and CSA under TP=2 + SP: the indexers' losses over every causal key
# (every complete entry), whose targets each recomputed chunk sums over the ranks' heads (in
# backward too).
WARMUP_EXT = dict(pattern="DC*", dsa_stage="dense_warmup")
WARMUP_OPTIONS = dict(OPTIONS, window_attn_skip_freq=[0, 0, 1])

# DSA on MLA (XSA and a learnable sink on), MLA at the tiny model's scale: q/k heads of 16 + 8
# dims, v heads of 16 (so the core pads v).
MLA_EXT = dict(pattern="D*", dsa_attention_type="mla", mla_q_lora_rank=32, mla_kv_lora_rank=16,
               mla_qk_head_dim=16, mla_qk_pos_emb_head_dim=8, mla_v_head_dim=16)
MLA_OPTIONS = dict(softmax_type="learnable")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process runs (saving their checkpoints), then every TP=2 layout (loading
    them): two spawns in all. Before saving, the sink (near 0 at init), the NSA compression
    weights (at the mean) and the CSA / HCA compressors' position biases and norm weights (0
    and 1 for every head) get noise, so that each head's values differ and a shard in the wrong
    place shows."""
    root = tmp_path_factory.mktemp("sparse_tp")
    for name in ("sparse", "warmup", "mla"):
        (root / name).mkdir()
    sparse, warmup, mla = str(root / "sparse"), str(root / "warmup"), str(root / "mla")
    with pytest.MonkeyPatch.context() as patch:
        # Megatron compiles the output gate with torch.compile: ~30 s per process on two CPU
        # cores for the same math. The spawned ranks inherit the environment.
        patch.setenv("TORCH_COMPILE_DISABLE", "1")
        single = harness.spawn_layouts(1, [
            ("sparse", sparse, _ext(), dict(save=True, perturb=("core_attention", "compressor"),
                                            config_overrides=OPTIONS)),
            ("warmup", warmup, _ext(**WARMUP_EXT), dict(save=True, perturb="core_attention",
                                                        config_overrides=WARMUP_OPTIONS)),
            ("mla", mla, _ext(**MLA_EXT), dict(save=True, perturb="core_attention",
                                               config_overrides=MLA_OPTIONS))])
        parallel = harness.spawn_layouts(2, [
            ("tp2", sparse, _ext(), dict(tp=2, config_overrides=OPTIONS)),
            ("tp2-sp", sparse, _ext(), dict(tp=2, sequence_parallel=True,
                                            config_overrides=OPTIONS)),
            ("warmup-tp2-sp", warmup, _ext(**WARMUP_EXT),
             dict(tp=2, sequence_parallel=True, config_overrides=WARMUP_OPTIONS)),
            ("mla-tp2", mla, _ext(**MLA_EXT), dict(tp=2, config_overrides=MLA_OPTIONS)),
            ("mla-tp2-sp", mla, _ext(**MLA_EXT),
             dict(tp=2, sequence_parallel=True, config_overrides=MLA_OPTIONS))])
    return single, parallel


@pytest.mark.parametrize("layout", ["tp2", "tp2-sp"])
def test_tp2_equals_single_process(runs, layout):
    single, parallel = runs
    harness.assert_same_run(single["sparse"], parallel[layout])


def test_dsa_dense_warmup_tp2_sp_equals_single_process(runs):
    """The dense warm-up (WARMUP_EXT) under TP=2 + SP."""
    single, parallel = runs
    harness.assert_same_run(single["warmup"], parallel["warmup-tp2-sp"])


@pytest.mark.parametrize("layout", ["mla-tp2", "mla-tp2-sp"])
def test_dsa_on_mla_tp2_equals_single_process(runs, layout):
    """DSA on MLA layers (MLA_EXT) under TP=2 and TP=2 + SP."""
    single, parallel = runs
    harness.assert_same_run(single["mla"], parallel[layout])
