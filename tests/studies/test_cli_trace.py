"""`servetune trace stats | convert | synth`: output, files written, one-line errors, exit 2."""

import json

import pytest
from typer.testing import CliRunner

from optimizer.cli import app
from studies.data import SAMPLE_TRACE
from studies.traces import load_trace, trace_stats

runner = CliRunner()


def test_stats_table_and_json_of_the_sample():
    table = runner.invoke(app, ["trace", "stats", str(SAMPLE_TRACE)])
    assert table.exit_code == 0 and "918" in table.output and "prompt_tokens" in table.output
    result = runner.invoke(app, ["trace", "stats", str(SAMPLE_TRACE), "--format", "json"])
    data = json.loads(result.output)
    assert data["rows"] == 918 and data["blocks"]["total"] == trace_stats(load_trace(SAMPLE_TRACE))["blocks"]["total"]


def test_stats_of_mooncake_prints_readme_figures(mooncake_path):
    result = runner.invoke(app, ["trace", "stats", str(mooncake_path)])
    assert result.exit_code == 0
    assert "12,031" in result.output and "3,537.0 s" in result.output and "3.40 req/s" in result.output


def test_bad_file_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,12,x\n")
    result = runner.invoke(app, ["trace", "stats", str(path)])
    assert result.exit_code == 2
    assert "error:" in result.output and "row 1 (line 2), column 'GeneratedTokens'" in result.output
    assert "Traceback" not in result.output
    assert runner.invoke(app, ["trace", "stats", str(tmp_path / "missing.csv")]).exit_code == 2


def test_spread_only_applies_to_mooncake(tmp_path):
    result = runner.invoke(app, ["trace", "stats", str(SAMPLE_TRACE), "--spread", "poisson"])
    assert result.exit_code == 2 and "applies to Mooncake" in result.output


def test_convert_with_window_and_rate(tmp_path):
    out = tmp_path / "w.parquet"
    result = runner.invoke(app, ["trace", "convert", str(SAMPLE_TRACE), "-o", str(out),
                                 "--window", "0:100", "--target-rps", "12"])
    assert result.exit_code == 0, result.output
    t = load_trace(out)
    assert trace_stats(t)["mean_rate"] == pytest.approx(12.0) and t.meta["window_s"] == [0.0, 100.0]
    bad = runner.invoke(app, ["trace", "convert", str(SAMPLE_TRACE), "-o", str(out), "--window", "x"])
    assert bad.exit_code == 2 and "START:END" in bad.output


def test_convert_to_mooncake(tmp_path):
    out = tmp_path / "m.jsonl"
    assert runner.invoke(app, ["trace", "convert", str(SAMPLE_TRACE), "-o", str(out), "--to", "mooncake"]).exit_code == 0
    back = load_trace(out, spread="raw")
    assert back.n == 918 and back.block_hashes.tolist() == load_trace(SAMPLE_TRACE).block_hashes.tolist()


def test_synth_mix(tmp_path):
    out = tmp_path / "s.parquet"
    result = runner.invoke(app, ["trace", "synth", "-o", str(out), "--duration", "120", "--rate", "10",
                                 "--arrival", "gamma", "--cv", "2", "--tenants", "chat:3:1:fast,batch:1",
                                 "--prefix-groups", "2", "--seed", "3"])
    assert result.exit_code == 0, result.output
    t = load_trace(out)
    assert set(t.tenant_names) == {"chat", "batch"} and set(t.slo_class_names) == {"fast", "default"}
    again = tmp_path / "s2.parquet"
    runner.invoke(app, ["trace", "synth", "-o", str(again), "--duration", "120", "--rate", "10", "--arrival", "gamma",
                        "--cv", "2", "--tenants", "chat:3:1:fast,batch:1", "--prefix-groups", "2", "--seed", "3"])
    assert load_trace(again).arrival_s.tolist() == t.arrival_s.tolist()
    bad = runner.invoke(app, ["trace", "synth", "-o", str(out), "--tenants", "chat"])
    assert bad.exit_code == 2 and "NAME:WEIGHT" in bad.output
