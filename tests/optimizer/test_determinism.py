"""The same command and seed give the same answer: `servetune tune` run twice into two
folders writes identical summary.json (less when and where it ran) and trials.parquet (less
timings and process ids), on one replica and on a fleet with a random failure plan."""

import json

import polars as pl
import pytest

from tests.optimizer.test_kill_and_rerun import run_ok, trace_file
from tests.optimizer.test_tune_cli import MODEL, servetune

__all__ = ["trace_file"]

#: what legitimately differs between two runs of one command: clocks, paths, process ids
RUN_SPECIFIC = {"written_utc", "command", "path", "run_dir", "storage"}
TIMING_COLUMNS = ("datetime_start", "datetime_complete", "duration_s", "user_attrs_worker")


def without(value, keys=RUN_SPECIFIC):
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


@pytest.mark.parametrize("fleet", [[], ["--replicas", 2, "--mtbf", 120, "--repair", 20]], ids=["one-replica", "fleet"])
def test_same_command_and_seed_give_identical_outputs(trace_file, tmp_path, fleet):
    written = []
    for run in ("a", "b"):
        run_ok(servetune("tune", "--trace", trace_file, *MODEL, "--engine", "vllm", "--trials", 8, "--batch-size", 4,
                         "--seed", 7, "--study-name", "same", "--run-dir", tmp_path / run, "--quiet", *fleet), tmp_path)
        folder = tmp_path / run / "vllm"
        summary = json.loads((folder / "summary.json").read_text())
        trials = pl.read_parquet(folder / "trials.parquet")
        assert trials.height == 8 and summary["best"]["report"]["weighted_goodput"] > 0
        written.append((summary, trials, (folder / "vllm.yaml").read_text()))
    (first, first_trials, first_yaml), (second, second_trials, second_yaml) = written
    assert without(first) == without(second)
    assert first_trials.drop(TIMING_COLUMNS).equals(second_trials.drop(TIMING_COLUMNS))
    assert first_yaml == second_yaml
    if fleet:
        assert first["deployment"]["failures"] is not None and first["deployment"]["replicas"] == 2
    # the bounds every trial was held to: the default tail bound from the SLO (500 ms) and the default's tail
    default_p99 = first["baselines"]["vllm-default"]["report"]["p99_ttft_ms"]
    assert first["bounds"]["p99_ttft_ms"] == pytest.approx(2 * max(500.0, default_p99))
