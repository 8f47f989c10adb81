"""benchmarks/throughput.py's parts that run without a GPU (the kernel categories of the GPU-time
breakdown, the breakdown of a Chrome trace) and the FLOP count behind its MFU."""

import gzip
import json
import pathlib

import pytest

import harness

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def benchmark():
    return harness.load_script(ROOT / "benchmarks" / "throughput.py", "throughput_benchmark")


KERNELS = {  # names as seen in an H200 trace of `megatron-ext pretrain`
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64": "attention",
    "_bwd_state_kernel": "linear_mixer",
    "_short_conv_bwd_kernel": "mixer_glue",
    "_gated_norm_fwd_kernel": "mixer_glue",
    "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>": "elementwise_copy_reduce",
    "triton_poi_fused_add_cat_mul_rsub_sigmoid_silu_split_0": "elementwise_copy_reduce",
    "Memcpy DtoD (Device -> Device)": "elementwise_copy_reduce",
    "void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor>": "optimizer",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL": "communication",
    "some_unknown_kernel": "other",
}


def test_categories(benchmark):
    category = benchmark.categoriser()
    assert {name: category(name) for name in KERNELS} == KERNELS


def test_breakdown_of_a_trace(benchmark, tmp_path):
    events = [{"ph": "X", "cat": "kernel", "name": name, "ts": i * 10, "dur": 1000 * (i + 1)}
              for i, name in enumerate(KERNELS)]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10**6})
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    result = benchmark.breakdown(path, ms_per_iteration=100.0)
    expected_busy = sum(range(1, len(KERNELS) + 1))  # ms
    assert result["gpu_busy"] == expected_busy and result["idle"] == 100.0 - expected_busy
    assert result["gemm"] == 1.0 and result["mixer_glue"] == 4.0 + 5.0
    assert sum(result[c] for c in benchmark.CATEGORIES) == expected_busy


def test_flops_per_token():
    """hybrid-350m at T = 4096: 6 per matmul weight, 14 GDN layers of 16 value heads (K = V = 64)
    and 6 attention layers of 16 heads of 64."""
    from megatron_ext.launch.presets import load_settings, model_flops_per_token, parameter_count

    settings = load_settings("hybrid-350m")
    weights = parameter_count(settings) - 32000 * 1024
    linear = 16 * 3 * (6 * 64 * 64 + 2 * 64 * (2 * 64 + 64))
    expected = 6 * weights + 14 * linear + 6 * 6 * 4096 * 16 * 64
    assert model_flops_per_token(settings) == expected
    settings.ext.pattern = "*"
    assert model_flops_per_token(settings) > expected  # 20 attention layers at T = 4096
