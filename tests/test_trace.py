"""The profiler-trace summary: device kernels grouped by category, per step."""

import json

from tetrad.train import trace


def test_summary_groups_kernels_by_category(tmp_path):
    kernels = [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 600.0),
        ("flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>", 150.0),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 50.0),
        ("void at::native::elementwise_kernel<128, 2, direct_copy_kernel_cuda>", 100.0),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 60.0),
        ("triton_poi_fused_mul_silu_0", 40.0),
        ("void at::native::reduce_kernel<512, 1, ReduceOp<float, NormTwoOps>>", 20.0),
    ]
    events = [{"ph": "X", "cat": "kernel", "name": n, "dur": d} for n, d in kernels]
    events += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 5000.0}]  # not device
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = trace.breakdown(trace.device_events(json.loads(path.read_text())))
    assert list(got) == [
        "gemm",
        "attention",
        "copy / cast",
        "element-wise",
        "fused (torch.compile)",
        "reduction",
    ]
    assert abs(got["gemm"] - 600e-6) < 1e-12
    assert abs(got["attention"] - 200e-6) < 1e-12  # cuDNN's attention names wgmma too
    text = trace.summary(path, steps=2, step_seconds=1e-3)
    assert "device time per step: 0.5 ms busy of 1.0 ms wall (51%)" in text
    assert "flash_fwd_kernel" in text


def test_summary_of_a_cpu_trace_says_so(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "dur": 1.0}]}))
    assert "no device kernels" in trace.summary(path, steps=1)
