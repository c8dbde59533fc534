"""The closed-loop harness: a true fixed point, exact on a linear model, close to a measured run."""

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from costmodels import build
from costmodels.costmodel import CostModel
from costmodels.steptable import linear_tables
from optimizer.cli import app
from optimizer.closedloop import ClosedLoopError, framework_config, run_closed_loop
from policies.config import PolicyConfig

# Step = 2 ms + 0.1 ms per token: a prefill of P tokens takes 2 + 0.1 P ms, a decode step of S sequences 2 + 0.1 S.
LINEAR = CostModel.synthetic(1_000_000, tables=linear_tables(per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0,
                                                              per_pair_s=0.0, overhead_s=2e-3))
CONFIG = PolicyConfig(gpu_memory_utilization=1.0)


def test_arrivals_equal_the_previous_finish_exactly():
    loop = run_closed_loop(build("meta-llama/Llama-3.1-8B", "h100", framework="trtllm"), framework_config("trtllm", None),
                           16, 2048, 64, waves=5)
    assert np.all(loop.arrival_s[:, 0] == 0.0)
    np.testing.assert_array_equal(loop.arrival_s[:, 1:], loop.finish_s[:, :-1])
    assert np.all(np.diff(loop.trace.arrival_s) >= 0)
    assert loop.iterations >= 5  # one per wave joining, then the confirming pass


def test_synchronized_clients_match_the_hand_computed_loop():
    # Two clients start together: one 200-token prefill step (22 ms), then 9 decode steps of
    # 2 sequences (2.2 ms). Nothing breaks the symmetry, so every wave repeats it.
    loop = run_closed_loop(LINEAR, CONFIG, 2, 100, 10, waves=3)
    e2e = 0.022 + 9 * 0.0022
    np.testing.assert_allclose(loop.arrival_s, [[0, e2e, 2 * e2e]] * 2, rtol=1e-12)
    assert loop.steady_ttft_ms == pytest.approx(22.0)
    assert loop.steady_tpot_ms == pytest.approx(2.2)


def test_reproduces_a_measured_h100_run():
    # silicon_dense_h100.csv: Llama-3.1-8B, TRT-LLM 1.0, TP1, 8 clients, 1024 -> 128 tokens:
    # measured mean TTFT 190.95 ms and TPOT 7.94 ms. Tolerances: TPOT within 15%, about the
    # engine's TPOT MAPE over all 177 Llama runs (12.5%); TTFT, which no calibration fits,
    # within 25%. A loop without the synchronized wave would give one lone 1024-token
    # prefill (~30 ms, 85% off); one that ignores finishes would not be steady at all.
    loop = run_closed_loop(build("meta-llama/Llama-3.1-8B", "h100", framework="trtllm"), framework_config("trtllm", None),
                           8, 1024, 128)
    assert loop.steady_tpot_ms == pytest.approx(7.94, rel=0.15)
    assert loop.steady_ttft_ms == pytest.approx(190.95, rel=0.25)


def test_bad_sizes_and_requests_that_never_fit_are_errors():
    with pytest.raises(ClosedLoopError, match="waves"):
        run_closed_loop(LINEAR, CONFIG, 2, 100, 10, waves=1)
    with pytest.raises(ClosedLoopError, match="clients"):
        run_closed_loop(LINEAR, CONFIG, 0, 100, 10)
    tiny = CostModel.synthetic(64, tables=LINEAR.tables)
    with pytest.raises(ClosedLoopError, match="did not finish"):
        run_closed_loop(tiny, CONFIG, 2, 100, 10)
    with pytest.raises(ClosedLoopError, match="unknown framework"):
        framework_config("tgi", None)


def _runs_csv(path, rows):
    cols = ["model", "gpu", "framework", "tp", "batch_size", "isl", "osl", "ttft_ms", "tpot_ms"]
    pl.DataFrame(rows, schema=cols, orient="row").write_csv(path)
    return path


def test_validate_command_prints_mape_and_writes_predictions(tmp_path):
    runs = _runs_csv(tmp_path / "runs.csv", [("meta-llama/Llama-3.1-8B", "h100", "trtllm", 1, 8, 1024, 128, 190.95, 7.94),
                                             ("meta-llama/Llama-3.1-8B", "h100", "trtllm", 2, 8, 1024, 128, 140.0, 5.0)])
    out = CliRunner().invoke(app, ["validate", str(runs), "-o", str(tmp_path / "pred.csv"),
                                   "--plot", str(tmp_path / "scatter.png")])
    assert out.exit_code == 0, out.output
    assert "all/all" in out.output and "worst TTFT rows" in out.output
    pred = pl.read_csv(tmp_path / "pred.csv")
    assert pred["pred_tpot_ms"][0] == pytest.approx(7.94, rel=0.15)
    assert (tmp_path / "scatter.png").stat().st_size > 0


def test_validate_command_names_bad_rows_and_unknown_models(tmp_path):
    bad = _runs_csv(tmp_path / "bad.csv", [("meta-llama/Llama-3.1-8B", "h100", "trtllm", 1, 8, 1024, -5, 1.0, 1.0)])
    out = CliRunner().invoke(app, ["validate", str(bad)])
    assert out.exit_code == 2 and "row 2" in out.output and "osl" in out.output
    unknown = _runs_csv(tmp_path / "unknown.csv", [("acme/Mystery-7B", "h100", "trtllm", 1, 8, 1024, 128, 1.0, 1.0)])
    out = CliRunner().invoke(app, ["validate", str(unknown)])
    assert out.exit_code == 2 and "acme/Mystery-7B" in out.output
