"""``megatron-ext doctor`` on the CPU: every check passes, a broken backend fails it, and a
backend that cannot run here is listed with its reason. (A CPU run takes ~4 s.)"""
import dataclasses
import json
import sys
import types

import pytest
import torch

from megatron_ext import cli
from megatron_ext.kernels import registry, selfcheck
from megatron_ext.kernels.backends import fla_unavailable_reason


def run_doctor(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    exit_code = cli.main(["doctor", "--device", "cpu", "--json", str(path)])
    output = capsys.readouterr().out
    return exit_code, output, json.loads(path.read_text())


def rows(output, *cells):
    """The table lines that start with these cells (op, case, backend, ...)."""
    return [line for line in output.splitlines() if line.split()[: len(cells)] == list(cells)]


def statuses(report, op, case, backend):
    """The statuses of the results in the ``--json`` report with this op, case and backend."""
    return [r["status"] for r in report["results"] if (r["op"], r["case"], r["backend"]) == (op, case, backend)]


def replace_backend(monkeypatch, op, name, **changes):
    """Replace fields of a backend of ``op`` in the registry for this test."""
    declared = registry.get(op).backends
    monkeypatch.setitem(declared, name, dataclasses.replace(declared[name], **changes))


def test_every_cpu_check_passes(tmp_path, capsys):
    exit_code, output, report = run_doctor(tmp_path, capsys)
    assert exit_code == 0, output
    assert report["complete"] and report["exit_code"] == 0
    assert report["environment"]["torch"] == torch.__version__

    results = report["results"]
    ran = [r for r in results if r["status"] != "skip"]
    assert ran and all(r["status"] == "pass" for r in ran), output
    for op in selfcheck.OPS.values():  # every case of every op, in fp32 and bf16, chunked and auto
        for case in op.cases:  # but the segmented ones: the Triton kernels' alone, no row here
            for dtype in ("float32", "bfloat16"):
                checked = {r["backend"] for r in ran
                           if (r["op"], r["case"], r["dtype"]) == (op.name, case.name, dtype)}
                assert checked == (set() if case.segmented else {"chunked", "auto"}), (op.name, case.name, dtype)
    assert not [r for r in results if r["case"].endswith("_segmented")]
    some = next(r for r in ran if r["case"] == "kda_packed" and r["dtype"] == "float32")
    assert some["errors"]["o"] < 1e-5 and "grad_initial_state" in some["errors"]
    assert "0 failed" in output and "ok: what backend='auto' runs here" in output

    # fla-core and our Triton kernels cannot run on the CPU: one row per op that has the
    # backend, with the reason.
    for backend in ("fla", "triton"):
        skipped = [r for r in results if r["backend"] == backend and r["op"] in selfcheck.OPS]
        assert [r["op"] for r in skipped] == [name for name, op in selfcheck.OPS.items()
                                              if backend in op.declared.backends]
        assert all(r["status"] == "skip" and r["errors"] == {} for r in skipped)
    # Nor the first-use checks of the sparse FlashAttention path, the residual kernels, the
    # selected-attention kernels, MoBA's selection kernel, NSA's block-importance kernel and the
    # fused layer kernels.
    first_use = [r for r in results if r["op"] not in selfcheck.OPS]
    assert [(r["op"], r["backend"]) for r in first_use] == (
        [("sparse_attention", "flash")] * 4 + [("sinkhorn", "triton")] + [("mhc", "triton")] * 2
        + [("depth_attention", "triton")] * 2 + [("add_into_last_slot", "triton")] * 2
        + [("selected_attention", "triton")] * 3 + [("moba_selection", "triton")] * 3
        + [("nsa_selection", "triton")] * 3 + [("fused_layer_ops", "triton")] * 2)
    assert all(r["status"] == "skip" and "CUDA" in r["skipped_reason"] for r in first_use)
    fla = next(r for r in results if r["backend"] == "fla")
    assert fla["skipped_reason"] == fla_unavailable_reason("kda", "cpu", requires_grad=True)
    [line] = rows(output, "gated_delta_rule", "*", "fla")
    assert "skip" in line and fla["skipped_reason"] in line


def test_a_broken_backend_fails_the_doctor(tmp_path, capsys, monkeypatch):
    chunked = registry.get("gated_delta_rule").backends["chunked"].function

    def ten_percent_off(*args, **kwargs):
        o, final_state = chunked(*args, **kwargs)
        return o * 1.1, final_state

    replace_backend(monkeypatch, "gated_delta_rule", "chunked", function=ten_percent_off)
    exit_code, output, report = run_doctor(tmp_path, capsys)
    assert exit_code == 1 and report["exit_code"] == 1

    for backend in ("chunked", "auto"):  # auto runs chunked: both are marked, in every case
        for case in ("deltanet", "gdn2", "kda_packed"):
            assert statuses(report, "gated_delta_rule", case, backend) == ["FAIL"] * 2, (case, backend)
    failed = [r for r in report["results"] if r["status"] == "FAIL"]
    assert {r["op"] for r in failed} == {"gated_delta_rule"}  # the decay op is untouched
    assert all(r["errors"]["o"] == pytest.approx(0.1, rel=0.05) for r in failed)
    assert "FAILED: 20 checks of what backend='auto' runs here" in output


def test_refusals_are_skips_and_exceptions_are_failures(monkeypatch):
    """A backend that refuses the call ("<op>: backend '<name>' cannot run ...") is skipped with
    that reason; one that raises anything else fails, with the exception in the note."""
    def refuses(*args, **kwargs):
        raise RuntimeError("gated_delta_rule: backend 'fla' cannot run deltanet in torch.float32")

    replace_backend(monkeypatch, "gated_delta_rule", "fla", unsupported=None, function=refuses)
    result = selfcheck.check_backend("gated_delta_rule", "deltanet", "fla", "cpu", torch.float32)
    assert result.status == "skip" and "cannot run deltanet in torch.float32" in result.skipped_reason

    def crashes(*args, **kwargs):
        raise IndexError("out of range")

    replace_backend(monkeypatch, "gated_delta_rule", "fla", unsupported=None, function=crashes)
    result = selfcheck.check_backend("gated_delta_rule", "deltanet", "fla", "cpu", torch.float32)
    assert result.status == "FAIL" and result.note == "IndexError: out of range"


def test_hopper_with_bad_triton_checks_the_gdn_forward_only(monkeypatch):
    """Where fla-core refuses only the backward (GDN on Hopper with Triton 3.4 to 3.7.0), its
    forward is still checked and the note says why the backward is not; KDA runs both."""
    monkeypatch.setitem(sys.modules, "fla", types.SimpleNamespace(__version__="0.6.0"))
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    op, cuda = selfcheck.OPS["gated_delta_rule"], torch.device("cuda", 0)
    skipped, backward_refused = selfcheck._availability(
        op, op.case("gated_deltanet"), "fla", cuda, torch.bfloat16)
    assert skipped is None and "#640" in backward_refused
    assert selfcheck._availability(op, op.case("kda"), "fla", cuda, torch.bfloat16) == (None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_asked_for_without_cuda(capsys):
    assert cli.main(["doctor", "--device", "cuda"]) == 2
    assert "torch sees no CUDA device here" in capsys.readouterr().err


def test_backends_option_checks_only_those(tmp_path, capsys):
    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--device", "cpu", "--backends", "chunked", "--json", str(path)]) == 0
    assert {r["backend"] for r in json.loads(path.read_text())["results"]} == {"chunked"}
    with pytest.raises(ValueError, match="unknown backends \\['nope'\\]"):
        selfcheck.run_all("cpu", backends=["nope"])


def test_ops_option_runs_only_those(tmp_path, capsys, monkeypatch):
    """--ops keeps the rows of the named ops (first-use ones too) and runs no other check."""
    from megatron_ext.kernels.sparse import flash

    from megatron_ext.kernels.sparse import routing

    ran = []
    monkeypatch.setattr(flash, "check", lambda device, dtype: ran.append(dtype) or {})
    monkeypatch.setattr(routing, "flash_refusal", lambda facts: None)
    # (the cuDNN rows stay skipped on the CPU)
    path = tmp_path / "doctor.json"
    assert cli.main(["doctor", "--device", "cpu", "--ops", "decay_linear_attention,sparse_attention",
                     "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert {r["op"] for r in results} == {"decay_linear_attention", "sparse_attention"}
    assert len(ran) == 2  # the flash path's first-use check, bf16 and fp16, and nothing else
    capsys.readouterr()
    assert cli.main(["doctor", "--device", "cpu", "--ops", "moba_selection", "--json", str(path)]) == 0
    results = json.loads(path.read_text())["results"]
    assert [(r["op"], r["status"]) for r in results] == [("moba_selection", "skip")] * 3
    assert "no check of what backend='auto' runs here ran" in capsys.readouterr().out
    assert cli.main(["doctor", "--device", "cpu", "--ops", "nope"]) == 2
    assert "unknown ops ['nope']" in capsys.readouterr().err
    assert set(selfcheck.op_names()) >= {"gated_delta_rule", "mhc", "moba_selection"}


def test_first_use_rows_show_the_flash_check(tmp_path, capsys, monkeypatch):
    """With FlashAttention's kernels emulated (flash_emulation.py) and allowed on the CPU, the
    doctor shows the flash path's errors; a wrong kernel fails its rows, which is a warning
    (auto then keeps FlexAttention), not a failed doctor."""
    from flash_emulation import allow_flash, emulate, emulated_forward

    from megatron_ext.kernels.sparse import flash

    emulate(monkeypatch)
    allow_flash(monkeypatch)
    path = tmp_path / "doctor.json"
    doctor = ["doctor", "--device", "cpu", "--backends", "flash", "--json", str(path)]
    exit_code = cli.main(doctor)
    output = capsys.readouterr().out
    assert exit_code == 0, output
    report = json.loads(path.read_text())
    assert statuses(report, "sparse_attention", "first-use check", "flash") == ["pass"] * 2, output

    def wrong_scale(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
        return emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right,
                                1.1 * q.shape[-1] ** -0.5)

    monkeypatch.setattr(flash, "_kernel_forward", wrong_scale)
    exit_code = cli.main(doctor)
    output = capsys.readouterr().out
    assert exit_code == 0, output
    report = json.loads(path.read_text())
    assert statuses(report, "sparse_attention", "first-use check", "flash") == ["FAIL"] * 2, output
    assert "warning: 2 failed checks" in output


def test_cudnn_rows_show_their_own_check(tmp_path, capsys, monkeypatch):
    """The flash path's cuDNN calls have rows of their own (``flash.check_cudnn``), here with
    those calls emulated and allowed on the CPU."""
    from flash_emulation import allow_flash, emulate_cudnn

    emulate_cudnn(monkeypatch)
    allow_flash(monkeypatch, cudnn=True)
    path = tmp_path / "doctor.json"
    exit_code = cli.main(["doctor", "--device", "cpu", "--backends", "flash", "--json", str(path)])
    output = capsys.readouterr().out
    assert exit_code == 0, output
    report = json.loads(path.read_text())
    assert statuses(report, "sparse_attention", "cuDNN first-use", "flash") == ["pass"] * 2, output


def test_stamp_names_the_commit_and_the_versions(monkeypatch, tmp_path):
    """Benchmarks stamp their results with the commit asked for, else git's HEAD here (none
    outside a checkout), and torch's and Triton's versions."""
    import torch

    from megatron_ext.doctor import stamp

    given = stamp("abc1234")
    assert given["commit"] == "abc1234" and given["torch"] == torch.__version__
    assert set(given) == {"commit", "gpu", "torch", "triton", "date"}
    monkeypatch.chdir(tmp_path)  # not a git checkout
    assert stamp()["commit"] is None
