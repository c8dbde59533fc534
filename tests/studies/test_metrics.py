"""The goodput report follows vllm bench serve --goodput, request by request.

Results are built by hand so each rule is exercised by a request designed for it. Times are
dyadic fractions, so latencies in ms are exact and bounds can be hit exactly.
"""

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.result import Reject, SimResult, State
from studies.metrics import Report, good_requests, request_latencies, score
from studies.slo import SLOClass, SLOError, SLOSet, parse_slo
from studies.traces import Trace

F, R, T, C, X = State.FINISHED, State.REJECTED, State.TIMED_OUT, State.CANCELLED, State.FAILED
NAN = math.nan


def make_trace(arrival, prompt=None, tenant=None, slo_class=None, tenant_names=("default",),
               slo_class_names=("default",)):
    n = len(arrival)
    return Trace(
        arrival_s=np.asarray(arrival, float),
        prompt_tokens=np.asarray(prompt if prompt is not None else [100] * n),
        output_tokens=np.full(n, 10),
        max_tokens=np.full(n, 4096),
        tenant=np.asarray(tenant if tenant is not None else [0] * n),
        priority=np.zeros(n),
        slo_class=np.asarray(slo_class if slo_class is not None else [0] * n),
        deadline_s=np.full(n, NAN),
        block_offsets=np.zeros(n + 1),
        block_hashes=np.zeros(0),
        tenant_names=tenant_names,
        slo_class_names=slo_class_names,
    )


def make_result(state, first, finish, generated, reason=None, preemptions=None, cached=None,
                queue=None, out_of_range_steps=0, kv_capacity_blocks=1000, kv_peak_blocks=500):
    n = len(state)
    state = np.asarray(state, np.int8)
    if reason is None:
        reason = np.where(state == R, Reject.QUEUE_FULL, Reject.NONE)
    first = np.asarray(first, float)
    return SimResult(
        state=state,
        reject_reason=np.asarray(reason, np.int8),
        first_token_s=first,
        finish_s=np.asarray(finish, float),
        tokens_generated=np.asarray(generated, np.int64),
        preemptions=np.asarray(preemptions if preemptions is not None else [0] * n, np.int32),
        cached_prompt_tokens=np.asarray(cached if cached is not None else [0] * n, np.int64),
        queue_s=np.asarray(queue if queue is not None else np.where(np.isfinite(first), 0.0, NAN), float),
        replica=np.zeros(n, np.int32),
        steps=10,
        busy_s=1.0,
        prefill_tokens_computed=0,
        out_of_range_steps=out_of_range_steps,
        kv_capacity_blocks=kv_capacity_blocks,
        kv_peak_blocks=kv_peak_blocks,
        series_t=np.zeros(0),
        series_kv_blocks=np.zeros(0, np.int64),
        series_running=np.zeros(0, np.int64),
        series_waiting=np.zeros(0, np.int64),
    )


# Seven requests, one per rule, against ttft:1000, tpot:100, e2el:5000 (ms).
#   0 finished, ttft 0.5 s, 11 tokens over 1 s after the first: tpot exactly 100 ms -> good
#   1 finished, ttft exactly 1 s, one token and a 3 s tail: tpot is 0 when n <= 1 -> good
#   2 finished, ttft 1.25 s (tpot fine) -> not good
#   3 finished, tpot 125 ms -> not good
#   4 rejected instantly -> never good
#   5 timed out with fast tokens -> never good
#   6 finished, e2el 5.25 s (ttft and tpot fine) -> not good
RULES_TRACE = make_trace([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0])
RULES_RESULT = make_result(
    state=[F, F, F, F, R, T, F],
    first=[0.5, 1.0, 1.75, 1.25, NAN, 2.25, 2.5],
    finish=[1.5, 4.0, 1.8125, 2.5, 1.0, 2.5, 7.25],
    generated=[11, 1, 2, 11, 0, 3, 96],
)
RULES_SLO = parse_slo("ttft:1000,tpot:100,e2el:5000")


def test_vllm_goodput_rules_request_by_request():
    assert good_requests(RULES_RESULT, RULES_TRACE, RULES_SLO).tolist() == [
        True, True, False, False, False, False, False]
    lat = request_latencies(RULES_RESULT, RULES_TRACE)
    assert lat["ttft"][0] == 500 and lat["tpot"][0] == 100 and lat["e2el"][0] == 1500
    assert lat["tpot"][1] == 0.0  # n = 1: no inter-token time, whatever E2E - TTFT is
    assert lat["ttft"][2] == 1250.0 and lat["tpot"][2] == 62.5
    assert lat["tpot"][3] == 125.0 and lat["tpot"][6] == 50.0 and lat["e2el"][6] == 5250.0


def test_report_counts_rates_and_window():
    rep = score(RULES_RESULT, RULES_TRACE, RULES_SLO)
    window = 7.25  # first arrival 0 to the last end time of any request
    assert (rep.n_offered, rep.n_accepted, rep.n_rejected) == (7, 6, 1)
    assert (rep.n_finished, rep.n_timed_out, rep.n_good) == (5, 1, 2)
    assert rep.duration_s == window
    assert rep.request_goodput == pytest.approx(2 / window)
    assert rep.token_goodput == pytest.approx((11 + 1) / window)
    assert rep.weighted_goodput == pytest.approx(2 / window)
    assert rep.request_throughput == pytest.approx(5 / window)
    assert rep.output_throughput == pytest.approx((11 + 1 + 2 + 11 + 96) / window)
    arrivals = 2.0  # offered and accepted load: first to last arrival
    assert rep.arrival_window_s == arrivals
    assert rep.offered_rps == pytest.approx(7 / arrivals)
    assert rep.offered_rps == pytest.approx(rep.accepted_rps + 1 / arrivals)
    assert rep.slo_attainment == pytest.approx(2 / 7)
    assert rep.rejected_fraction == pytest.approx(1 / 7)
    assert rep.reject_reasons == {"queue_full": 1}


def test_unset_bounds_are_not_checked():
    only_ttft = parse_slo("ttft:1000")
    assert good_requests(RULES_RESULT, RULES_TRACE, only_ttft).tolist() == [
        True, True, False, True, False, False, True]  # 3's slow tokens and 6's long E2E pass
    no_bounds = score(RULES_RESULT, RULES_TRACE, SLOSet())
    assert no_bounds.n_good == no_bounds.n_finished == 5


def test_latency_percentiles_over_finished_requests_only():
    rep = score(RULES_RESULT, RULES_TRACE, RULES_SLO)
    finished = [0, 1, 2, 3, 6]
    lat = request_latencies(RULES_RESULT, RULES_TRACE)
    for metric in ("ttft", "e2el", "queue"):
        values = lat[metric][finished]
        assert getattr(rep, f"mean_{metric}_ms") == pytest.approx(values.mean())
        for q in (50, 90, 99):
            assert getattr(rep, f"p{q}_{metric}_ms") == pytest.approx(np.percentile(values, q))
    tpots = lat["tpot"][[0, 2, 3, 6]]  # as vLLM bench: only requests with more than one token
    assert rep.p50_tpot_ms == pytest.approx(np.median(tpots))
    assert rep.mean_tpot_ms == pytest.approx(tpots.mean())


def test_nothing_finished_gives_nan_latencies_and_json_nulls():
    trace = make_trace([0.0, 1.0])
    result = make_result([R, C], [NAN, NAN], [0.0, 3.0], [0, 0],
                         reason=[Reject.KV_HIGH_WATER, Reject.NONE])
    rep = score(result, trace, RULES_SLO)
    assert rep.n_good == 0 and rep.request_goodput == 0.0 and rep.n_cancelled == 1
    assert math.isnan(rep.p99_ttft_ms) and math.isnan(rep.mean_tpot_ms)
    data = rep.to_dict()
    assert data["p99_ttft_ms"] is None and data["per_class"]["default"]["p99_e2el_ms"] is None
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN leaks through
    assert data["reject_reasons"] == {"kv_high_water": 1}


def test_weighted_goodput_per_class_and_default_fallback():
    slos = SLOSet((SLOClass("chat", ttft_ms=500, weight=2.0),
                   SLOClass("default", e2el_ms=60_000, weight=0.5)))
    # classes: 0 chat, 1 batch (not in the set: falls back to default)
    trace = make_trace([0.0, 0.0, 0.0, 0.0], slo_class=[0, 0, 1, 1],
                       slo_class_names=("chat", "batch"))
    result = make_result([F, F, F, R], [0.25, 0.75, 10.0, NAN], [1.0, 2.0, 8.0 * 8, 1.0], [4, 4, 4, 0])
    rep = score(result, trace, slos)
    window = 64.0
    assert good_requests(result, trace, slos).tolist() == [True, False, False, False]
    assert rep.weighted_goodput == pytest.approx(2.0 / window)
    chat, batch = rep.per_class["chat"], rep.per_class["batch"]
    assert (chat["offered"], chat["good"], chat["attainment"]) == (2, 1, 0.5)
    assert chat["request_goodput"] == pytest.approx(1 / window)
    assert chat["weighted_goodput"] == pytest.approx(2 / window)
    assert chat["p99_ttft_ms"] == pytest.approx(np.percentile([250.0, 750.0], 99))
    assert (batch["offered"], batch["good"]) == (2, 0)  # e2el 64 s > 60 s; the other is rejected
    assert batch["slo"] == "e2el:60000"


def test_unknown_class_without_default_is_an_error():
    slos = SLOSet((SLOClass("chat", ttft_ms=500),))
    trace = make_trace([0.0], slo_class_names=("batch",))
    with pytest.raises(SLOError, match="'batch' has no SLO"):
        score(make_result([F], [0.5], [1.0], [3]), trace, slos)


def test_memory_preemption_and_prefix_figures():
    trace = make_trace([0.0, 0.0, 0.0, 0.0], prompt=[1000, 1000, 2000, 500])
    result = make_result([F, F, R, F], [1.0, 1.0, NAN, 1.0], [2.0, 2.0, 0.0, 2.0], [5, 5, 0, 5],
                         preemptions=[2, 0, 0, 1], cached=[512, 0, 0, 488],
                         reason=[0, 0, Reject.EXCEEDS_CAPACITY, 0],
                         kv_capacity_blocks=800, kv_peak_blocks=600, out_of_range_steps=3)
    rep = score(result, trace, SLOSet())
    assert rep.kv_peak_fraction == 0.75
    assert rep.preemptions == 3 and rep.preemption_rate == 1.0  # per accepted request
    assert rep.prefix_tokens_saved == 1000
    assert rep.prefix_hit_rate == pytest.approx(1000 / 2500)  # prompts that were scheduled
    assert rep.out_of_range_steps == 3
    assert ("warning", "steps outside the profiled range", "3") in rep.summary_rows()
    assert rep.reject_reasons == {"exceeds_capacity": 1}


def test_per_tenant_service_and_jain_index():
    trace = make_trace([0.0, 0.0, 0.0, 0.0], prompt=[100, 100, 100, 100], tenant=[0, 0, 1, 1],
                       tenant_names=("a", "b", "idle"))
    # a: two finished (100 + 50 each = 300); b: one finished (150), one cancelled unserved
    result = make_result([F, F, F, C], [1.0, 1.0, 1.0, NAN], [2.0, 2.0, 2.0, 1.5], [50, 50, 50, 0])
    rep = score(result, trace, SLOSet())
    a, b, idle = rep.per_tenant["a"], rep.per_tenant["b"], rep.per_tenant["idle"]
    assert (a["offered"], a["finished"], a["good"], a["service_tokens"]) == (2, 2, 2, 300)
    assert (b["offered"], b["finished"], b["service_tokens"]) == (2, 1, 150)
    assert a["share"] == pytest.approx(2 / 3) and a["goodput"] == pytest.approx(2 / 2.0)
    assert idle["offered"] == 0 and idle["service_tokens"] == 0
    # Jain over tenants that offered load: (300 + 150)^2 / (2 * (300^2 + 150^2)) = 0.9
    assert rep.jain_index == pytest.approx(0.9)
    even = make_result([F, F, F, F], [1.0] * 4, [2.0] * 4, [50] * 4)
    assert score(even, trace, SLOSet()).jain_index == pytest.approx(1.0)


def test_timed_out_request_counts_partial_service():
    trace = make_trace([0.0], prompt=[300])
    rep = score(make_result([T], [0.5], [3.0], [7]), trace, SLOSet())
    assert rep.per_tenant["default"]["service_tokens"] == 307 and rep.n_good == 0


def test_empty_trace_scores_to_zero_rates():
    rep = score(make_result([], [], [], []), make_trace([]), RULES_SLO)
    assert rep.n_offered == 0 and rep.duration_s == 0.0 and rep.request_goodput == 0.0
    assert math.isnan(rep.slo_attainment) and math.isnan(rep.jain_index)


@pytest.mark.parametrize(
    "change, message",
    [(dict(state=[F, F]), "has 2 entries but the trace has 1"),
     (dict(state=[9]), "unknown state code 9"),
     (dict(state=[R], reason=[Reject.NONE]), "rejected without a reason"),
     (dict(reason=[42]), "unknown reject reason code 42"),
     (dict(finish=[NAN]), "finished but has no finish time")],
)
def test_result_that_breaks_the_contract_is_an_error(change, message):
    args = dict(state=[F], first=[0.5], finish=[1.0], generated=[2], reason=None)
    args.update(change)
    n = len(args["state"])
    for key in ("first", "finish", "generated"):
        args[key] = (args[key] * n)[:n]
    with pytest.raises(ValueError, match=message):
        score(make_result(**args), make_trace([0.0]), SLOSet())


def test_report_fields_are_the_contract():
    names = set(Report.__dataclass_fields__)
    for stat in ("mean", "p50", "p90", "p99"):
        for metric in ("ttft", "tpot", "e2el", "queue"):
            assert f"{stat}_{metric}_ms" in names
    assert {"request_goodput", "token_goodput", "weighted_goodput", "slo_attainment", "jain_index",
            "kv_peak_fraction", "preemption_rate", "prefix_hit_rate", "reject_reasons",
            "per_tenant", "per_class", "n_accepted", "offered_rps"} <= names
    data = score(RULES_RESULT, RULES_TRACE, RULES_SLO).to_dict()
    assert set(data) == names
    assert isinstance(data["n_good"], int) and isinstance(data["request_goodput"], float)


STATES = st.sampled_from([F, R, T, C, X])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(STATES, st.floats(0, 5), st.floats(0, 5), st.floats(0, 5),
                          st.integers(0, 50)), min_size=1, max_size=30),
       st.sampled_from(["ttft:1000", "tpot:50", "ttft:500,tpot:100,e2el:4000"]))
def test_invariants_on_random_results(rows, slo_text):
    rows.sort(key=lambda r: r[1])
    state = [r[0] for r in rows]
    arrival = [r[1] for r in rows]
    first = [a + r[2] if s in (F, T) else NAN for a, r, s in zip(arrival, rows, state, strict=True)]
    finish = [a + r[2] + r[3] for a, r in zip(arrival, rows, strict=True)]
    generated = [r[4] if s in (F, T) else 0 for r, s in zip(rows, state, strict=True)]
    rep = score(make_result(state, first, finish, generated), make_trace(arrival), parse_slo(slo_text))
    assert rep.n_offered == rep.n_accepted + rep.n_rejected
    assert rep.n_offered == (rep.n_finished + rep.n_rejected + rep.n_timed_out + rep.n_cancelled
                             + rep.n_failed)
    assert rep.n_good <= rep.n_finished
    assert rep.request_goodput <= rep.request_throughput + 1e-12
    assert rep.token_goodput <= rep.output_throughput + 1e-9
    assert 0.0 <= rep.slo_attainment <= 1.0
    assert sum(t["good"] for t in rep.per_tenant.values()) == rep.n_good
    assert sum(c["good"] for c in rep.per_class.values()) == rep.n_good
    if rep.n_finished:
        assert rep.p50_ttft_ms <= rep.p90_ttft_ms <= rep.p99_ttft_ms
    json.dumps(rep.to_dict(), allow_nan=False)
