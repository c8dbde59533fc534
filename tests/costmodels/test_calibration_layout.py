"""Measured runs with parallel layouts: ``load_runs`` reads them and each run is fitted and
replayed on the cost model of its own layout."""

import polars as pl
import pytest

from costmodels import CostModelError, build, calibrate, load_runs, save_calibration
from costmodels.calibration import match_entry
from costmodels.moeops import DEFAULT_DISTRIBUTION
from optimizer.cli.validate import predict_runs
from optimizer.fidelity.closedloop import (
    TRTLLM_DEFAULT,
    BenchClient,
    run_benchmark,
    server_max_seq_len,
)

QWEN, R1, LLAMA = "Qwen/Qwen3-235B-A22B-FP8", "deepseek-ai/DeepSeek-R1", "meta-llama/Llama-3.1-8B"
COLS = ["model_path", "system", "backend", "tp_size", "attention_dp_size", "moe_tp_size", "moe_ep_size", "pp_size",
        "gemm_quant_mode", "batch_size", "isl", "osl", "silicon_ttft_ms", "silicon_tpot_ms"]
# aiconfigurator's rows: tp_size per attention-DP group, an empty attention_dp_size is 1,
# a dense row carries placeholder MoE columns (1 and 0)
ROWS = [
    (QWEN, "h100_sxm", "trtllm", 4, None, 1, 4, 1, "fp8_block", 8, 128, 16, 90.0, 12.0),
    (R1, "h200_sxm", "trtllm", 1, 8, 1, 8, 1, "fp8", 2, 128, 8, 200.0, 30.0),
    (R1, "h200_sxm", "trtllm", 8, 1, 1, 8, 1, "fp8", 2, 128, 8, 150.0, 20.0),
    (LLAMA, "h100_sxm", "trtllm", 2, None, 1, 0, 1, "bfloat16", 4, 128, 16, 20.0, 5.0),
]


def write(tmp_path, rows, name="runs.csv"):
    path = tmp_path / name
    pl.DataFrame(rows, schema=COLS, orient="row").write_csv(path)
    return path


def test_layout_columns_give_the_instance_gpus_and_its_layout(tmp_path):
    runs = load_runs(write(tmp_path, ROWS))
    got = runs.select("model", "tp", "moe_ep_size", "attention_dp_size", "gemm_dtype", "batch_size").rows()
    assert got == [(QWEN, 4, 4, 1, "fp8", 8),  # fp8_block is an FP8 GEMM (the checkpoint has the blocks)
                   (R1, 8, 8, 8, "fp8", 2),  # 1 GPU per group x 8 groups; batch_size stays per group
                   (R1, 8, 8, 1, "fp8", 2),
                   (LLAMA, 2, 1, 1, "bf16", 4)]  # the dense row's MoE placeholders are not read


@pytest.mark.parametrize("row, message", [
    ((R1, "h200_sxm", "trtllm", 4, 2, 2, 2, 1, "fp8", 2, 128, 8, 1.0, 1.0),
     r"row 2, layout: moe_tp_size 2 x moe_ep_size 2 = 4 GPUs, but tp_size 4 x attention_dp_size 2 = 8"),
    ((QWEN, "h100_sxm", "trtllm", 4, None, 2, None, 1, "fp8", 2, 128, 8, 1.0, 1.0),
     r"row 2, layout: moe_tp_size 2 x moe_ep_size 1 = 2 GPUs, but tp_size 4 x attention_dp_size 1 = 4"),
    ((R1, "h200_sxm", "trtllm", 8, 1, 8, 1, 2, "fp8", 2, 128, 8, 1.0, 1.0),
     r"row 2, column 'pp_size': 2 pipeline stages, which servetune does not model"),
    ((R1, "h200_sxm", "trtllm", 8, 1, 8, 0, 1, "fp8", 2, 128, 8, 1.0, 1.0),
     r"row 2, column 'moe_ep_size': 0 is not a positive whole number"),
])
def test_an_inconsistent_layout_names_row_and_columns(tmp_path, row, message):
    with pytest.raises(CostModelError, match=message):
        load_runs(write(tmp_path, [row]))


def test_a_bad_layout_marks_only_its_row(tmp_path):
    bad = (R1, "h200_sxm", "trtllm", 4, 2, 2, 2, 1, "fp8", 2, 128, 8, 1.0, 1.0)
    runs = load_runs(write(tmp_path, [ROWS[2], bad]), bad_rows="mark")
    assert runs["error"].to_list() == [None, "row 3: layout: moe_tp_size 2 x moe_ep_size 2 = 4 GPUs, but tp_size 4 "
                                             "x attention_dp_size 2 = 8"]
    assert runs.select("tp", "moe_ep_size", "attention_dp_size").rows() == [(8, 8, 1), (None, None, None)]


def test_the_fit_builds_each_run_at_its_layout(tmp_path):
    built = []

    def builder(model, gpu, **kw):
        built.append((model, kw["tp"], kw["moe_ep_size"], kw["attention_dp_size"]))
        return build(model, gpu, **kw)

    entries = calibrate(load_runs(write(tmp_path, ROWS)), builder=builder)
    assert built == [(QWEN, 4, 4, 1), (R1, 8, 8, 8), (R1, 8, 8, 1), (LLAMA, 2, 1, 1)]
    # each entry records the MoE routing skew its step times were read at; a dense one none
    skews = {(e["model"], e["path"]): e.get("moe_distribution") for e in entries}
    assert skews[(QWEN, "ep")] == skews[(R1, "ep")] == DEFAULT_DISTRIBUTION and skews[(LLAMA, "tp")] is None


def test_a_row_is_replayed_on_one_attention_dp_group_of_its_layout(tmp_path):
    """The dp8 row runs its batch_size clients on one group's cost model (1 GPU of
    attention, experts over 8), not on plain TP 8: its prediction is that closed loop."""
    bench = BenchClient(requests_per_client=1, warmup_per_client=0)
    pred = predict_runs(load_runs(write(tmp_path, ROWS[1:3])), calibration=False, bench=bench)
    assert pred["error"].to_list() == [None, None]
    for (ep, dp), ttft, tpot in zip([(8, 8), (8, 1)], pred["pred_ttft_ms"], pred["pred_tpot_ms"], strict=True):
        cost = build(R1, "h200_sxm", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", calibration=False,
                     moe_ep_size=ep, attention_dp_size=dp)
        loop = run_benchmark(cost, TRTLLM_DEFAULT, 2, 128, 8, bench, max_seq_len=server_max_seq_len("trtllm", R1))
        assert (ttft, tpot) == pytest.approx((loop.mean_ttft_ms, loop.mean_tpot_ms), rel=1e-9)
    assert pred["pred_tpot_ms"][0] != pytest.approx(pred["pred_tpot_ms"][1], rel=0.01)  # the layout matters


def test_an_entry_is_a_setup_match_only_at_a_layout_it_was_fitted_on(tmp_path):
    plain_tp8 = (R1, "h200_sxm", "trtllm", 8, 1, 8, 1, 1, "fp8", 2, 128, 8, 120.0, 18.0)
    entries = calibrate(load_runs(write(tmp_path, [ROWS[2], plain_tp8])))
    ep, tp = (next(e for e in entries if e["model"] == R1 and e["path"] == p) for p in ("ep", "tp"))
    assert (ep["layouts"], tp["layouts"]) == ([[8, 8, 1]], [[8, 1, 1]])  # one entry per parallel path
    key = dict(model=R1, family="deepseek_v3", gpu="h200_sxm", framework="trtllm", gemm_dtype="fp8", tp=8,
               kv_dtype="fp8")
    assert match_entry(entries, **key, layout=(8, 1)) == (ep, "setup")
    assert match_entry(entries, **key, layout=(4, 1)) == (ep, "model")  # same path, another layout
    assert match_entry(entries, **key) == (tp, "setup")
    plain = {k: v for k, v in tp.items() if k not in ("layouts", "path")}  # a plain-TP fit (the bundled file)
    assert match_entry([plain], **key) == (plain, "setup")
    assert match_entry([plain], **key, layout=(8, 1)) == (plain, "other_path")
    path = tmp_path / "cal.json"
    save_calibration([ep], path)
    cost = build(R1, "h200_sxm", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", calibration=path,
                 moe_ep_size=8, attention_dp_size=1)
    assert cost.calibration["match"] == "setup"


def test_an_entry_of_another_parallel_path_stands_in_only_when_its_path_has_none(tmp_path):
    """Expert parallelism and attention DP run other kernels and collectives than plain TP:
    an entry of the setup's path, even one fitted on another GPU, comes before one of
    another path, which is the last resort and says so."""
    [ep, pooled] = calibrate(load_runs(write(tmp_path, ROWS[2:3])))  # R1 at tp8 ep8 only
    key = dict(model=R1, family="deepseek_v3", gpu="h200_sxm", framework="trtllm", gemm_dtype="fp8", tp=8,
               kv_dtype="fp8")
    for layout in ((1, 1), (8, 8)):
        assert match_entry([pooled, ep], **key, layout=layout) == (ep, "other_path")  # its own model first
    plain_elsewhere = {**pooled, "gpu": "h100_sxm", "path": "tp", "layouts": [[8, 1, 1]]}
    assert match_entry([ep, pooled, plain_elsewhere], **key) == (plain_elsewhere, "other_gpu")
    assert match_entry([ep, pooled, plain_elsewhere], **key, layout=(8, 8)) == (ep, "other_path")
    path = tmp_path / "cal.json"
    save_calibration([ep, pooled], path)
    cost = build(R1, "h200_sxm", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", calibration=path,
                 moe_ep_size=8, attention_dp_size=8)
    assert cost.calibration["match"] == "other_path"
    assert f"other_path ({R1} on h200_sxm, ep path)" in cost.source
    # another model's entry of another path is no stand-in, even of the same family: none is
    v3 = key | {"model": "deepseek-ai/DeepSeek-V3"}
    assert match_entry([ep], **v3) == (None, "none")
    assert match_entry([ep, pooled], **v3, kind="moe+mla") == (None, "none")


def test_an_entry_whose_layouts_span_another_path_is_refused(tmp_path):
    [ep, _] = calibrate(load_runs(write(tmp_path, ROWS[2:3])))
    path = tmp_path / "cal.json"
    save_calibration([ep | {"layouts": [[8, 8, 1], [8, 1, 1]]}], path)
    with pytest.raises(CostModelError, match=r"entry 0 is for the 'ep' path but was fitted on layouts of \['tp'\]"):
        build(R1, "h200_sxm", tp=8, framework="trtllm", gemm_dtype="fp8", kv_dtype="fp8", calibration=path,
              moe_ep_size=8)
