"""dev/profile_step.py's report on a hand-made trace: kernels grouped by kind, idle gaps charged to the part of the
step and the host op that was running when the GPU ran dry."""

import json

from dev.profile_step import report


def kernel(name, ts, dur):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "ph": "X"}


def host(name, ts, dur):
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "ph": "X"}


def report_of(events, tmp_path, capsys, n, wall_ms):
    """What report() prints for a trace of these events over n steps of wall_ms each."""
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    report(str(path), n, wall_ms)
    return capsys.readouterr().out


def test_groups_and_idle(tmp_path, capsys):
    events = [
        kernel("nvjet_sm90_tst_gemm", 0, 1000),
        kernel("cudnn_generated_fort_native_sdpa_fprop", 1000, 500),
        kernel("triton_poi_fused_add", 1500, 100),
        # 400 us idle while the optimizer's host code runs, then 50 us while the backward does
        kernel("triton_poi_fused_lerp", 2000, 100),
        kernel("nvjet_sm90_tst_gemm", 2150, 1000),
        host("Optimizer.step#MuonAdamW.step", 1550, 500),
        host("aten::copy_", 1590, 50),
        host("autograd::engine::evaluate_function: MmBackward0", 2080, 100),
    ]
    out = report_of(events, tmp_path, capsys, 1, 3.2)
    assert "GPU kernel time per step: 2.7 ms over 5 kernel launches" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "ms" in line}
    assert "2.0 ms" in lines["matmul"] and "0.5 ms" in lines["attention"]
    assert "(2 gaps over 5 us per step, 0.5 ms in all)" in out
    assert "0.40 ms  optimizer      aten::copy_" in out
    assert "0.05 ms  backward" in out


def test_cpu_trace_has_no_kernels(tmp_path, capsys):
    assert "no GPU kernels" in report_of([host("aten::mm", 0, 10)], tmp_path, capsys, 2, 12.5)


def test_exposed_communication(tmp_path, capsys):
    """A communication kernel on its own stream counts as exposed only where no other kernel runs beside it; by
    collective, where no other kernel at all (another collective included) runs."""
    events = [
        kernel("nvjet_sm90_tst_gemm", 0, 1000),
        kernel("ncclDevKernel_SendRecv", 500, 1000),  # 500 us under the matmul, 300 us bare, 200 us under the next
        kernel("triton_poi_fused_add", 1300, 400),
        kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 2000, 300),  # bare
        kernel("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", 2200, 200),  # 100 us beside the all-gather
    ]
    out = report_of(events, tmp_path, capsys, 1, 2.4)
    assert "some kernel running 2.1 ms (profiled; unprofiled wall less that: 0.3 ms)" in out
    assert "(exposed, waits for peers included): 0.7 ms" in out
    assert "of which with no other kernel at all: SendRecv 0.3 ms, AllGather 0.2 ms, ReduceScatter 0.1 ms" in out
