"""The calibration fallback chain: which entry a setup gets, and that build says which."""

import pytest

from costmodels import CostModelError, build, save_calibration
from costmodels.architecture import load_model
from costmodels.calibration import MATCHES, entry_family, entry_kinds, entry_models, match_entry

LLAMA8, LLAMA70, QWEN32 = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-32B"


def entry(model, gpu="h100_sxm", framework="trtllm", dtype="bf16", tp=(1, 2), overhead_ms=1.0, **extra):
    return {"model": model, "gpu": gpu, "framework": framework, "gemm_dtype": dtype, "kv_dtype": dtype,
            "tp": list(tp), "overhead_s": overhead_ms * 1e-3, "scale": 1.0, **extra}


ENTRIES = [entry(LLAMA8, overhead_ms=1.0), entry(QWEN32, overhead_ms=2.0), entry("*", overhead_ms=3.0),
           entry(LLAMA8, gpu="a100_sxm", framework="vllm", overhead_ms=4.0),
           entry("*", gpu="a100_sxm", framework="vllm", overhead_ms=5.0)]


def match(model, family, gpu="h100_sxm", framework="trtllm", tp=1, kv="bf16"):
    found, how = match_entry(ENTRIES, model=model, family=family, gpu=gpu, framework=framework, gemm_dtype="bf16",
                             tp=tp, kv_dtype=kv)
    return (None if found is None else round(found["overhead_s"] * 1e3)), how


@pytest.mark.parametrize("setup, expected", [
    ((LLAMA8, "llama"), (1, "setup")),
    ((LLAMA8, "llama", "h100_sxm", "trtllm", 4), (1, "model")),  # a TP the entry was not fitted at
    ((LLAMA8, "llama", "h100_sxm", "trtllm", 1, "fp8"), (1, "model")),  # another KV dtype
    ((LLAMA70, "llama"), (1, "family")),  # Llama-3.1-8B's fit, not the pooled one
    (("Qwen/Qwen3-8B", "qwen3"), (2, "family")),
    (("my-model", "mistral"), (3, "pooled")),
    ((LLAMA8, "llama", "h200_sxm", "vllm"), (4, "other_gpu")),  # the same model fitted on A100
    ((QWEN32, "qwen3", "h200_sxm", "vllm"), (5, "other_gpu")),  # nothing of its own or its family: pooled
    ((LLAMA8, "llama", "h100_sxm", "sglang"), (None, "none")),  # no fit of the framework anywhere
])
def test_each_level_of_the_chain(setup, expected):
    assert match(*setup) == expected
    assert expected[1] in (*MATCHES, "none")


def test_a_family_is_read_from_the_model_when_the_entry_lacks_it():
    assert entry_family(entry(LLAMA8)) == "llama" and entry_family(entry(QWEN32)) == "qwen3"
    assert entry_family(entry("*")) == "" and entry_family(entry("someone/unknown")) == ""
    assert entry_family(entry("someone/unknown", family="llama")) == "llama"


def test_build_says_which_entry_it_used(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration(ENTRIES, path)
    cost = build(LLAMA70, "h100", tp=4, framework="trtllm", calibration=path)
    assert cost.calibration["match"] == "family" and cost.calibration["model"] == LLAMA8
    assert cost.tables.overhead_s == pytest.approx(1e-3)
    assert "family (meta-llama/Llama-3.1-8B)" in cost.source
    other = build(LLAMA8, "h200", framework="vllm", calibration=path)
    assert other.calibration["match"] == "other_gpu" and other.calibration["gpu"] == "a100_sxm"
    assert f"other_gpu ({LLAMA8} on a100_sxm)" in other.source


def test_another_gpus_entry_lends_its_scales_but_not_its_hosts_step_overhead(tmp_path):
    """The fitted decode-step overhead is the measured machine's engine loop (0.3-0.5 ms on
    the B200 runs, 1-2.2 ms on the H100 ones), not the GPU tables'. Held out, the B200 and
    H100 TRT-LLM FP8 setups scored on each other's entries: TPOT 21.9% / 17.5% with it lent,
    11.2% / 14.8% without (docs/fidelity.md)."""
    path = tmp_path / "calibration.json"
    save_calibration([entry(LLAMA8, gpu="a100_sxm", framework="vllm", overhead_ms=4.0, decode_scale=0.8,
                            prefill_scale=1.2)], path)
    own = build(LLAMA8, "a100", framework="vllm", calibration=path)
    other = build(LLAMA8, "h200", framework="vllm", calibration=path)
    default = build(LLAMA8, "h200", framework="vllm", calibration=False)
    assert own.tables.overhead_s == pytest.approx(4e-3) and own.calibration["match"] == "setup"
    assert other.calibration["match"] == "other_gpu"
    assert other.tables.overhead_s == default.tables.overhead_s == other.calibration["overhead_s"]
    assert (other.tables.decode_scale, other.tables.prefill_scale) == pytest.approx((0.8, 1.2))
    assert "(the default: not lent)" in other.source


def test_entries_fitted_on_profiled_tables_never_correct_the_roofline(tmp_path):
    from costmodels.gpus import GPUSpec, register_gpu

    register_gpu(GPUSpec(name="chaingpu", memory_bytes=48 * 2**30, hbm_bytes_per_s=864e9, bf16_flops=362e12,
                         nvlink_bytes_per_s=32e9, pcie_bytes_per_s=32e9))
    path = tmp_path / "calibration.json"
    save_calibration([*ENTRIES, entry("*", gpu="a100_sxm", framework="vllm", overhead_ms=6.0,
                                      step_source="roofline", models=[LLAMA8], decode_scale=1.3)], path)
    cost = build(LLAMA8, "chaingpu", framework="vllm", calibration=path)
    assert cost.source.startswith("roofline") and cost.calibration["match"] == "other_gpu"
    assert cost.tables.decode_scale == pytest.approx(1.3)  # the roofline fit, not the profiled ones
    bundled = build(LLAMA8, "chaingpu", framework="trtllm")
    assert bundled.calibration["match"] == "none" and bundled.source.endswith("uncalibrated")


def test_an_moe_model_takes_only_entries_fitted_at_its_routing_skew(tmp_path):
    """Scales fitted on MoE step times read at one routing skew correct those step times
    only: an MoE model timed at another skew passes such an entry over, while entries fitted
    on dense models (no skew) and dense models themselves are unaffected."""
    qwen = "Qwen/Qwen3-30B-A3B"
    skewed = entry(qwen, framework="vllm", tp=(1,), overhead_ms=7.0, moe_distribution="power_law_1.01")
    dense = entry("*", framework="vllm", tp=(1,), overhead_ms=8.0)
    path = tmp_path / "calibration.json"
    save_calibration([skewed, dense], path)
    at_skew = build(qwen, "h100", framework="vllm", moe_distribution="power_law_1.01", calibration=path)
    assert at_skew.calibration["match"] == "setup" and at_skew.tables.overhead_s == pytest.approx(7e-3)
    balanced = build(qwen, "h100", framework="vllm", moe_distribution="balanced", calibration=path)
    assert balanced.calibration["match"] == "pooled" and balanced.tables.overhead_s == pytest.approx(8e-3)
    save_calibration([skewed], path)
    with pytest.raises(CostModelError, match="has no entry for Qwen/Qwen3-30B-A3B"):
        build(qwen, "h100", framework="vllm", moe_distribution="balanced", calibration=path)
    unskewed = dict(model=qwen, family="qwen3_moe", gpu="h100_sxm", framework="vllm", gemm_dtype="bf16", tp=1,
                    kv_dtype="bf16")
    assert match_entry([skewed], **unskewed)[1] == "setup"  # no skew given (a dense model): no filter


def test_an_entrys_prompt_step_time_reaches_the_tables_and_the_label(tmp_path):
    path = tmp_path / "calibration.json"
    save_calibration([entry(LLAMA8, prefill_step_s=0.03)], path)
    cost = build(LLAMA8, "h100", framework="trtllm", calibration=path)
    assert cost.tables.prefill_step_s == pytest.approx(0.03) and "prompt steps +30.0 ms" in cost.source
    assert cost.calibration["prefill_step_s"] == pytest.approx(0.03)
    save_calibration([entry(LLAMA8, prefill_step_s=-0.01)], path)
    with pytest.raises(CostModelError, match="prefill_step_s >= 0"):
        build(LLAMA8, "h100", framework="trtllm", calibration=path)


@pytest.mark.parametrize("pinned", ["decode_scale", ["decode"], [3]])
def test_pinned_terms_must_name_fitted_terms(tmp_path, pinned):
    path = tmp_path / "cal.json"
    save_calibration([entry(LLAMA8), entry(LLAMA8, gpu="a100_sxm", pinned_terms=pinned)], path)
    with pytest.raises(CostModelError, match=r"entry 1 pinned_terms must list terms of"):
        build(LLAMA8, "h100", tp=1, framework="trtllm", calibration=path)


def test_an_entry_without_pinned_terms_applies_as_placed(tmp_path):
    path = tmp_path / "cal.json"
    save_calibration([entry(LLAMA8)], path)
    cost = build(LLAMA8, "h100", tp=1, framework="trtllm", calibration=path)
    assert cost.calibration["pinned_terms"] == [] and "range limit" not in cost.source


@pytest.mark.parametrize("gpu, nearest_ms", [("a100_sxm", 2.0), ("b200_sxm", 3.0)])
def test_another_gpus_fallback_is_the_nearest_in_memory_bandwidth_whatever_the_file_order(gpu, nearest_ms):
    # pooled fits on H100 (3.35 TB/s, overhead 2 ms) and H200 (4.8 TB/s, 3 ms), none on the
    # setup's GPU: A100 (2.0 TB/s) takes H100's, B200 (7.7 TB/s) H200's, in either file order
    pooled = [entry("*", gpu="h100_sxm", overhead_ms=2.0), entry("*", gpu="h200_sxm", overhead_ms=3.0)]
    for order in (pooled, pooled[::-1]):
        found, how = match_entry(order, model="my-model", family="mistral", gpu=gpu, framework="trtllm",
                                 gemm_dtype="bf16", tp=1, kv_dtype="bf16")
        assert (round(found["overhead_s"] * 1e3), how) == (nearest_ms, "other_gpu")


DSV3 = "deepseek-ai/DeepSeek-V3"


def test_architecture_classes():
    assert [load_model(m).kind for m in (LLAMA8, "Qwen/Qwen3-235B-A22B-FP8", DSV3)] == ["dense", "moe", "moe+mla"]


def test_an_entry_is_lent_only_within_its_architecture_class():
    # H200's TRT-LLM FP8 pool holds one DeepSeek-V3 fit (MoE + MLA, +144 ms per prompt step):
    # Llama-3.1-70B gets its own model's B200 entry instead, never the pool
    pool = entry("*", gpu="h200_sxm", dtype="fp8", overhead_ms=3.0, models=[DSV3])
    own = entry(LLAMA70, gpu="b200_sxm", dtype="fp8", overhead_ms=1.0)
    key = dict(model=LLAMA70, family="llama", gpu="h200_sxm", framework="trtllm", gemm_dtype="fp8", tp=4,
               kv_dtype="fp8")
    assert match_entry([pool, own], **key) == (pool, "pooled")  # without the class: the pool
    assert match_entry([pool, own], **key, kind="dense") == (own, "other_gpu")
    assert match_entry([pool], **key, kind="dense") == (None, "none")
    assert match_entry([pool], **key | {"model": DSV3, "family": "deepseek_v3"}, kind="moe+mla") == (pool, "pooled")
    bundled = build(LLAMA70, "h200", tp=4, framework="trtllm", gemm_dtype="fp8")
    assert bundled.calibration["match"] == "other_gpu" and bundled.calibration["models"] == [LLAMA70]


def test_a_pool_says_what_it_holds():
    cost = build(LLAMA8, "h100", framework="vllm")
    assert "calibrated:default pooled (1 model: Qwen3-32B)" in cost.source
    assert cost.calibration["models"] == [QWEN32]


def test_a_pool_written_without_its_models_pooled_its_files_model_entries():
    entries = [entry(LLAMA8, path="tp"), entry(QWEN32, path="tp"), entry("*", path="tp"),
               entry(DSV3, gpu="h200_sxm", path="tp"), entry("*", gpu="h200_sxm", path="ep")]
    assert entry_models(entries[2], entries) == sorted([LLAMA8, QWEN32])
    assert entry_kinds(entries[2], entries) == {"dense"}
    assert entry_models(entries[4], entries) == [] and entry_kinds(entries[4], entries) == {"unknown"}


def test_a_file_carries_its_measured_error_per_tier_to_every_cost_model_it_builds(tmp_path):
    from costmodels.calibration import BUNDLED, load_tier_errors

    path = tmp_path / "calibration.json"
    tiers = {"method": "held out", "tiers": {"family": {"ttft_mape": 30.0, "tpot_mape": 9.0, "runs": 40, "setups": 3}}}
    save_calibration(ENTRIES, path, tier_errors=tiers)
    assert load_tier_errors(path) == tiers
    assert build(LLAMA70, "h100", tp=4, framework="trtllm", calibration=path).calibration["tier_errors"] == tiers
    save_calibration(ENTRIES, path)
    assert load_tier_errors(path) == {}
    # the bundled file's table reaches a setup with no entry at all, whose band needs it most
    none = build(LLAMA8, "h100", framework="sglang")
    assert none.calibration["match"] == "none" and none.calibration["tier_errors"] == load_tier_errors(BUNDLED)


def test_a_tier_error_without_its_figures_is_refused(tmp_path):
    import json

    from costmodels.calibration import load_tier_errors

    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"format": "servetune-calibration/1", "entries": [],
                                "tier_errors": {"tiers": {"none": {"ttft_mape": "x"}}}}))
    with pytest.raises(CostModelError, match="tier_errors for 'none'"):
        load_tier_errors(path)


def test_a_tier_that_lost_to_no_entry_on_held_out_runs_is_skipped():
    from costmodels.calibration import MIN_TIER_RUNS, losing_tiers

    def tier(chain, none, runs=MIN_TIER_RUNS):
        return {"ttft_mape": chain[0], "tpot_mape": chain[1], "runs": runs,
                "none_ttft_mape": none[0], "none_tpot_mape": none[1]}

    table = {"tiers": {"other_gpu": tier((20.0, 30.0), (25.0, 15.0)),  # 50 against 40: no entry wins
                       "other_path": tier((20.0, 30.0), (25.0, 20.0)),  # 50 against 45: within the margin
                       "family": tier((20.0, 10.0), (40.0, 12.0)),  # the entry wins
                       "pooled": tier((50.0, 50.0), (1.0, 1.0), runs=MIN_TIER_RUNS - 1),  # too few runs to tell
                       "none": {"ttft_mape": 40.0, "tpot_mape": 12.0, "runs": 100}}}
    assert losing_tiers(table) == {"other_gpu"}
    # the same model fitted on A100 is skipped; the chain walks on to no entry
    found, how = match_entry(ENTRIES, model=LLAMA8, family="llama", gpu="h200_sxm", framework="vllm",
                             gemm_dtype="bf16", tp=1, kv_dtype="bf16", skip=losing_tiers(table))
    assert (found, how) == (None, "none")
    assert match(LLAMA70, "llama") == (1, "family")


def test_a_file_whose_evidence_skips_a_tier_builds_the_setup_uncalibrated(tmp_path):
    path = tmp_path / "calibration.json"
    lost = {"tiers": {"other_gpu": {"ttft_mape": 30.0, "tpot_mape": 30.0, "runs": 50, "none_ttft_mape": 20.0,
                                    "none_tpot_mape": 20.0}}}
    save_calibration(ENTRIES, path, tier_errors=lost)
    with pytest.raises(CostModelError, match="no entry"):  # a file given by name must match
        build(LLAMA8, "h200", framework="vllm", calibration=path)
    save_calibration(ENTRIES, path)
    assert build(LLAMA8, "h200", framework="vllm", calibration=path).calibration["match"] == "other_gpu"
