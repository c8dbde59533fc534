"""`servetune validate` scores every row it can and names every row it cannot, with why.

The runs files are written in aiconfigurator's silicon format (``model_path``, ``system``,
``backend``, ``tp_size``, ``gemm_quant_mode``, ``silicon_ttft_ms``, ...), small enough
(2 clients, 128 -> 32 tokens, one profiled request per client) to replay in moments.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

import costmodels
from costmodels import CostModelError, build, load_runs
from costmodels.calibration import BUNDLED, MIN_TIER_RUNS, load_tier_errors
from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from optimizer.cli import app
from optimizer.cli.validate import (
    format_report,
    mape_table,
    measured_server,
    predict_runs,
    roofline_reason,
)
from optimizer.fidelity.closedloop import (
    TRTLLM_DEFAULT,
    BenchClient,
    ClosedLoopError,
    client_for,
    run_benchmark,
    server_max_seq_len,
)
from optimizer.fidelity.replayfit import for_clients, server_config
from optimizer.search.targets import context_of

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = ROOT / "costmodels" / "data" / "models" / "meta-llama--Meta-Llama-3.1-8B_config.json"
LLAMA = "meta-llama/Llama-3.1-8B"
BENCH = BenchClient(requests_per_client=1, warmup_per_client=0)
FAST = ["--requests-per-client", "1", "--warmup-per-client", "0"]
SILICON = ["model_path", "system", "backend", "tp_size", "gemm_quant_mode", "batch_size", "isl", "osl",
           "silicon_ttft_ms", "silicon_tpot_ms"]


def good(model=LLAMA, backend="trtllm", quant="", **change):
    """One silicon row: ``model`` on one H100, 2 clients, 128 -> 32 tokens."""
    row = dict(zip(SILICON, [model, "h100_sxm", backend, "1", quant, "2", "128", "32", "20.0", "7.0"], strict=True))
    return row | {k: str(v) for k, v in change.items()}


def write_runs(path: Path, rows: list[dict]) -> Path:
    columns = list(rows[0])
    path.write_text("\n".join([",".join(columns), *(",".join(r[c] for c in columns) for r in rows)]) + "\n")
    return path


@pytest.fixture
def my_llama(tmp_path) -> Path:
    """A config.json of a model that is not built in (Llama-3.1-8B's shapes), in its folder."""
    folder = tmp_path / "My-Llama"
    folder.mkdir()
    return Path(shutil.copy(LLAMA_CONFIG, folder / "config.json"))


def by_line(pred: pl.DataFrame) -> dict[int, dict]:
    """Predicted rows by their file line (the header is line 1)."""
    return {i + 2: r for i, r in enumerate(pred.iter_rows(named=True))}


def assert_scored(row: dict) -> None:
    assert row["error"] is None
    assert math.isfinite(row["pred_ttft_ms"]) and row["pred_ttft_ms"] > 0
    assert math.isfinite(row["pred_tpot_ms"]) and row["pred_tpot_ms"] > 0


def assert_failed(row: dict, line: int, *reason: str) -> None:
    assert row["error"].startswith(f"row {line}: "), row["error"]
    for part in reason:
        assert part in row["error"], row["error"]
    assert math.isnan(row["pred_ttft_ms"]) and math.isnan(row["pred_tpot_ms"])


# -- load_runs: bad values are a row's, a malformed file is the file's -------------------------------
def test_load_runs_marks_each_bad_value_and_still_raises_for_calibration(tmp_path):
    path = write_runs(tmp_path / "runs.csv", [
        good(), good(osl=-5), good(isl="abc"), good(silicon_ttft_ms="nan"), good(tp_size="1.5"),
        good(silicon_tpot_ms="0"), good(batch_size="")])
    runs = load_runs(path, bad_rows="mark")
    errors = dict(enumerate(runs["error"].to_list(), start=2))
    assert errors[2] is None and runs.row(0, named=True)["osl"] == 32
    assert errors[3] == "row 3: column 'osl': -5 is not a positive number"
    assert errors[4] == "row 4: column 'isl': 'abc' is not a positive number"
    assert errors[5] == "row 5: column 'ttft_ms': 'nan' is not a positive number"
    assert errors[6] == "row 6: column 'tp': 1.5 is not a whole number"
    assert errors[7] == "row 7: column 'tpot_ms': 0.0 is not a positive number"
    assert errors[8] == "row 8: column 'batch_size': missing value"
    assert runs["osl"][1] is None and runs["isl"][2] is None  # a bad value is never replaced by another
    # calibration keeps refusing the file at its first bad row
    with pytest.raises(CostModelError, match=r"row 3, column 'osl': -5 is not a positive number"):
        load_runs(path)


def test_load_runs_raises_for_a_malformed_file_in_either_mode(tmp_path):
    missing = write_runs(tmp_path / "missing.csv", [{k: v for k, v in good().items() if k != "osl"}])
    with pytest.raises(CostModelError, match="missing column 'osl'"):
        load_runs(missing, bad_rows="mark")
    text = write_runs(tmp_path / "text.csv", [good(isl="long"), good(isl="short")])
    with pytest.raises(CostModelError, match="column 'isl' is not numeric"):
        load_runs(text, bad_rows="mark")
    with pytest.raises(ValueError, match="bad_rows"):
        load_runs(text, bad_rows="skip")


def test_load_runs_reads_a_kv_dtype_column_and_leaves_it_null_when_absent(tmp_path):
    without = load_runs(write_runs(tmp_path / "a.csv", [good()]))
    assert without["kv_dtype"].to_list() == [None]
    rows = [good() | {"kv_cache_dtype": "FP8"}, good() | {"kv_cache_dtype": ""}]
    assert load_runs(write_runs(tmp_path / "b.csv", rows))["kv_dtype"].to_list() == ["fp8", None]


# -- validate: each kind of bad row, the rest scored -------------------------------------------------
def test_validate_scores_the_good_rows_and_names_every_bad_one(tmp_path):
    runs = write_runs(tmp_path / "runs.csv", [
        good(),                                  # line 2
        good(model="acme/Mystery-7B"),           # 3: not built in, no --model-config
        good(quant="nvfp4"),                     # 4: NVFP4 on a GPU without FP4 tensor cores
        good(backend="tgi"),                     # 5: an unknown framework
        good(osl=-5),                            # 6: a bad value
        good(isl=130000, osl=2000),              # 7: past the model's context
        good(batch_size=4, isl=256),             # 8
    ])
    out = CliRunner().invoke(app, ["validate", str(runs), "-o", str(tmp_path / "pred.csv"), *FAST])
    assert out.exit_code == 0, out.output
    pred = by_line(pl.read_csv(tmp_path / "pred.csv", infer_schema_length=None))
    assert_scored(pred[2])
    assert_scored(pred[8])
    assert_failed(pred[3], 3, "unknown model 'acme/Mystery-7B'; pass --model-config CONFIG.json for it",
                  "built-in: meta-llama/Llama-3.1-8B")
    assert_failed(pred[4], 4, "GPU h100_sxm has no nvfp4 tensor cores", "trtllm/nvfp4 (KV fp8)")
    assert_failed(pred[5], 5, "unknown framework 'tgi'")
    assert_failed(pred[6], 6, "column 'osl': -5 is not a positive number")
    assert_failed(pred[7], 7, "130000 + 2000 tokens exceeds max_seq_len=131072 (the model's context length)")
    # the report lists each, the MAPE is over the two scored rows only, and stderr says so
    assert "5 run(s) not simulated (left out of the MAPE):" in out.stdout
    for line in (3, 4, 5, 6, 7):
        assert f"  {pred[line]['error']}" in out.stdout
    assert "warning: 5 of 7 runs" in out.stderr
    [group, overall] = [line for line in out.stdout.splitlines() if line.startswith(("meta-llama", "all"))]
    assert group.split()[2] == overall.split()[2] == "2"  # runs scored


def test_validate_exits_2_when_no_row_can_be_scored(tmp_path):
    runs = write_runs(tmp_path / "runs.csv", [good(model="acme/Mystery-7B"), good(osl=0)])
    out = CliRunner().invoke(app, ["validate", str(runs), *FAST])
    assert out.exit_code == 2
    assert "no run of 2 could be simulated" in out.stdout
    assert "row 2: unknown model 'acme/Mystery-7B'" in out.stdout and "row 3: column 'osl'" in out.stdout
    assert "error: none of the 2 runs" in out.stderr


def test_model_config_is_for_the_one_unknown_model_it_names(tmp_path, my_llama):
    single = load_runs(write_runs(tmp_path / "one.csv", [good(model="acme/My-Llama"), good()]), builtin_only=False,
                       bad_rows="mark")
    for row in by_line(predict_runs(single, model_config=my_llama, bench=BENCH)).values():
        assert_scored(row)
    several = load_runs(write_runs(tmp_path / "two.csv", [good(model="acme/Other-9B"), good(model="acme/My-Llama"),
                                                          good()]), builtin_only=False, bad_rows="mark")
    pred = by_line(predict_runs(several, model_config=my_llama, bench=BENCH))
    assert_failed(pred[2], 2, "unknown model 'acme/Other-9B'", f"--model-config {my_llama} is for 'acme/My-Llama'")
    assert_scored(pred[3])  # the config's folder names it
    assert_scored(pred[4])
    # a config that names neither: both are errors, naming the models
    elsewhere = tmp_path / "elsewhere" / "config.json"
    elsewhere.parent.mkdir()
    shutil.copy(my_llama, elsewhere)
    pred = by_line(predict_runs(several, model_config=elsewhere, bench=BENCH))
    for line, model in ((2, "acme/Other-9B"), (3, "acme/My-Llama")):
        assert_failed(pred[line], line, f"unknown model {model!r}", "names none of the 2 models not built in")
    assert_scored(pred[4])


def test_a_setups_failure_is_built_once(tmp_path, monkeypatch):
    calls = []

    def counting_build(*args, **kwargs):
        calls.append(kwargs["gemm_dtype"])
        return build(*args, **kwargs)

    monkeypatch.setattr(costmodels, "build", counting_build)
    runs = load_runs(write_runs(tmp_path / "runs.csv", [good(quant="nvfp4"), good(quant="nvfp4", isl=256),
                                                        good()]), bad_rows="mark")
    pred = by_line(predict_runs(runs, bench=BENCH))
    assert calls == ["nvfp4", "bf16"]
    assert pred[2]["error"].removeprefix("row 2: ") == pred[3]["error"].removeprefix("row 3: ")
    assert_scored(pred[4])


# -- TRT-LLM: the longest sequence is not the step budget --------------------------------------------
@pytest.fixture(scope="module")
def llama_trt():
    cost = build(LLAMA, "h100", framework="trtllm")
    return cost, server_config("trtllm", context_of(cost, "h100", context_len=0))


@pytest.mark.parametrize("isl, osl", [(8192, 16), (1024, 8192)])
def test_trtllm_runs_long_prompts_and_long_outputs_in_full(llama_trt, isl, osl):
    cost, config = llama_trt
    assert not config.enable_chunked_prefill and config.max_num_batched_tokens == 8192
    loop = run_benchmark(cost, config, 2, isl, osl, BENCH, max_seq_len=server_max_seq_len("trtllm", LLAMA))
    np.testing.assert_array_equal(loop.result.tokens_generated, osl)
    assert np.isfinite(loop.mean_ttft_ms) and np.isfinite(loop.mean_tpot_ms)


def test_validate_replays_trtllm_long_rows_in_full(tmp_path):
    runs = load_runs(write_runs(tmp_path / "runs.csv", [good(isl=8192, osl=16), good(isl=1024, osl=8192)]),
                     bad_rows="mark")
    for row in by_line(predict_runs(runs, bench=BENCH)).values():
        assert_scored(row)


def test_a_run_that_does_not_fit_names_the_limit_with_its_numbers(llama_trt):
    cost, config = llama_trt
    seq = server_max_seq_len("trtllm", LLAMA)
    # the engine's own rule caps a sequence at the unchunked step budget: an error, never a cut
    with pytest.raises(ClosedLoopError, match=r"1024 \+ 8192 tokens exceeds the step budget "
                                              r"max_num_batched_tokens=8192"):
        run_benchmark(cost, TRTLLM_DEFAULT, 1, 1024, 8192, BENCH)
    with pytest.raises(ClosedLoopError, match="a 9000-token prompt exceeds the step budget max_num_batched_tokens=8192"):
        run_benchmark(cost, config, 1, 9000, 16, BENCH, max_seq_len=seq)
    with pytest.raises(ClosedLoopError, match=r"130000 \+ 2000 tokens exceeds max_seq_len=131072"):
        run_benchmark(cost, config, 1, 130000, 2000, BENCH, max_seq_len=seq)
    # the KV pool: 4096 tokens at gpu_memory_utilization 0.9, in blocks of 16
    small = CostModel.synthetic(4096, tables=linear_tables(per_token_s=1e-4, overhead_s=2e-3))
    pool = r"the KV pool holds 3680 tokens \(230 blocks of 16 at gpu_memory_utilization=0.9\)"
    with pytest.raises(ClosedLoopError, match=r"reject reason EXCEEDS_CAPACITY, 4000 \+ 10 tokens\); " + pool):
        run_benchmark(small, config, 1, 4000, 10, BENCH, max_seq_len=0)
    with pytest.raises(ClosedLoopError, match=r"cut short .* \(first: 1680 of 3000 output tokens after a 2000-token "
                                              r"prompt\); " + pool):
        run_benchmark(small, config, 1, 2000, 3000, BENCH, max_seq_len=0)


def test_each_row_is_replayed_as_its_own_client_drove_it(tmp_path):
    """A row InferenceX measured is replayed with its client's drawn lengths, the others
    with AIPerf's fixed ones; both keep the caller's counts."""
    bench = BenchClient(requests_per_client=4, warmup_per_client=1)
    rows = [good(batch_size=4, isl=1024, osl=64) | {"client": c} for c in ("aiperf", "inferencex")]
    pred = predict_runs(load_runs(write_runs(tmp_path / "runs.csv", rows)), bench=bench)
    cost = build(LLAMA, "h100", framework="trtllm")
    server = measured_server(cost, "trtllm")
    config = for_clients(server_config("trtllm", context_of(cost, "h100", context_len=0), server), server, 4)
    for i, client in enumerate((bench, client_for("inferencex", bench))):
        loop = run_benchmark(cost, config, 4, 1024, 64, client, max_seq_len=server_max_seq_len("trtllm", LLAMA))
        assert (pred["pred_ttft_ms"][i], pred["pred_tpot_ms"][i]) == pytest.approx(
            (loop.mean_ttft_ms, loop.mean_tpot_ms), rel=1e-9)
    assert pred["pred_ttft_ms"][1] != pytest.approx(pred["pred_ttft_ms"][0], rel=0.01)


def test_a_known_server_replaces_the_fitted_one_for_every_row(tmp_path):
    """``server`` (launch settings a user knows) is what each row replays on, in place of
    the entry's fitted or the framework's unmeasured server, and is reported as such."""
    bench = BenchClient(requests_per_client=2, warmup_per_client=0)
    runs = load_runs(write_runs(tmp_path / "runs.csv", [good(batch_size=8, isl=2048, osl=16)]))
    known = {"enable_chunked_prefill": True, "max_num_batched_tokens": 512}
    pred = predict_runs(runs, bench=bench, server=known)
    cost = build(LLAMA, "h100", framework="trtllm")
    config = server_config("trtllm", context_of(cost, "h100", context_len=0), known)
    loop = run_benchmark(cost, config, 8, 2048, 16, bench, max_seq_len=server_max_seq_len("trtllm", LLAMA))
    assert (pred["pred_ttft_ms"][0], pred["pred_tpot_ms"][0]) == pytest.approx(
        (loop.mean_ttft_ms, loop.mean_tpot_ms), rel=1e-9)
    assert json.loads(pred["measured_server"][0]) == known
    # 2,048-token prompts in 512-token chunks: the first token waits for four prefill steps
    assert pred["pred_ttft_ms"][0] > predict_runs(runs, bench=bench)["pred_ttft_ms"][0] * 1.2


# -- which cost model, KV dtype and calibration each row used ----------------------------------------
def test_report_names_cost_models_kv_dtypes_substituted_tables_and_uncalibrated_rows(tmp_path):
    rows = [good() | {"kv_cache_dtype": ""},                                  # trtllm bf16: calibrated
            good(backend="sglang") | {"kv_cache_dtype": ""},                  # sglang bf16: no entry
            good(backend="sglang", quant="fp8") | {"kv_cache_dtype": ""},     # fp8 KV assumed: no table
            good(backend="sglang", quant="fp8") | {"kv_cache_dtype": "bf16"}]  # fp8 GEMM, bf16 KV recorded
    pred = predict_runs(load_runs(write_runs(tmp_path / "runs.csv", rows), bad_rows="mark"), bench=BENCH)
    for row in by_line(pred).values():
        assert_scored(row)
    assert pred["kv_dtype"].to_list() == ["bf16", "bf16", "fp8", "bf16"]
    assert pred["kv_dtype_assumed"].to_list() == [True, True, True, False]
    sources = pred["cost_source"].to_list()
    assert "calibrated:default" in sources[0] and sources[1].endswith("; uncalibrated")
    # SGLang measured no FP8-KV context attention: a stated substitute, not the roofline
    substitute = "ctx attention with fp8 KV read from the measured bf16-KV kernel as measured (unmeasured)"
    assert sources[2].startswith("profiled:aiconfigurator/h100_sxm/sglang-0.5.14") and substitute in sources[2]
    assert all(roofline_reason(s) is None for s in sources)
    assert roofline_reason("roofline:testgpu_sxm/bf16 (no op tables for testgpu_sxm); uncalibrated") == (
        "no op tables for testgpu_sxm")
    table = {(r["framework"], r["gemm_dtype"]): r for r in mape_table(pred).iter_rows(named=True)}
    assert table[("trtllm", "bf16")]["uncalibrated"] == 0
    assert table[("sglang", "bf16")]["uncalibrated"] == 1 and table[("sglang", "fp8")]["uncalibrated"] == 2
    assert table[("all", "all")]["uncalibrated"] == 3
    text = format_report(pred)
    assert "ROOFLINE" not in text and f"{substitute}  (1 runs)" in text
    # per setup: the tier and the error tune's bands take for it
    assert pred["calibration_error"][0].startswith("setup calibration entry, out of sample: TTFT")
    # no entry: the error the bundled file measured for that tier on held-out setups, else the wide default
    none = (load_tier_errors(BUNDLED).get("tiers") or {}).get("none")
    stated = (f"none tier (uncalibrated), measured on {none['runs']} runs of {none['setups']} setups with their "
              f"setup and model held out: TTFT {none['ttft_mape']:.1f}%, TPOT {none['tpot_mape']:.1f}%"
              if none and none["runs"] >= MIN_TIER_RUNS else "uncalibrated (no calibration entry): TTFT 41%, TPOT 51%")
    assert pred["calibration_error"][1].startswith(stated)
    assert "calibration tier per setup, and the error tune's bands take for it:" in text
    assert f"  {LLAMA} sglang/fp8 on h100_sxm tp1: none; {stated}" in text
    assert "fp8/fp8 (assumed)" in text and "fp8/bf16 " in text
    assert "the runs record no KV dtype" in text
    assert "3 rows uncalibrated" in text
    assert f"{LLAMA} sglang/bf16 on h100_sxm tp1  (1 runs)" in text
    assert f"{LLAMA} sglang/fp8 on h100_sxm tp1  (2 runs)" in text


def test_placeholder_moe_columns_of_a_dense_model_given_by_its_config_are_not_read(tmp_path, my_llama):
    # aiconfigurator's dense rows carry moe_tp_size 1, moe_ep_size 0: for a model servetune
    # does not know they were a layout error before its config.json was read
    rows = [good(model="acme/My-Llama", tp_size="2", moe_tp_size="1", moe_ep_size="0"),
            good(model="acme/My-Llama", tp_size="2", moe_tp_size="1", moe_ep_size="2")]
    path = write_runs(tmp_path / "runs.csv", rows)
    blind = load_runs(path, builtin_only=False, bad_rows="mark")
    assert "column 'moe_ep_size': 0 is not a positive whole number" in blind["error"][0]
    runs = load_runs(path, builtin_only=False, bad_rows="mark", model_config=my_llama)
    assert runs["error"].to_list() == [None, None]  # a dense model: its MoE columns are placeholders
    assert runs.select("tp", "moe_ep_size", "attention_dp_size").rows() == [(2, 1, 1), (2, 1, 1)]
    # the CLI reads them the same way, and a real inconsistency still names its row
    bad = good(model="acme/My-Llama", tp_size="2", moe_tp_size="1", moe_ep_size="0", attention_dp_size="x")
    cli = write_runs(tmp_path / "cli.csv", [rows[0] | {"attention_dp_size": ""}, bad])
    out = CliRunner().invoke(app, ["validate", str(cli), "--model-config", str(my_llama), *FAST])
    assert "row 3: column 'attention_dp_size': 'x' is not a positive whole number" in out.stdout
    assert "1 of 2 runs" in out.stderr
