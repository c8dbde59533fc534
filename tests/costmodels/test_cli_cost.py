import json

import pytest
from typer.testing import CliRunner

from optimizer.cli import app
from tests.costmodels.conftest import SILICON

runner = CliRunner()


def test_show_json_reports_capacity_and_step_times(tmp_path):
    plot = tmp_path / "sps.png"
    result = runner.invoke(app, ["cost", "show", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100",
                                 "--format", "json", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    assert info["kv_bytes_per_token"] == 131_072
    assert info["kv_capacity_blocks"] == info["kv_capacity_tokens"] // 16
    steps = [v["step_ms"] for v in info["decode_step"].values()]
    assert steps == sorted(steps) and plot.stat().st_size > 0


def test_show_text_and_sps_export(tmp_path):
    result = runner.invoke(app, ["cost", "show", "--model", "qwen3-32b", "--gpu", "h200", "--tp", "2"])
    assert result.exit_code == 0 and "KV capacity" in result.output
    out = tmp_path / "sps.csv"
    result = runner.invoke(app, ["cost", "sps", "--model", "qwen3-8b", "--gpu", "a100", "-o", str(out)])
    assert result.exit_code == 0 and out.read_text().startswith("batch_tokens,")


def test_sps_writes_sglangs_dspark_table(tmp_path):
    out = tmp_path / "sps.json"
    base = ["cost", "sps", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100", "-o", str(out)]
    result = runner.invoke(app, [*base, "--format", "sglang-dspark", "--block-size", "5",
                                 "--max-running-requests", "20"])
    assert result.exit_code == 0, result.output
    table = json.loads(out.read_text())
    assert table["sample_batch_tokens"] == [6, 12, 24, 48, 96, 120]  # 1, 2, 4, 8, 16 and 20 requests x (5 + 1)
    assert table["max_batch_tokens"] == 120 and len(table["sample_steps_per_sec"]) == 6
    bad = runner.invoke(app, [*base, "--format", "sglang-dspark", "--block-size", "40"])
    assert bad.exit_code == 2 and "num_speculative_tokens" in bad.output
    assert runner.invoke(app, [*base, "--format", "yaml"]).exit_code == 2


@pytest.mark.parametrize("args, message", [
    (["--model", "nope", "--gpu", "h100"], "unknown model 'nope'"),
    (["--model", "llama-3.1-8b", "--gpu", "tpu"], "unknown GPU 'tpu'"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--tp", "3"], "tp=3 does not divide"),
    (["--model", "llama-3.1-8b", "--gpu", "h100", "--gpu-memory-utilization", "0.1"], "leaves no KV memory"),
])
def test_errors_are_one_line_with_exit_code_2(args, message):
    result = runner.invoke(app, ["cost", "show", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_calibrate_writes_a_loadable_file(tmp_path):
    if not SILICON.is_file():
        pytest.skip("measured runs not available")
    out = tmp_path / "c.json"
    result = runner.invoke(app, ["cost", "calibrate", str(SILICON), "-o", str(out), "--fit", "formula"])
    assert result.exit_code == 0, result.output
    show = runner.invoke(app, ["cost", "show", "--model", "qwen3-32b", "--gpu", "h100", "--tp", "2",
                               "--calibration", str(out), "--format", "json"])
    assert "calibrated:c.json" in json.loads(show.output)["source"]


def test_calibrate_by_replay_fits_prefill_and_decode_terms(tmp_path):
    """The default fit replays the runs; a few vLLM rows keep it quick."""
    import polars as pl

    if not SILICON.is_file():
        pytest.skip("measured runs not available")
    rows = pl.read_csv(SILICON, infer_schema_length=None).filter(pl.col("backend") == "vllm").gather_every(15)
    runs, out = tmp_path / "runs.csv", tmp_path / "replay.json"
    rows.write_csv(runs)
    result = runner.invoke(app, ["cost", "calibrate", str(runs), "-o", str(out)])
    assert result.exit_code == 0, result.output
    entries = json.loads(out.read_text())["entries"]
    assert {e["fit"] for e in entries} == {"replay"} and {e["model"] for e in entries} == {"Qwen/Qwen3-32B", "*"}
    for e in entries:
        assert e["prefill_scale"] > 0 and e["decode_scale"] > 0 and "measured_server" in e
        assert e["tpot_mape_after"] <= e["tpot_mape_before"] + 1e-9
    show = runner.invoke(app, ["cost", "show", "--model", "qwen3-32b", "--gpu", "h100", "--tp", "2",
                               "--calibration", str(out), "--format", "json"])
    assert "calibrated:replay.json setup" in json.loads(show.output)["source"]
    assert runner.invoke(app, ["cost", "calibrate", str(runs), "--fit", "guess"]).exit_code == 2


def test_calibrate_names_the_terms_a_fit_left_on_a_limit(tmp_path):
    """Runs ten times slower than the tables allow push the decode scale past its 5x limit."""
    import polars as pl

    if not SILICON.is_file():
        pytest.skip("measured runs not available")
    rows = pl.read_csv(SILICON, infer_schema_length=None).filter(pl.col("backend") == "vllm").gather_every(30)
    runs, out = tmp_path / "runs.csv", tmp_path / "slow.json"
    rows.with_columns(pl.col("silicon_tpot_ms") * 10).write_csv(runs)
    result = runner.invoke(app, ["cost", "calibrate", str(runs), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "decode_scale held at the fit's range limit" in " ".join(result.output.split())
    assert all("decode_scale" in e["pinned_terms"] for e in json.loads(out.read_text())["entries"])
