"""MoBA, NSA, DSA, CSA, HCA and '*' with every softmax option (learnable sink, output gate,
QK-norm, XSA, a sliding window on the MoBA and '*' layers) under TP=2 and TP=2 + SP equal the
single process in loss and gradients, starting from its dist checkpoint resharded to two ranks
(so this is also the save -> load -> reshard test of the sink, the NSA gate, the compression
weights, the CSA / HCA compressors (sharded over the key/value heads) and the replicated DSA and
CSA indexers, whose loss targets are summed over the ranks' heads). The layers are local to a
pipeline stage; PP is tested with the other mixers (test_parallel_equivalence.py). Helpers:
tests/harness.py."""

import pytest

import harness

PATTERN = "BSDCH*"
SPARSE = dict(harness.SHORT_SPARSE, attention_xsa=True)
OPTIONS = dict(softmax_type="learnable", attention_output_gate=True, qk_layernorm=True,
               window_size=(9, 0), window_attn_skip_freq=[1, 0, 0, 0, 0, 1])


def _ext():
    from megatron_ext.config import ExtConfig

    return ExtConfig(pattern=PATTERN, **SPARSE)


@pytest.fixture(scope="module")
def no_compile():
    # Megatron compiles the output gate with torch.compile: ~30 s per process on two CPU cores
    # for the same math. The spawned ranks inherit the environment.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_COMPILE_DISABLE", "1")
        yield


@pytest.fixture(scope="module")
def single_process(no_compile, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("sparse_tp1"))
    # The sink starts near 0, the NSA compression weights at the mean and the CSA / HCA
    # compressors' position biases and norm weights at 0 and 1 for every head: noise makes
    # each head's values differ, so that a shard in the wrong place shows.
    return ckpt, harness.merge_layout(harness.spawn(
        harness.run_layout, 1, ckpt, _ext(), 1, 1, None, False, True, "block",
        ("core_attention", "compressor"), OPTIONS))


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_equals_single_process(no_compile, single_process, sp):
    ckpt, reference = single_process
    parallel = harness.merge_layout(harness.spawn(
        harness.run_layout, 2, ckpt, _ext(), 2, 1, None, sp, False, "block", None, OPTIONS))
    harness.assert_same_run(reference, parallel)


def test_dsa_dense_warmup_tp2_sp_equals_single_process(no_compile, tmp_path):
    """The dense warm-up of DSA and CSA under TP=2 + SP: the indexers' losses over every causal
    key (every complete entry), whose targets each recomputed chunk sums over the ranks' heads
    (in backward too)."""
    from megatron_ext.config import ExtConfig

    ext = ExtConfig(pattern="DC*", dsa_stage="dense_warmup", **SPARSE)
    options = dict(OPTIONS, window_attn_skip_freq=[0, 0, 1])
    ckpt = str(tmp_path)
    reference = harness.merge_layout(harness.spawn(
        harness.run_layout, 1, ckpt, ext, 1, 1, None, False, True, "block", "core_attention",
        options))
    parallel = harness.merge_layout(harness.spawn(
        harness.run_layout, 2, ckpt, ext, 2, 1, None, True, False, "block", None, options))
    harness.assert_same_run(reference, parallel)
