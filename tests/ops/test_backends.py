"""kernels/backends.py: the Triton self-check runs in a child process, its verdict is cached per
machine key in memory and on disk, a failing verdict keeps auto (kernels/registry.py) on the
chunked path, and auto is the chunked path off CUDA."""
import dataclasses
import json

import pytest
import torch

from megatron_ext.kernels import backends, registry


def test_selfcheck_child_reports_failures_off_cuda():
    """The child processes run the real checks; on a CPU our Triton kernels cannot run, so every
    job is a failure with the reason, and each job asked for is reported."""
    jobs = backends.selfcheck_jobs("decay_linear_attention")
    from megatron_ext.kernels.cases import DTYPES
    from megatron_ext.kernels.selfcheck import OPS

    assert len(jobs) == len(OPS["decay_linear_attention"].cases) * len(DTYPES)  # None: every job
    verdicts = backends._run_selfcheck("decay_linear_attention", torch.device("cpu"), jobs)
    assert list(verdicts) == list(jobs)
    for (case, dtype), verdict in verdicts.items():
        assert not verdict["passed"] and "CUDA devices" in verdict["reason"]
        assert f"{case}/{dtype}:" in verdict["reason"]


def test_a_call_relies_on_the_jobs_of_its_form_and_dtype():
    """Those of its form (for GDN and KDA also the segmented state walks) in its dtype, and the
    packed case where it packs sequences."""
    assert backends.selfcheck_jobs("gated_delta_rule", "gated_deltanet", torch.bfloat16) == (
        ("gated_deltanet", "bfloat16"), ("gated_deltanet_segmented", "bfloat16"))
    assert backends.selfcheck_jobs("gated_delta_rule", "deltanet", torch.float16) == (
        ("deltanet", "bfloat16"),)  # fp16 relies on the bf16 check
    assert backends.selfcheck_jobs("gated_delta_rule", "gdn2", torch.float32, packed=True) == (
        ("gdn2", "float32"), ("kda_packed", "float32"))
    assert backends.selfcheck_jobs("decay_linear_attention", "per_head", torch.bfloat16,
                                   packed=True) == (("per_head", "bfloat16"),
                                                    ("per_channel_packed", "bfloat16"))


def test_the_segmented_cases_segment_the_triton_walks():
    """The self-check's segmented cases are long enough, at few enough walks, for the delta-rule
    Triton kernels to cut their state walks into segments on a GPU of 128 SMs (the CPU stands
    for one)."""
    pytest.importorskip("triton")
    from megatron_ext.kernels import selfcheck
    from megatron_ext.kernels.delta_rule.triton import _segment_chunks

    chunks = -(-selfcheck.SEGMENTED_LEN // 64)
    assert _segment_chunks(selfcheck.VALUE_HEADS, selfcheck.KEY_DIM, selfcheck.VALUE_DIM, chunks,
                           torch.device("cpu")) == 16


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    """A GPU key with no verdict yet, in memory or in a cache directory of its own."""
    monkeypatch.setenv("MEGATRON_EXT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backends, "_VERDICTS", {})
    monkeypatch.setattr(backends, "_device_key", lambda device: "fake GPU | versions")


def test_verdict_is_cached_in_memory_and_on_disk(tmp_path, monkeypatch, fresh_machine):
    """Each job's verdict is checked once per machine: kept in memory and on disk, and a later
    call checks only the jobs it has not seen; an op passes for a call when all its jobs do."""
    runs = []

    def fake_check(op, device, jobs):
        runs.append((op, tuple(jobs)))
        return {job: {"passed": job[0] != "kda", "reason": f"measured {job[0]}"} for job in jobs}

    monkeypatch.setattr(backends, "_run_selfcheck", fake_check)
    gdn = backends.selfcheck_jobs("gated_delta_rule", "gated_deltanet", torch.bfloat16)
    kda = backends.selfcheck_jobs("gated_delta_rule", "kda", torch.bfloat16)
    assert backends.triton_verdict("gated_delta_rule", "cuda:0", gdn)["passed"]
    verdict = backends.triton_verdict("gated_delta_rule", "cuda:0", gdn + kda)
    assert not verdict["passed"] and verdict["reason"] == "measured kda"
    assert backends.triton_verdict("gated_delta_rule", "cuda:0", gdn)["passed"]
    assert runs == [("gated_delta_rule", gdn), ("gated_delta_rule", kda)]  # each job once

    cache = json.loads((tmp_path / "selfcheck.json").read_text())
    assert cache["fake GPU | versions"]["gated_delta_rule/kda/bfloat16"] == {
        "passed": False, "reason": "measured kda"}
    monkeypatch.setattr(backends, "_VERDICTS", {})  # a new process: read from disk, not rerun
    assert not backends.triton_verdict("gated_delta_rule", "cuda:0", kda)["passed"]
    assert len(runs) == 2


def test_auto_follows_the_verdict(monkeypatch):
    """The registry's "auto" runs triton on CUDA where its self-check passed, chunked where it
    failed and off CUDA, and asks no self-check for a call the kernels do not take."""
    verdicts = {"gated_delta_rule": True, "decay_linear_attention": False}
    asked = []

    def verdict(op, device, jobs=None):
        asked.append(op)
        return {"passed": verdicts[op], "reason": "measured"}

    monkeypatch.setattr(backends, "triton_verdict", verdict)
    assert registry.choose("gated_delta_rule", "auto", device="cuda:0") == "triton"
    assert registry.choose("decay_linear_attention", "auto", device="cuda:0") == "chunked"
    assert registry.choose("gated_delta_rule", "auto", device="cpu") == "chunked"
    # a call the kernels decline never runs (or waits for) the self-check
    assert registry.choose("gated_delta_rule", "auto", device="cuda:0", key_dim=8,
                           value_dim=64) == "chunked"
    assert asked == ["gated_delta_rule", "decay_linear_attention"]


def test_one_process_at_a_time_runs_the_selfcheck(monkeypatch, fresh_machine):
    """Two processes (here threads, each with its own open lock file, which flock keeps apart as
    it does processes) asking at once: one runs the check, the other waits and reads its verdict."""
    import threading
    import time

    runs = []

    def slow_check(op, device, jobs):
        runs.append(op)
        time.sleep(0.5)
        return {job: {"passed": True, "reason": "measured"} for job in jobs}

    monkeypatch.setattr(backends, "_run_selfcheck", slow_check)
    verdicts = []

    def ask():
        verdicts.append(backends.triton_verdict("gated_delta_rule", "cuda:0"))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs == ["gated_delta_rule"]
    assert [verdict["passed"] for verdict in verdicts] == [True, True]


def test_auto_runs_chunked_for_head_dims_the_triton_kernels_do_not_take(monkeypatch):
    """Where "auto" would pick triton (a GPU whose self-check passed), head dims outside
    TRITON_HEAD_DIMS (Mamba-2's state dim 8, a summary's V + K = 384) run the chunked form
    instead of raising: the choice for these inputs' facts on a CUDA device (nothing runs there)."""
    monkeypatch.setattr(backends, "triton_verdict", lambda op, device, jobs=None: {"passed": True})
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 9, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 9, 2, 24, generator=g)
    beta = torch.rand(1, 9, 2, generator=g)
    decay = -torch.rand(1, 9, 2, generator=g)
    cuda = torch.device("cuda", 0)

    def on_cuda(op, *args, **kwargs):
        return registry.choose(op, "auto", dataclasses.replace(registry.get(op).facts(*args, **kwargs),
                                                               device=cuda))

    assert on_cuda("decay_linear_attention", q, k, v, g=decay) == "chunked"
    assert on_cuda("gated_delta_rule", q, k, v, beta=beta) == "chunked"
    wide = torch.zeros(1, 9, 2, 64), torch.zeros(1, 9, 2, 128)
    assert on_cuda("decay_linear_attention", wide[0], wide[0], wide[1], g=decay) == "triton"
    assert on_cuda("gated_delta_rule", wide[0], wide[0], wide[1], beta=beta) == "triton"
    assert backends.triton_dims_reason(q, v) == ("K = 8, V = 24: the Triton kernels take head dims "
                                                 "16, 32, 64, 128, 256")
    assert backends.triton_dims_reason(torch.zeros(1, 1, 1, 64), torch.zeros(1, 1, 1, 128)) is None


def test_first_use_check_runs_with_autograd_inside_no_grad():
    """passes_first_use_check gives its check autograd whatever the caller's mode (a first use
    in generation must still check the backward), and a check that raises fails."""
    import logging

    from megatron_ext.kernels.first_use import passes_first_use_check

    def check(device, dtype):
        x = torch.ones(3, dtype=dtype, device=device, requires_grad=True)
        (2 * x).sum().backward()
        return {"grad": (x.grad - 2).abs().max().item()}

    log = logging.getLogger("test")
    with torch.no_grad():
        assert passes_first_use_check(check, "cpu", torch.float32, 0.0, "k", "r", log)
    assert not passes_first_use_check(lambda d, t: 1 / 0, "cpu", torch.float32, 0.0, "k", "r", log)
