"""Plots: the right artists and labels on hand-built data, and real PNG/SVG files."""

from __future__ import annotations

import numpy as np
import optuna
import pytest

from optimizer.outputs.plots import (
    RateCurve,
    TrialPoint,
    gpus_figure,
    importance_figure,
    latency_cdf_figure,
    param_importances,
    pareto_figure,
    pareto_mask,
    rate_sweep_figure,
    save_figure,
)


def _legend(ax) -> list[str]:
    return [t.get_text() for t in ax.get_legend().get_texts()]


def test_pareto_mask_keeps_exactly_the_non_dominated_points():
    xy = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 15.0], [2.0, 30.0], [0.5, 5.0], [3.0, 15.0], [np.nan, 1.0]])
    # maximise x, minimise y: (0.5, 5), (1, 10) and both copies of (3, 15) trade off; (3, 15) beats (2, 20).
    assert pareto_mask(xy, ("maximize", "minimize")).tolist() == [True, False, True, False, True, True, False]
    # maximise both: (3, 15) twice and (2, 30).
    assert pareto_mask(xy, ("maximize", "maximize")).tolist() == [False, False, True, True, False, True, False]


def test_pareto_figure_marks_front_infeasible_and_baselines():
    points = [TrialPoint(0, 5.0, 900.0, baseline="vllm-default"), TrialPoint(1, 4.0, 700.0, baseline="sglang-default"),
              TrialPoint(2, 6.0, 800.0), TrialPoint(3, 7.0, 1500.0), TrialPoint(4, 5.5, 1200.0),
              TrialPoint(5, 9.0, 100.0, feasible=False)]
    fig = pareto_figure(points, ("weighted goodput (/s)", "p99 TTFT (ms)"), ("maximize", "minimize"))
    ax = fig.axes[0]
    assert ax.get_xlabel() == "weighted goodput (/s)" and ax.get_ylabel() == "p99 TTFT (ms)"
    labels = _legend(ax)
    assert labels == ["infeasible trials", "feasible trials", "Pareto front",
                      "baseline: vllm-default", "baseline: sglang-default"]
    front = ax.lines[0]
    # The infeasible trial dominates everything but is not on the front.
    assert list(front.get_xdata()) == [4.0, 6.0, 7.0] and list(front.get_ydata()) == [700.0, 800.0, 1500.0]


def test_rate_sweep_figure_has_target_and_one_curve_per_config():
    rates = np.array([1.0, 2.0, 4.0, 8.0])
    curves = {"best": RateCurve(rates, np.array([1.0, 0.99, 0.95, 0.5]), np.array([1.0, 2.0, 3.8, 4.0])),
              "vllm-default": RateCurve(rates, np.array([1.0, 0.9, 0.6, 0.2]), np.array([1.0, 1.8, 2.4, 1.6]))}
    fig = rate_sweep_figure(curves, target=0.9, current_rps=2.0)
    ax_att, ax_good = fig.axes
    assert ax_att.get_ylabel() == "SLO attainment" and ax_good.get_ylabel() == "weighted goodput (/s)"
    assert ax_att.get_xlabel() == "arrival rate (req/s)"
    assert _legend(ax_att) == ["best", "vllm-default", "target 90%", "trace rate"]
    assert _legend(ax_good) == ["best", "vllm-default", "trace rate"]
    assert list(ax_good.lines[0].get_ydata()) == [1.0, 2.0, 3.8, 4.0]
    with pytest.raises(ValueError, match="differ in length"):
        RateCurve(rates, rates[:2], rates)


def test_gpus_figure_puts_each_fleet_run_at_its_gpu_count():
    curves = {"vllm.yaml": [(2, 0.95, 4.0), (1, 0.6, 2.5)], "vllm-default": [(1, 0.4, 1.5), (2, 0.85, 3.0)]}
    fig = gpus_figure(curves, target=0.9, gpus_per_replica=2)
    ax_att, ax_good = fig.axes
    assert ax_att.get_xlabel().startswith("GPUs") and ax_att.get_title() == "SLO attainment vs GPUs at the trace rate"
    assert _legend(ax_att) == ["vllm.yaml", "vllm-default", "target 90%"]
    assert list(ax_att.lines[0].get_xdata()) == [2, 4]  # replicas x TP 2, sorted
    assert list(ax_good.lines[0].get_ydata()) == [2.5, 4.0]
    assert all(float(x).is_integer() for x in ax_att.get_xticks())  # whole GPUs, no 1.5


def test_latency_cdfs_end_at_one_and_show_slo_bounds():
    rng = np.random.default_rng(0)
    samples = {"best": {"ttft": rng.lognormal(5, 1.5, 500), "tpot": rng.normal(40, 5, 500)},
               "baseline": {"ttft": np.array([100.0, np.nan, 300.0]), "tpot": np.array([50.0, 60.0])}}
    fig = latency_cdf_figure(samples, {"ttft": 2000.0, "tpot": None})
    ax_ttft, ax_tpot = fig.axes
    assert ax_ttft.get_xlabel() == "TTFT (ms)" and ax_tpot.get_xlabel() == "TPOT (ms)"
    assert _legend(ax_ttft) == ["best", "baseline", "SLO 2000 ms"]
    assert _legend(ax_tpot) == ["best", "baseline"]  # no TPOT bound, no line
    assert ax_ttft.get_xscale() == "log" and ax_tpot.get_xscale() == "linear"
    baseline = ax_ttft.lines[1]
    assert list(baseline.get_xdata()) == [100.0, 300.0]  # NaN (never started) dropped
    assert baseline.get_ydata()[-1] == 1.0


def _study(n: int, seed: int = 0) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed))
    study.optimize(lambda t: 10 * t.suggest_float("tokens", 0, 1) + 0.01 * t.suggest_float("noise", 0, 1),
                   n_trials=n)
    return study


def test_importances_rank_the_knob_that_drives_the_objective():
    importances = param_importances(_study(40))
    assert set(importances) == {"tokens", "noise"}
    assert importances["tokens"] > importances["noise"]
    assert param_importances(_study(1)) == {}  # too few trials: nothing to say
    fig = importance_figure(importances)
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels[-1] == "tokens"  # most important on top


def test_save_figure_writes_png_and_svg(tmp_path):
    fig = importance_figure({"max_num_seqs": 0.7, "kv_headroom": 0.3})
    png, svg = save_figure(fig, tmp_path / "plots" / "importance")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 1000
    text = svg.read_text()
    assert "<svg" in text and "max_num_seqs" in text
