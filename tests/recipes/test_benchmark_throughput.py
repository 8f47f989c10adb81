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
    "_short_conv_bwd_input_kernel": "mixer_glue",
    "_gated_norm_fwd_kernel": "mixer_glue",
    "_group_sum_kernel": "linear_mixer",
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
    assert result["kernels"] == len(KERNELS) and result["host_busy"] == [1000.0]


def test_host_busy(benchmark):
    """Per thread: overlapping events count once, gaps not at all, synchronisations are waits."""
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "tid": 1, "ts": 0, "dur": 4000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "tid": 1, "ts": 1000,
         "dur": 1000},  # inside the add
        {"ph": "X", "cat": "cpu_op", "name": "aten::item", "tid": 1, "ts": 10000, "dur": 5000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "tid": 1,
         "ts": 11000, "dur": 3000},
        {"ph": "X", "cat": "cpu_op", "name": "MulBackward0", "tid": 2, "ts": 0, "dur": 2500},
        {"ph": "X", "cat": "kernel", "name": "k", "tid": 3, "ts": 0, "dur": 9000},
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#9", "tid": 1, "ts": 0,
         "dur": 20000},
    ]
    assert benchmark.host_busy(events) == [4.0 + 5.0 - 3.0, 2.5]


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


def test_megatron_log_line(benchmark):
    """One iteration's line as megatron-core 0.19's training log writes it (with
    --log-throughput): its time, throughput by Megatron's formula and loss."""
    line = (" [2026-12-08 10:00:00.000000] iteration        7/      13 | consumed samples:"
            "          112 | elapsed time per iteration (ms): 340.2 | throughput per GPU "
            "(TFLOP/s/GPU): 395.4 | learning rate: 3.600000E-04 | global batch size:    16 |"
            " lm loss: 8.061235E+00 | loss scale: 1.0 | grad norm: 1.234 |")
    iteration = benchmark.ITERATION.search(line)
    assert iteration.groups() == ("7", "340.2")
    assert benchmark.TFLOPS.search(line).group(1) == "395.4"
    assert float(benchmark.LOSS.search(line).group(1)) == 8.061235


def test_origins_of_kernels(benchmark):
    """Each kernel's GPU time goes to the innermost megatron-ext / Megatron frame or autograd node
    around its launch (matched by correlation, on the launching thread), else to the innermost
    operator; an editable install's absolute paths are named by their package."""
    def host(cat, name, tid, ts, dur, correlation=None):
        args = {} if correlation is None else {"correlation": correlation}
        return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}

    def kernel(name, correlation, ms):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": 0, "dur": ms * 1000,
                "args": {"correlation": correlation}}

    events = [
        host("python_function", "megatron_ext/mixers/delta_rule.py(153): forward", 1, 0, 100),
        host("python_function", "megatron_ext/kernels/fused/ops.py(40): forward", 1, 5, 50),
        host("cpu_op", "aten::sum", 1, 10, 20),
        host("cuda_runtime", "cudaLaunchKernel", 1, 12, 2, correlation=1),
        host("python_function", "torch/nn/modules/module.py(1): _call_impl", 1, 200, 50),
        host("cpu_op", "aten::mm", 1, 205, 10),
        host("cuda_runtime", "cudaLaunchKernel", 1, 206, 2, correlation=3),
        host("cuda_runtime", "cudaLaunchKernel", 1, 300, 2, correlation=5),
        host("cpu_op", "autograd::engine::evaluate_function: MulBackward0", 2, 0, 50),
        host("cpu_op", "aten::mul", 2, 5, 10),
        host("cuda_runtime", "cudaLaunchKernel", 2, 6, 2, correlation=2),
        host("python_function", "/repo/kernels/fused/triton.py(258): short_conv_backward", 3, 0, 9),
        host("cuda_runtime", "cudaLaunchKernel", 3, 1, 2, correlation=4),
        kernel("void at::native::reduce_kernel<128, 4>", 1, 3.0),
        kernel("void at::native::vectorized_elementwise_kernel<4>", 2, 2.0),
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 3, 5.0),
        kernel("_short_conv_bwd_input_kernel", 4, 1.5),
        kernel("some_unknown_kernel", 5, 0.5),
        kernel("_bwd_state_kernel", 99, 4.0),
    ]
    roots = [("/repo/kernels/", "megatron_ext/kernels/")]
    assert benchmark.origins(events, roots) == {
        ("elementwise_copy_reduce", "megatron_ext/kernels/fused/ops.py(40): forward"): 3.0,
        ("elementwise_copy_reduce", "MulBackward0"): 2.0,
        ("gemm", "aten::mm"): 5.0,
        ("mixer_glue", "megatron_ext/kernels/fused/triton.py(258): short_conv_backward"): 1.5,
        ("other", "cudaLaunchKernel"): 0.5,
        ("linear_mixer", "(no launch found)"): 4.0,
    }
