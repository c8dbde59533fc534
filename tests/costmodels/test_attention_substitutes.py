"""An attention kernel a GPU's framework never measured is read from a stated substitute, never
from the roofline unsaid: another GPU of the same chip, the other KV dtype on this GPU, then
another chip. Each rule is checked against a kernel that was measured, hidden from the tables."""

import numpy as np
import pytest

from costmodels import build
from costmodels.costmodel import CostModelError
from costmodels.gpus import load_gpu
from costmodels.optables import (
    DATA_DIR,
    AttentionShape,
    ProfiledOps,
    RooflineOps,
    kernel_rows,
    other_dtype_rows,
)

LLAMA8 = "meta-llama/Llama-3.1-8B"
GQA = AttentionShape(32, 8, 128)


def without(tmp_path, tables, fw, prefix, head_dim, kv_code) -> None:
    """``tables``/``fw``'s op tables written to ``tmp_path`` without one attention kernel."""
    with np.load(DATA_DIR / f"{tables}_{fw}.npz") as z:
        data = {key: z[key] for key in z.files}
    drop = (data[f"{prefix}_head_dim"] == head_dim) & (data[f"{prefix}_kv_dtype"] == kv_code)
    for key in [k for k in data if k.startswith(prefix + "_")]:
        data[key] = data[key][~drop]
    np.savez(tmp_path / f"{tables}_{fw}.npz", **data)


def copy(tmp_path, tables, fw) -> None:
    with np.load(DATA_DIR / f"{tables}_{fw}.npz") as z:
        np.savez(tmp_path / f"{tables}_{fw}.npz", **{key: z[key] for key in z.files})


def prefill_error(predicted: ProfiledOps, measured: ProfiledOps, shape: AttentionShape) -> np.ndarray:
    got = {(b, n): s for b, n, s in zip(*predicted.prefill_rows(shape), strict=True)}
    want = {(b, n): s for b, n, s in zip(*measured.prefill_rows(shape), strict=True)}
    assert set(got) == set(want)
    return np.array([abs(got[k] / want[k] - 1) for k in want])


def test_sglang_fp8_kv_context_attention_is_the_bf16_kernel_stated_not_the_roofline():
    # SGLang measured no FP8-KV context attention on any GPU: it was the roofline for a dense
    # model (TTFT x2.2 off) and a refusal for an MoE one
    dense = build(LLAMA8, "h200", framework="sglang", kv_dtype="fp8")
    assert dense.source.startswith("profiled:aiconfigurator/h200_sxm/sglang")
    assert "ctx attention with fp8 KV read from the measured bf16-KV kernel as measured" in dense.source
    bf16 = build(LLAMA8, "h200", framework="sglang", kv_dtype="bf16")
    # prefill as the bf16 kernel; decode reads its own measured FP8 kernel, cheaper at long contexts
    assert dense.tables.prefill_s == pytest.approx(bf16.tables.prefill_s)
    assert not np.allclose(dense.tables.decode_s, bf16.tables.decode_s)
    moe = build("Qwen/Qwen3-235B-A22B-FP8", "h200", tp=4, framework="sglang", gemm_dtype="fp8", kv_dtype="fp8")
    assert "ctx attention with fp8 KV read from the measured bf16-KV kernel" in moe.source


def test_the_other_kv_dtype_substitute_is_near_a_kernel_measured_both_ways(tmp_path):
    # vLLM on H200 measured FP8-KV context attention: hide it, read it from the bf16 kernel
    without(tmp_path, "h200_sxm", "vllm", "ctx", 128, 1)
    shape = AttentionShape(32, 8, 128, "fp8")
    hidden = ProfiledOps("h200_sxm", "vllm", "bf16", data_dir=tmp_path)
    error = prefill_error(hidden, ProfiledOps("h200_sxm", "vllm", "bf16"), shape)
    assert hidden.notes == ["ctx attention with fp8 KV read from the measured bf16-KV kernel as measured (unmeasured)"]
    assert np.median(error) < 0.25
    # the roofline it replaces is off by far more on the same single-prompt points
    batch, isl, sec = ProfiledOps("h200_sxm", "vllm", "bf16").prefill_rows(shape)
    one = batch == 1
    _, axis, roof = RooflineOps(load_gpu("h200"), "bf16").prefill_rows(shape)
    roofline_error = np.abs(np.interp(isl[one], axis, roof) / sec[one] - 1)
    assert np.median(roofline_error) > 2 * np.median(error)


def test_the_same_chip_substitute_is_scaled_by_bandwidth_and_near_the_measured_kernel(tmp_path):
    without(tmp_path, "h200_sxm", "vllm", "gen", 128, 0)
    copy(tmp_path, "h100_sxm", "vllm")
    hidden = ProfiledOps("h200_sxm", "vllm", "bf16", data_dir=tmp_path)
    got, want = hidden.decode_rows(GQA), ProfiledOps("h200_sxm", "vllm", "bf16").decode_rows(GQA)
    h100, h200 = load_gpu("h100"), load_gpu("h200")
    factor = h100.hbm_bytes_per_s / h200.hbm_bytes_per_s
    assert hidden.notes == [f"gen attention (head_dim=128, bf16 KV) from h100_sxm's measured kernel, its work "
                            f"scaled x{factor:.2f} by HBM bandwidth (unmeasured here)"]
    errors = [abs(g / w - 1) for b in want for g, w in zip(got[b][1], want[b][1], strict=True)]
    assert np.median(errors) < 0.2
    # it is chosen over this GPU's FP8-KV kernel, which the tables still hold
    assert kernel_rows(hidden._z, "gen", 128, "fp8") is not None


def test_decode_at_the_other_dtype_is_read_at_the_same_byte_count():
    rows = {"heads": np.array([32, 32]), "kv_heads": np.array([8, 8]), "batch": np.array([1, 1]),
            "length": np.array([1000.0, 4000.0]), "seconds": np.array([1e-5, 3e-5])}
    fp8 = other_dtype_rows(rows, "gen", "bf16", "fp8")
    np.testing.assert_array_equal(fp8["length"], [2000.0, 8000.0])  # half the bytes per token
    np.testing.assert_array_equal(fp8["seconds"], rows["seconds"])
    np.testing.assert_array_equal(other_dtype_rows(fp8, "gen", "fp8", "bf16")["length"], rows["length"])
    assert other_dtype_rows(rows, "ctx", "bf16", "fp8") is rows  # prefill as measured


def test_another_chip_lends_a_head_dim_this_gpu_never_measured():
    ops = ProfiledOps("a100_sxm", "vllm", "bf16")  # A100's tables hold head_dim 128 only
    rows = ops.decode_rows(AttentionShape(32, 8, 64))
    assert rows and "from h100_sxm's measured kernel" in ops.notes[0] and "HBM bandwidth" in ops.notes[0]
    # A100 is slower: the work above the launch floor is stretched, never shrunk
    h100 = ProfiledOps("h100_sxm", "vllm", "bf16").decode_rows(AttentionShape(32, 8, 64))
    assert rows[64.0][1][-1] > h100[64.0][1][-1]


def test_a_kernel_measured_nowhere_is_an_error_naming_it():
    with pytest.raises(CostModelError, match="head_dim=96 at any KV dtype here, nor at kv_dtype=bf16"):
        ProfiledOps("a100_sxm", "vllm", "bf16").decode_rows(AttentionShape(32, 8, 96))
