"""Issue 16's complete report: load over the arrival window, goodput per window, weighted
Jain, truncations, cache benefit in time, KV level over time and Little's law."""

import dataclasses
import math

import numpy as np
import pytest

from policies.config import PolicyConfig
from policies.engine import simulate, simulate_many
from studies.metrics import score
from studies.slo import SLOSet, parse_slo
from studies.traces import Trace
from tests.policies.conftest import cost_model, poisson_trace
from tests.policies.conftest import make_trace as engine_trace
from tests.studies.test_metrics import F, R, make_result, make_trace

NAN = math.nan


# -- hand-made results ---------------------------------------------------------------------
def two_tenants(weights) -> tuple[Trace, object]:
    """Tenant 0 is served 90 + 10 = 100 tokens, tenant 1 190 + 10 = 200."""
    trace = make_trace([0.0, 1.0], prompt=[90, 190], tenant=[0, 1], tenant_names=("a", "b"))
    result = make_result([F, F], first=[0.5, 1.5], finish=[1.0, 2.0], generated=[10, 10])
    return trace, dataclasses.replace(result, tenant_weight=np.asarray(weights, float))


@pytest.mark.parametrize(("weights", "jain"), [
    ([1.0, 1.0], 300**2 / (2 * (100**2 + 200**2))),  # 0.9: equal weights, unequal service
    ([1.0, 2.0], 1.0),  # service in proportion to the weights: x = (100, 100)
    ([2.0, 1.0], 250**2 / (2 * (50**2 + 200**2))),  # x = (50, 200)
])
def test_jain_index_is_over_service_per_weight(weights, jain):
    trace, result = two_tenants(weights)
    assert score(result, trace, SLOSet()).jain_index == pytest.approx(jain)


def test_goodput_windows_tile_the_run_and_add_up_to_the_overall_goodput():
    """Four requests, good ones finishing at 0.5, 0.75 and 2.25 s; the run ends at 3.5 s, so
    1 s windows are [0,1) [1,2) [2,3) [3,3.5]: 2, 0, 1 and 0 good per second of each."""
    trace = make_trace([0.0, 0.25, 0.5, 1.0])
    result = make_result([F, F, F, R], first=[0.25, 0.5, 1.0, NAN], finish=[0.5, 0.75, 2.25, 3.5],
                         generated=[10, 10, 10, 0])
    rep = score(result, trace, SLOSet(), goodput_window_s=1.0)
    assert rep.goodput_windows == [2.0, 0.0, 1.0, 0.0]
    lengths = np.array([1.0, 1.0, 1.0, 0.5])
    assert (np.array(rep.goodput_windows) * lengths).sum() == rep.n_good == 3
    assert (np.array(rep.goodput_windows) * lengths).sum() / lengths.sum() == pytest.approx(rep.request_goodput)
    assert rep.goodput_window_min == 0.0  # over the three full windows: the short tail does not count
    assert rep.goodput_window_p10 == pytest.approx(np.percentile([2.0, 0.0, 1.0], 10))
    short = score(result, trace, SLOSet(), goodput_window_s=10.0)
    assert short.goodput_windows == [pytest.approx(3 / 3.5)] and math.isnan(short.goodput_window_min)
    rounded = make_result([F], first=[0.05], finish=[0.1 + 0.2], generated=[10])  # 0.30000000000000004 s
    windows = score(rounded, make_trace([0.0]), SLOSet(), goodput_window_s=0.1).goodput_windows
    assert windows == [0.0, 0.0, pytest.approx(10.0)]  # no window of a rounding error's length
    with pytest.raises(ValueError, match="goodput_window_s"):
        score(result, trace, SLOSet(), goodput_window_s=0.0)


def test_kv_level_over_time_weights_each_sample_by_how_long_it_holds():
    """Samples at 0, 1 and 3 s (10%, 50%, 0% of 1000 blocks) over a 4 s run hold 1, 2 and 1 s."""
    trace = make_trace([0.0])
    result = dataclasses.replace(
        make_result([F], first=[1.0], finish=[4.0], generated=[10]),
        series_t=np.array([0.0, 1.0, 3.0]), series_kv_blocks=np.array([100, 500, 0]),
        series_running=np.array([1, 1, 1]), series_waiting=np.array([0, 0, 0]))
    rep = score(result, trace, SLOSet())
    assert rep.kv_mean_fraction == pytest.approx((0.1 * 1 + 0.5 * 2 + 0.0 * 1) / 4)
    assert (rep.kv_p50_fraction, rep.kv_p95_fraction) == (0.1, 0.5)
    assert rep.mean_in_system == 1.0 and rep.littles_law_lw == 1.0 and rep.littles_law_gap == 0.0


def test_new_figures_are_in_the_dict_and_the_table():
    trace, result = two_tenants([1.0, 1.0])
    rep = score(dataclasses.replace(result, prefill_time_saved_s=0.125, migrations=3, handoffs=0), trace, SLOSet())
    data = rep.to_dict()
    assert data["prefill_time_saved_s"] == 0.125 and data["migrations"] == 3 and data["n_truncated"] == 0
    assert data["p99_step_ms"] is None and data["goodput_windows"] == [1.0]  # no histogram: NaN -> None
    labels = {label: value for _, label, value in rep.summary_rows()}
    assert labels["prefill time saved by the cache (s)"] == "0.125"
    assert labels["migrations / P/D hand-offs"] == "3 / 0"
    assert labels["arrival / run window (s)"] == "1.0 / 2.0"
    assert "LoRA loads (from disk) / time they cost (s)" not in labels  # no adapter loaded: no row
    assert (data["adapter_loads"], data["adapter_disk_loads"], data["adapter_load_s"]) == (0, 0, 0.0)


def test_adapter_loads_and_their_time_are_in_the_dict_and_the_table():
    trace, result = two_tenants([1.0, 1.0])
    rep = score(dataclasses.replace(result, adapter_loads=7, adapter_disk_loads=3, adapter_load_s=0.0625), trace,
                SLOSet())
    data = rep.to_dict()
    assert (data["adapter_loads"], data["adapter_disk_loads"], data["adapter_load_s"]) == (7, 3, 0.0625)
    labels = {label: value for _, label, value in rep.summary_rows()}
    assert labels["LoRA loads (from disk) / time they cost (s)"] == "7 (3) / 0.062"


# -- simulated runs --------------------------------------------------------------------------
def test_offered_load_is_the_same_under_every_policy():
    """One trace under four policies: the run windows differ, offered load does not, and
    accepted + rejected = offered on the arrival window."""
    trace = poisson_trace(400, rate=60.0, seed=2)
    base = PolicyConfig(gpu_memory_utilization=1.0)
    configs = [base, base.replace(schedule_mode="prefill_first", admission_mode="new_token_ratio"),
               base.replace(max_num_seqs=2), base.replace(max_num_seqs=4, max_queue_len=8)]
    reports = [score(r, trace, SLOSet()) for r in simulate_many(trace, cost_model(20000), configs)]
    span = trace.arrival_s[-1] - trace.arrival_s[0]
    assert {rep.offered_rps for rep in reports} == {trace.n / span}
    assert len({rep.duration_s for rep in reports}) == len(configs)
    assert reports[-1].n_rejected > 0
    for rep in reports:
        assert rep.accepted_rps == pytest.approx(rep.offered_rps * (1 - rep.rejected_fraction))


def test_truncations_count_requests_a_cap_ended_before_their_true_length():
    """0 is cut by max_tokens (10 of 50), 4 by the model length (1100 - 1000 = 100 of 500);
    1 stops exactly at max_tokens = its length, 2 and 3 under their caps."""
    trace = engine_trace([0.0, 0.01, 0.02, 0.03, 0.04], [100, 100, 100, 100, 1000], [50, 20, 30, 5, 500],
                         max_tokens=[10, 20, 40, 5, 4096])
    result = simulate(trace, cost_model(8192), PolicyConfig(gpu_memory_utilization=1.0, max_model_len=1100))
    assert result.tokens_generated.tolist() == [10, 20, 30, 5, 100]
    assert score(result, trace, SLOSet()).n_truncated == 2


def test_prefill_time_saved_is_the_simulators():
    rng = np.random.default_rng(3)
    n = 60
    hashes = [[int(rng.integers(0, 3)), 100 + i] for i in range(n)]
    trace = engine_trace(np.cumsum(rng.exponential(0.05, n)), np.full(n, 64), rng.integers(5, 40, n),
                         hashes=hashes, block_tokens=32)
    result = simulate(trace, cost_model(8192), PolicyConfig(gpu_memory_utilization=1.0, enable_prefix_caching=True,
                                                            block_size=16))
    assert result.prefill_time_saved_s > 0
    assert score(result, trace, SLOSet()).prefill_time_saved_s == result.prefill_time_saved_s


LITTLE_TOLERANCE = 0.03


def test_littles_law_holds_on_a_steady_trace():
    """A steady Poisson load, finely sampled: the time-average number in system matches
    lambda W within LITTLE_TOLERANCE (the series misses only the moments before admission)."""
    trace = poisson_trace(600, rate=25.0, seed=4)
    result = simulate(trace, cost_model(20000), PolicyConfig(gpu_memory_utilization=1.0), series_every_s=0.01)
    rep = score(result, trace, parse_slo("ttft:2000"))
    assert rep.mean_in_system > 1.0  # requests overlap: the check is not trivial
    assert abs(rep.littles_law_gap) <= LITTLE_TOLERANCE
    assert rep.mean_in_system == pytest.approx(rep.littles_law_lw, rel=LITTLE_TOLERANCE)
