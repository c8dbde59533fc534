import numpy as np
import pytest

from costmodels import CostModelError, build, linear_tables, step_seconds
from costmodels.gpus import GPUSpec, load_gpu, register_gpu


@pytest.fixture(scope="module")
def llama8b():
    return build("meta-llama/Llama-3.1-8B", "h100", calibration=False)


def raw(t):
    return t._replace(overhead_s=0.0, scale=1.0)


def test_overhead_and_scale_apply_to_the_whole_step(llama8b):
    t = raw(llama8b.tables)
    base = step_seconds(t, 64, 64, 64, 64 * 1000.0, 0.0)[0]
    calibrated = step_seconds(t._replace(overhead_s=0.002, scale=1.5), 64, 64, 64, 64 * 1000.0, 0.0)[0]
    assert calibrated == pytest.approx(1.5 * (base + 0.002))


def test_prefill_and_decode_scales_split_a_mixed_step():
    # linear tables: 2 us/token, 1 us/logit seq, 2 ns/KV token, 0.1 ns/pair, no overhead
    t = raw(linear_tables())
    decode = 2e-6 * 10 + 1e-6 * 10 + 2e-9 * 10_000  # 10 decodes: their tokens, lm-head, attention
    prefill = 2e-6 * 500 + 1e-10 * 125_250  # a 500-token chunk: the tokens it adds, its attention
    args = (510, 10, 10, 10_000.0, 125_250.0)
    assert step_seconds(t, *args)[0] == pytest.approx(decode + prefill)
    split = t._replace(prefill_scale=1.5, decode_scale=0.5, overhead_s=0.001)
    assert step_seconds(split, *args)[0] == pytest.approx(0.5 * decode + 1.5 * prefill + 0.001)
    # a pure-decode step takes the decode scale only, a lone prefill the prefill scale (lm-head: decode)
    assert step_seconds(split, 10, 10, 10, 10_000.0, 0.0)[0] == pytest.approx(0.5 * decode + 0.001)
    assert step_seconds(split, 500, 1, 0, 0.0, 125_250.0)[0] == pytest.approx(1.5 * prefill + 0.5 * 1e-6 + 0.001)


def test_a_step_with_prompt_tokens_pays_the_prefill_step_time():
    """``prefill_step_s`` (the launches a step outside the decode CUDA graphs pays) is added,
    scaled like the rest, to every step with a prompt chunk and to no other: not to decode
    steps, nor to a step whose extra tokens are verified drafts (no prefill attention), and
    the decode-run fast path, which times decode-only steps, matches step_seconds."""
    from costmodels.steptable import decode_run_base, decode_run_step

    t = raw(linear_tables())
    eager = t._replace(prefill_step_s=0.05, scale=2.0)
    mixed, decode_only, drafts = (510, 10, 10, 10_000.0, 125_250.0), (10, 10, 10, 10_000.0, 0.0), (40, 10, 10, 10_000.0, 0.0)
    assert step_seconds(eager, *mixed)[0] == pytest.approx(2.0 * (step_seconds(t, *mixed)[0] + 0.05))
    for args in (decode_only, drafts):
        assert step_seconds(eager, *args)[0] == pytest.approx(2.0 * step_seconds(t, *args)[0])
    base = decode_run_base(eager, 10)
    assert decode_run_step(eager, base, 10_000.0)[0] == step_seconds(eager, *decode_only)[0]
    with pytest.raises(ValueError, match="prefill_step_s"):
        type(t).from_grids(**t.grids(), overhead_s=0.0, scale=1.0, prefill_step_s=-1.0)


@pytest.mark.parametrize("axis", range(5))
def test_step_time_is_monotone_in_each_input(llama8b, axis):
    rng = np.random.default_rng(axis)
    t = llama8b.tables
    for _ in range(200):
        x = [rng.integers(1, 8192), rng.integers(1, 512), rng.integers(1, 512),
             rng.uniform(1, 4e5), rng.uniform(1, 5e7)]
        lo = step_seconds(t, *x)[0]
        x[axis] = x[axis] * rng.uniform(1.0, 3.0)
        assert step_seconds(t, *x)[0] >= lo - 1e-15


def test_prefill_on_cached_prefix_costs_attention_over_whole_context(llama8b):
    t = llama8b.tables
    chunk, cached = 512, 8192
    fresh = step_seconds(t, chunk, 1, 0, 0.0, chunk * (chunk + 1) / 2)[0]
    on_prefix = step_seconds(t, chunk, 1, 0, 0.0, chunk * (cached + (chunk + 1) / 2))[0]
    assert on_prefix > fresh * 1.05


def test_70b_decode_faster_at_tp4_than_tp2():
    shape = (64, 64, 64, 64 * 2048.0, 0.0)
    tp2 = step_seconds(build("meta-llama/Llama-3.1-70B", "h100", tp=2).tables, *shape)[0]
    tp4 = step_seconds(build("meta-llama/Llama-3.1-70B", "h100", tp=4).tables, *shape)[0]
    assert tp4 < tp2


def test_h200_decode_faster_than_a100(llama8b):
    shape = (128, 128, 128, 128 * 2048.0, 0.0)
    a100 = build("meta-llama/Llama-3.1-8B", "a100", calibration=False).tables
    h200 = build("meta-llama/Llama-3.1-8B", "h200", calibration=False).tables
    assert step_seconds(h200, *shape)[0] < step_seconds(a100, *shape)[0]


def test_linear_tables_semantics_unchanged():
    t = linear_tables()
    s, out = step_seconds(t, 100, 10, 10, 5000.0, 1e6)
    assert s == pytest.approx(0.004 + 100 * 2e-6 + 10 * 1e-6 + 5000 * 2e-9 + 1e6 * 1e-10)
    assert not out


def test_zero_token_step_costs_nothing(llama8b):
    assert step_seconds(llama8b.tables, 0, 0, 0, 0.0, 0.0) == (0.0, False)


def test_fp8_gemms_faster_than_bf16_for_large_prefill():
    bf16 = build("Qwen/Qwen3-32B", "h100", framework="trtllm", calibration=False).tables
    fp8 = build("Qwen/Qwen3-32B", "h100", framework="trtllm", gemm_dtype="fp8", calibration=False).tables
    assert step_seconds(fp8, 8192, 1, 0, 0.0, 0.0)[0] < 0.8 * step_seconds(bf16, 8192, 1, 0, 0.0, 0.0)[0]


def test_unknown_gpu_and_framework_list_valid_values():
    with pytest.raises(CostModelError, match="valid: a100, h100, h200"):
        build("llama-3.1-8b", "v100")
    with pytest.raises(CostModelError, match="vllm, sglang, trtllm"):
        build("llama-3.1-8b", "h100", framework="tgi")


def test_gpu_spellings():
    assert load_gpu("H100-SXM").name == load_gpu("h100").name == "h100_sxm"


def test_roofline_for_gpu_without_tables_is_labelled():
    register_gpu(GPUSpec(name="testgpu", memory_bytes=48 * 2**30, hbm_bytes_per_s=864e9, bf16_flops=362e12,
                         nvlink_bytes_per_s=32e9, pcie_bytes_per_s=32e9))
    cost = build("llama-3.1-8b", "testgpu")
    assert cost.source.startswith("roofline:testgpu")
    t = cost.tables
    # decode of 64 x 2048 KV tokens is bandwidth-bound: weights + KV over 0.8 x 864 GB/s
    floor = (cost.weight_bytes + 64 * 2048 * cost.kv_bytes_per_token) / (0.8 * 864e9)
    assert step_seconds(t, 64, 64, 64, 64 * 2048.0, 0.0)[0] > floor


def test_gpu_without_fp8_tensor_cores_rejects_fp8_gemms():
    with pytest.raises(CostModelError, match="no fp8"):
        build("llama-3.1-8b", "a100", gemm_dtype="fp8")
