"""Capacity review: the limit diagnosis, the GPU count and the rendered documents."""

from __future__ import annotations

import math
from html.parser import HTMLParser

import numpy as np
import pytest

from optimizer.outputs.exports import Deployment
from optimizer.outputs.review import (
    Capacity,
    ConfigFigures,
    LoadSignals,
    ReviewInputs,
    build_review,
    diagnose,
    gain_ratio,
    to_html,
    to_markdown,
    write_review,
)
from optimizer.robust.answer import Sizing
from optimizer.robust.fleetsize import FleetSize
from policies.engines import EngineContext
from policies.engines import preset as engine_preset
from policies.result import SimResult
from studies.slo import parse_slo


def preset(name):
    return engine_preset(name, EngineContext("h100", 80.0))


def _signals(busy=0.5, kv=0.5, preempt=0.0, kv_rejects=0.0, queue=0.1) -> LoadSignals:
    return LoadSignals(busy, kv, preempt, kv_rejects, queue)


@pytest.mark.parametrize(("signals", "limit"), [
    (_signals(busy=0.95), "compute"),
    (_signals(busy=0.95, queue=0.9), "compute"),  # queueing caused by a saturated GPU
    (_signals(kv=0.99, preempt=0.2), "kv"),
    (_signals(busy=0.97, kv=0.99, preempt=0.2), "kv"),  # recompute inflates busy time
    (_signals(kv=0.6, kv_rejects=0.05), "kv"),
    (_signals(kv=0.99, queue=0.8), "kv"),  # waiting for memory
    (_signals(kv=0.3, queue=0.8), "queueing"),
    (_signals(), "none"),
    (_signals(busy=math.nan, kv=math.nan, preempt=math.nan, kv_rejects=math.nan, queue=math.nan), "none"),
])
def test_diagnosis_names_the_limiting_resource(signals, limit):
    d = diagnose(signals)
    assert d.limit == limit
    assert {"kv": "KV-bound", "compute": "Compute-bound", "queueing": "Queueing-bound",
            "none": "Not saturated"}[limit] in d.summary
    assert len(d.evidence) == 5


def _result(busy_s: float, replicas: int = 1) -> SimResult:
    empty = np.zeros(0)
    replica = np.array([-1, *range(replicas)])  # -1: a request no replica finished
    return SimResult(state=empty, reject_reason=empty, first_token_s=empty, finish_s=empty,
                     tokens_generated=empty, preemptions=empty, cached_prompt_tokens=empty, queue_s=empty,
                     replica=replica, steps=10, busy_s=busy_s, prefill_tokens_computed=0, out_of_range_steps=0,
                     kv_capacity_blocks=100, kv_peak_blocks=50, series_t=empty, series_kv_blocks=empty,
                     series_running=empty, series_waiting=empty)


def test_load_signals_from_a_run_and_its_report():
    report = {"duration_s": 100.0, "n_offered": 1000, "kv_peak_fraction": 0.97, "preemption_rate": 0.02,
              "reject_reasons": {"kv_high_water": 30, "queue_full": 50, "exceeds_capacity": 10},
              "mean_queue_ms": 300.0, "mean_ttft_ms": 400.0}
    s = LoadSignals.of(_result(busy_s=180.0, replicas=2), report)
    assert s.busy_fraction == pytest.approx(0.9)
    assert s.kv_reject_fraction == pytest.approx(0.04)  # queue_full is not a memory reject
    assert s.queue_share == pytest.approx(0.75)
    assert diagnose(s).limit == "kv"
    empty = LoadSignals.of(_result(0.0), {"duration_s": 0.0, "n_offered": 0, "kv_peak_fraction": None,
                                          "preemption_rate": None, "mean_queue_ms": None, "mean_ttft_ms": None})
    assert math.isnan(empty.busy_fraction) and math.isnan(empty.queue_share)


def _sized(tuning: int | None, held: int | None = None, tp: int = 1):
    def size(n):
        return FleetSize(n, tp, 0.9, 64, () if n is None else ((n, 0.93, 5.0),))

    return Sizing(size(tuning), None if held is None else size(held))


def test_capacity_gpus_come_from_the_fleet_sizing_never_from_scaling_the_rate():
    deploy = dict(replicas=4, tp=2)
    over = Capacity(max_rate_scale=0.8, trace_rps=10.0, **deploy)
    assert over.max_rps == pytest.approx(8.0) and over.headroom == pytest.approx(-0.2)
    assert over.replicas_needed is None and over.gpus_needed is None  # not sized: no extrapolated count
    pooled = Capacity(max_rate_scale=0.8, trace_rps=10.0, sized=_sized(3, 4, tp=2), **deploy)
    assert pooled.replicas_needed == 4 and pooled.gpus_needed == 8  # the larger of tuning and held-out parts
    assert pooled.sized.sized_on == "held-out part"
    unreachable = Capacity(max_rate_scale=0.0, trace_rps=10.0, sized=_sized(2, None, tp=2), **deploy)
    assert unreachable.gpus_needed == 4  # a rate search that fails at every scale does not overrule the fleet
    assert Capacity(0.5, 10.0, sized=_sized(None, 2)).gpus_needed is None  # out of reach on one part wins


def test_gain_ratio():
    assert gain_ratio(3.0, 2.0) == pytest.approx(0.5)
    assert gain_ratio(1.0, 0.0) is None and gain_ratio(math.nan, 1.0) is None


def _inputs(**changes) -> ReviewInputs:
    deploy = Deployment("meta-llama/Llama-3.1-8B", tp=1, replicas=2, gpu="h100")
    best_cfg = preset("vllm-default").replace(max_num_batched_tokens=2048, max_num_seqs=128)
    report = {"weighted_goodput": 6.0, "request_goodput": 6.0, "slo_attainment": 0.95, "p99_ttft_ms": 900.0,
              "p99_tpot_ms": 60.0, "rejected_fraction": 0.0, "kv_peak_fraction": 0.5, "preemption_rate": 0.0,
              "kv_mean_fraction": 0.25, "p99_step_ms": 41.5, "goodput_window_min": 4.5, "prefill_time_saved_s": None}
    best = ConfigFigures("best (trial 17)", best_cfg, report,
                         Capacity(1.5, 6.3, replicas=2, sized=_sized(2)), diagnose(_signals(busy=0.95)), trial=17)
    vllm = ConfigFigures("vllm-default", preset("vllm-default"), {**report, "weighted_goodput": 4.0},
                         Capacity(0.7, 6.3, replicas=2, sized=_sized(3, 2)), diagnose(_signals(kv=0.99, preempt=0.3)))
    sglang = ConfigFigures("sglang-default", preset("sglang-default"), {**report, "weighted_goodput": 0.0})
    values = dict(title="Capacity review: chat", deployment=deploy, slos=parse_slo("ttft:2000,tpot:100"),
                  target_attainment=0.9, trace_description="azure conv, 19366 requests at 6.3 req/s",
                  best=best, baselines=(vllm, sglang), objectives=(("weighted_goodput", 6.0, "maximize"),),
                  plots={"Pareto front": "plots/pareto.png"}, notes=("a | note",))
    values.update(changes)
    return ReviewInputs(**values)


def test_review_states_gpus_headroom_limit_and_gains():
    md = to_markdown(build_review(_inputs()))
    assert md.startswith("# Capacity review: chat\n")
    assert "this traffic needs 2 GPU(s) (2 replica(s) x TP 1)" in md
    assert "it has 50% headroom" in md
    assert "| vllm-default | 4.410 | -30% | 3 (3 x TP 1), range 2-3 replicas | 3 (93.0%) / 2 (93.0%) | kv |" in md
    assert "Compute-bound" in md.split("## What limits the best config")[1].split("##")[0]
    assert "Weighted goodput +50.0% over vllm-default (6.000 vs 4.000/s)." in md
    assert "sglang-default has no goodput on this trace" in md
    assert "| KV mean level | 25.0% | 25.0% | 25.0% |" in md and "| p99 step time (ms) | 41.5 |" in md
    assert "| worst-window goodput (req/s) | 4.500 |" in md
    assert "| prefill time saved by the prefix cache (s) | n/a |" in md  # an older report without the figure
    assert "| max_num_batched_tokens | 2048 | 8192 | 8192 |" in md  # changed knobs only
    assert "| block_size |" in md and "| kv_headroom |" not in md  # sglang pages differ; headroom never
    assert "![Pareto front](plots/pareto.png)" in md
    assert "a \\| note" not in md and "- a | note" in md  # list items are not table cells


def test_review_reports_over_capacity_and_unreachable_targets():
    base = _inputs()
    over = ConfigFigures(base.best.name, base.best.config, base.best.report,
                         Capacity(0.5, 6.3, replicas=2, sized=_sized(3, 4)), base.best.diagnosis)
    md = to_markdown(build_review(_inputs(best=over)))
    assert "needs 4 GPU(s)" in md and "sized on the held-out part" in md
    assert "over capacity" in md and "50% below the trace rate" in md
    never = ConfigFigures(base.best.name, base.best.config, base.best.report,
                          Capacity(0.0, 6.3, replicas=2, sized=_sized(None)), None)
    md = to_markdown(build_review(_inputs(best=never)))
    assert "does not reach 90% SLO attainment with up to 64 simulated replicas" in md and "No load signals" in md


class _Collect(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.text: list[str] = []
        self.imgs: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.imgs.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def test_html_carries_the_same_content_escaped(tmp_path):
    inputs = _inputs(title="Review <chat> & co")
    page = to_html(build_review(inputs))
    parser = _Collect()
    parser.feed(page)
    assert parser.tags.count("table") == 3 and parser.imgs == ["plots/pareto.png"]
    text = "".join(parser.text)
    assert "Review <chat> & co" in text and "<chat>" not in page.replace("&lt;chat&gt;", "")
    assert "this traffic needs 2 GPU(s)" in text
    md, html_path = write_review(tmp_path, inputs)
    assert md.name == "capacity-review.md" and html_path.name == "capacity-review.html"
    assert "Compute-bound" in md.read_text() and "Compute-bound" in html_path.read_text()


def test_review_leads_with_what_to_deploy():
    lines = ("Deploy vllm.yaml: 1 knob changed: max-num-batched-tokens 2048", "GPUs: 2 = 2 replica(s) x 1 GPU(s)")
    md = to_markdown(build_review(_inputs(answer=lines)))
    section = md.split("## What to deploy")[1].split("##")[0]
    assert "- Deploy vllm.yaml: 1 knob changed: max-num-batched-tokens 2048" in section
    assert md.index("## What to deploy") < md.index("## How many GPUs")
    assert "## What to deploy" not in to_markdown(build_review(_inputs()))
