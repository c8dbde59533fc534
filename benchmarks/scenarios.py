"""The scenario matrix: every scenario of ``studies.scenarios`` under the same policies.

Each scenario's seeded trace is replayed under FIFO without batching (vLLM defaults with
``max_num_seqs = 1``), vLLM defaults, SGLang defaults, the scenario's own extra policies
and a tuned policy (``servetune``'s Optuna study, with baselines enqueued first, over the
default search space with a small trial budget, on the same trace): a what-if, since that
space holds servetune's own policies (``benchmarks/deployable.py`` has the engines' files). Prints a markdown
table per scenario and writes ``scenarios.md`` and ``scenarios.json`` to ``--out``.
Scenarios whose knobs the engine lacks, or that need features it lacks, are listed as
pending, never approximated. Deterministic for a seed.

A fleet scenario (``replicas`` > 1 or ``failures``) runs every policy through the fleet
kernel, the standard ones behind the scenario's router, the tuned one behind the router
its study chose (the study searches the router, under the same failures). With failures,
the tables add requests re-routed, re-prefill tokens and goodput during and after the
failures, and a reference row: vLLM defaults on the same fleet without the failure, its
goodput "during" and "after" measured over the same windows.

A scenario with a drafter (``speculative``) runs its speculating policies and the tuned one
with the drafter's acceptance profile and draft cost, and its tables add the drafts
verified per decode and the tokens per verify.

    python benchmarks/scenarios.py [--quick] [--trials 30] [--only steady,bursty] [--scenarios FILE.toml]
    python benchmarks/scenarios.py --summarize benchmarks/results/scenarios.json

``--only`` reruns the named scenarios and replaces their entries in an existing
``scenarios.json`` in ``--out`` (the others are kept as they were), then rewrites both files.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import optuna  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.search.drafter import Drafter, DrafterError, drafter_from_mapping  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.failplan import FailurePlan  # noqa: E402
from optimizer.search.objective import objective_for  # noqa: E402
from optimizer.search.samplers import make_sampler  # noqa: E402
from optimizer.search.spec import StudySpec  # noqa: E402
from optimizer.search.study import (  # noqa: E402
    BOUNDS_ATTR,
    best_goodput_trial,
    enqueue_baselines,
    run,
)
from optimizer.search.targets import engine_context  # noqa: E402
from policies.config import KNOB_BY_NAME, ConfigError, PolicyConfig, inert_knobs  # noqa: E402
from policies.engine import simulate_many  # noqa: E402
from policies.engines import preset, target  # noqa: E402
from policies.failures import FailureError  # noqa: E402
from policies.fleet import simulate_fleet_many  # noqa: E402
from studies.metrics import score  # noqa: E402
from studies.scenarios import SCENARIOS, ScenarioError, build_trace, load_scenarios, scenario_slos  # noqa: E402

MODEL, GPU = "meta-llama/Llama-3.1-8B", "h100"
STANDARD = {"fifo-no-batching": {"base": "vllm-default", "set": {"max_num_seqs": 1}},
            "vllm-default": {"base": "vllm-default", "set": {}},
            "sglang-default": {"base": "sglang-default", "set": {}}}
COLUMNS = (  # (header, Report field or derived key, format)
    ("policy", "policy", "{}"), ("offered/s", "offered_rps", "{:.1f}"), ("accepted/s", "accepted_rps", "{:.1f}"),
    ("rejected", "rejected_fraction", "{:.1%}"), ("goodput/s", "request_goodput", "{:.2f}"),
    ("weighted/s", "weighted_goodput", "{:.2f}"), ("SLO met", "slo_attainment", "{:.1%}"),
    ("TTFT p50/p99 ms", ("p50_ttft_ms", "p99_ttft_ms"), "{:.0f} / {:.0f}"),
    ("TPOT p50/p99 ms", ("p50_tpot_ms", "p99_tpot_ms"), "{:.1f} / {:.1f}"),
    ("E2E p50/p99 s", ("p50_e2el_ms", "p99_e2el_ms"), "{:.1f} / {:.1f}"),
    ("queue p50/p99 s", ("p50_queue_ms", "p99_queue_ms"), "{:.2f} / {:.2f}"),
    ("KV peak", "kv_peak_fraction", "{:.0%}"), ("preempt", "preemptions", "{:,}"),
    ("cache saved tok", "prefix_tokens_saved", "{:,}"), ("tenant shares", "tenant_shares", "{}"),
)
#: Columns a scenario with a drafter adds.
SPECULATIVE_COLUMNS = (("drafts verified / decode", "mean_verify_budget", "{:.2f}"),
                       ("tokens / verify", "mean_accepted_length", "{:.2f}"))
#: Columns a scenario whose trace asks for LoRA adapters adds.
ADAPTER_COLUMNS = (("adapter loads (disk)", ("adapter_loads", "adapter_disk_loads"), "{:,} ({:,})"),
                   ("adapter load s", "adapter_load_s", "{:.2f}"))
FAILURE_COLUMNS = (("re-routed", "failure_affected", "{:,}"), ("re-prefill tok", "reprefill_tokens", "{:,}"),
                   ("goodput during / after failure /s", ("goodput_during_failures", "goodput_after_failures"),
                    "{:.2f} / {:.2f}"))
SECONDS = {"p50_e2el_ms", "p99_e2el_ms", "p50_queue_ms", "p99_queue_ms"}
#: The fleet reference row of a scenario with failures: vLLM defaults without them.
NO_FAILURE = "vllm-default, no failure"


def drafter_of(name: str, data: dict[str, Any]) -> Drafter | None:
    """The scenario's drafter (``speculative``), or None; errors name the scenario."""
    if "speculative" not in data:
        return None
    try:
        return drafter_from_mapping(data["speculative"], f"scenario {name!r} speculative")
    except DrafterError as exc:
        raise ScenarioError(str(exc)) from None


def policies_for(data: dict[str, Any], drafter: Drafter | None = None
                 ) -> tuple[dict[str, PolicyConfig], dict[str, str]]:
    """(name -> config) for the standard and the scenario's policies, and (name -> why pending).

    Every policy sits behind the scenario's router unless it sets its own; one that
    speculates runs ``drafter`` at its longest draft unless it sets its own, as its engine
    resolves a file with a drafter (``Target.with_drafter``)."""
    configs, pending = {}, {}
    routed = {"router": data["router"]} if "router" in data else {}
    for name, body in {**STANDARD, **data.get("policies", {})}.items():
        knobs = body.get("set", {})
        missing = sorted(set(knobs) - set(KNOB_BY_NAME))
        if missing:
            pending[name] = f"needs knob(s) {missing}, not in this engine yet"
            continue
        base = body.get("base", "vllm-default")
        try:
            config = preset(base, engine_context(MODEL, GPU))
            if knobs.get("speculative_mode", "off") != "off":
                if drafter is None:
                    raise ScenarioError(f"policy {name!r} speculates, but the scenario declares no drafter "
                                        "(speculative)")
                config = target(base.removesuffix("-default")).with_drafter(config).replace(
                    **drafter.config_values(), num_speculative_tokens=drafter.max_draft_tokens)
            configs[name] = config.replace(**{**routed, **knobs})
        except ConfigError as exc:  # e.g. a queue order this engine does not have yet
            pending[name] = f"not runnable on this engine yet ({exc})"
    return configs, pending


def failure_plan(name: str, data: dict[str, Any]) -> FailurePlan | None:
    """The scenario's failures, parsed and checked against its replicas; errors name the scenario."""
    if "failures" not in data:
        return None
    try:
        plan = FailurePlan.from_mapping(data["failures"], f"scenario {name!r} failures")
    except FailureError as exc:
        raise ScenarioError(str(exc)) from None
    replicas = int(data.get("replicas", 1))
    if plan.highest_replica >= replicas:
        raise ScenarioError(f"scenario {name!r} failures: a window names replica {plan.highest_replica}, but the "
                            f"scenario has {replicas} replica(s)")
    return plan


def tune(name: str, trace, cost, slos, trials: int, seed: int, replicas: int = 1,
         failures: FailurePlan | None = None, drafter: Drafter | None = None) -> tuple[PolicyConfig, dict[str, Any]]:
    """The best feasible config of a ``trials``-trial study on this trace (baselines included),
    on the scenario's fleet and under its failures, searching ``drafter``'s verify budgets."""
    spec = StudySpec(trace=Path(f"scenario-{name}"), model=MODEL, gpu=GPU, slos=slos, trials=trials, seed=seed,
                     batch_size=2, replicas=replicas, failures=failures, adapters=len(set(trace.adapter_labels) - {""}),
                     speculative=drafter)
    evaluator = Evaluator(spec, trace=trace, cost_model=cost)
    study = optuna.create_study(directions=list(objective_for(spec).directions), sampler=make_sampler(spec, seed))
    enqueue_baselines(study, spec, evaluator.baselines())
    stats = run(study, spec, evaluator)
    best = best_goodput_trial(study)
    config = PolicyConfig.from_mapping(best.user_attrs["config"])
    base = preset("vllm-default", engine_context(MODEL, GPU)).to_dict()
    inert = inert_knobs(config, replicas)  # knobs that change nothing under the config are no change
    changed = {k: v for k, v in config.to_dict().items() if v != base[k] and k not in inert}
    return config, {"trials": stats.told, "best_trial": best.number, "baseline": best.user_attrs.get("baseline"),
                    "router": config.router, "changed_vs_vllm_default": changed,
                    "bounds": study.user_attrs.get(BOUNDS_ATTR)}


def run_scenario(name: str, data: dict[str, Any], cost, *, trials: int, seed: int = 0) -> dict[str, Any]:
    """Every policy on the scenario's trace: a JSON-ready dict of per-policy reports."""
    out: dict[str, Any] = {"scenario": name, "about": data.get("about", ""), "policies": {}, "pending": {}}
    if "pending" in data:
        out["pending"]["*"] = data["pending"]
        return out
    missing = sorted(set(data.get("requires", [])) - set(KNOB_BY_NAME))
    if missing:
        out["pending"]["*"] = f"needs knob(s) {missing}, not in this engine yet"
        return out
    trace, slos = build_trace(name, data), scenario_slos(name, data)
    replicas, plan, drafter = int(data.get("replicas", 1)), failure_plan(name, data), drafter_of(name, data)
    acceptance = None if drafter is None else drafter.acceptance
    configs, out["pending"] = policies_for(data, drafter)
    if drafter is not None:
        out["speculative"] = drafter.to_dict()
    if trace.has_adapters:  # the engines serve a trace's adapters with LoRA on (each at its defaults)
        configs = {policy: config.replace(enable_lora=True) for policy, config in configs.items()}
    if trials > 0:
        configs["tuned"], out["tuning"] = tune(name, trace, cost, slos, trials, seed, replicas, plan, drafter)
    out["requests"] = trace.n
    if replicas > 1 or plan is not None:
        out["fleet"] = {"replicas": replicas, "router": data.get("router", "round_robin"),
                        "failures": None if plan is None else plan.to_dict()}
        failures = None if plan is None else plan.schedule(replicas, trace.arrival_s, seed)
        results = simulate_fleet_many(trace, cost, list(configs.values()), seed=seed, replicas=replicas,
                                      failures=failures, acceptance=acceptance)
        if failures is not None:
            healthy = simulate_fleet_many(trace, cost, [configs["vllm-default"]], seed=seed, replicas=replicas)[0]
            same_windows = dataclasses.replace(healthy, failure_replica=failures.replica.astype(np.int32),
                                               failure_down_s=failures.t_down, failure_up_s=failures.t_up)
            out["reference"] = {NO_FAILURE: _report(same_windows, trace, slos)}
    else:
        results = simulate_many(trace, cost, list(configs.values()), seed=seed, acceptance=acceptance)
    for policy, result in zip(configs, results, strict=True):
        out["policies"][policy] = _report(result, trace, slos)
    return out


def _report(result, trace, slos) -> dict[str, Any]:
    report = score(result, trace, slos).to_dict()
    report["tenant_shares"] = ", ".join(f"{t} {v['share']:.0%}" for t, v in report["per_tenant"].items()
                                        if v["share"] is not None) if len(report["per_tenant"]) > 1 else "-"
    return report


def _cell(report: dict[str, Any], key, fmt: str) -> str:
    keys = key if isinstance(key, tuple) else (key,)
    values = [report.get(k) for k in keys]
    if any(v is None for v in values):
        return "-"
    values = [v / 1e3 if k in SECONDS else v for k, v in zip(keys, values, strict=True)]
    return fmt.format(*values)


def markdown(result: dict[str, Any]) -> str:
    lines = [f"### {result['scenario']}", "", result["about"], ""]
    if "*" in result["pending"]:
        return "\n".join(lines + [f"*Pending: {result['pending']['*']}.*", ""])
    fleet = result.get("fleet")
    lines.append(f"{result['requests']:,} requests"
                 + ("" if fleet is None else f" on {fleet['replicas']} replicas behind {fleet['router']} (the standard "
                                             f"policies), failures {fleet['failures']}") + ".")
    if "tuning" in result:
        t = result["tuning"]
        changed = ", ".join(f"{k}={v}" for k, v in t["changed_vs_vllm_default"].items()) or "none"
        lines.append(f"Tuned: best of {t['trials']} trials (trial {t['best_trial']}"
                     f"{', a baseline: ' + t['baseline'] if t['baseline'] else ''}); vs vLLM defaults: {changed}.")
        if t.get("bounds"):
            ttft = t["bounds"]["p99_ttft_ms"]
            lines.append(f"Every trial was held to rejecting at most {t['bounds']['rejected_fraction']:.1%} and a "
                         f"p99 TTFT of {'no bound' if ttft is None else f'{ttft:,.0f} ms'} (the study's bounds).")
        if fleet is not None:
            lines.append(f"The tuned policy routes with {t['router']}.")
    columns = (COLUMNS + (FAILURE_COLUMNS if "reference" in result else ())
               + (SPECULATIVE_COLUMNS if "speculative" in result else ())
               # entries measured before adapters existed carry no adapter figures: they loaded none
               + (ADAPTER_COLUMNS if any(r.get("adapter_loads") for r in result["policies"].values()) else ()))
    lines += ["", "| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for policy, report in {**result["policies"], **result.get("reference", {})}.items():
        cells = [policy] + [_cell(report, key, fmt) for _, key, fmt in columns[1:]]
        lines.append("| " + " | ".join(cells) + " |")
    if "reference" in result:
        lines.append(f"\n*{NO_FAILURE}: the same fleet and traffic without the failure; its goodput during and "
                     "after is measured over the same windows.*")
    lines += [f"\n*Pending policy {p}: {why}.*" for p, why in result["pending"].items()]
    return "\n".join(lines + [""])


def summary(results: list[dict[str, Any]]) -> str:
    """One row per scenario: each standard policy's goodput (SLO attainment, p99 TTFT), the
    tuned one's gain over the best default, and the best extra policy; the p99 TTFT shows
    whether a goodput was bought with a starved tail."""
    names = [*STANDARD, "tuned"]
    lines = ["| scenario | " + " | ".join(names) + " | tuned / best default | best other policy |",
             "|---|" + "---|" * (len(names) + 2)]
    for r in results:
        if "*" in r["pending"]:
            lines.append(f"| {r['scenario']} | " + " | ".join("-" for _ in names) + f" | - | pending: {r['pending']['*']} |")
            continue
        p = r["policies"]
        cells = [_summary_cell(p[n]) if n in p else "-" for n in names]
        best_default = max(p[n]["weighted_goodput"] for n in STANDARD)
        gain = f"{p['tuned']['weighted_goodput'] / best_default:.2f}x" if "tuned" in p and best_default > 0 else "-"
        extras = {n: v for n, v in p.items() if n not in names}
        other = max(extras, key=lambda n: extras[n]["weighted_goodput"], default=None)
        best = f"{other} {_summary_cell(extras[other])}" if other else "-"
        lines.append(f"| {r['scenario']} | " + " | ".join(cells) + f" | {gain} | {best} |")
    return "\n".join(lines)


def _summary_cell(report: dict[str, Any]) -> str:
    p99 = report.get("p99_ttft_ms")
    tail = "no TTFT" if p99 is None else f"p99 TTFT {p99 / 1000:,.1f} s"
    return f"{report['weighted_goodput']:.2f} ({report['slo_attainment']:.0%}, {tail})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30, help="tuner budget per scenario (0 = no tuned policy)")
    parser.add_argument("--quick", action="store_true", help="12 trials per scenario")
    parser.add_argument("--only", default="", help="comma-separated scenario names")
    parser.add_argument("--scenarios", type=Path, default=None, help="TOML file of scenarios instead of the built-in ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--summarize", type=Path, default=None, help="print the summary of a saved scenarios.json")
    args = parser.parse_args()
    if args.summarize:
        print(summary(json.loads(args.summarize.read_text())))
        return
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        scenarios = load_scenarios(args.scenarios) if args.scenarios else SCENARIOS
    except ScenarioError as exc:
        sys.exit(str(exc))
    if args.only:
        unknown = sorted(set(args.only.split(",")) - set(scenarios))
        if unknown:
            sys.exit(f"unknown scenario(s) {unknown}; known: {sorted(scenarios)}")
        scenarios = {k: v for k, v in scenarios.items() if k in args.only.split(",")}
    trials = 12 if args.quick else args.trials
    cost = build(MODEL, GPU)
    header = (f"# Scenario matrix\n\n{cost.name} ({cost.source}); seed {args.seed}; tuned = best of "
              f"{trials} trials per scenario. Command: `python benchmarks/scenarios.py"
              f"{' --quick' if args.quick else ''}`\n")
    print(header)
    saved = args.out / "scenarios.json"
    results = {r["scenario"]: r for r in json.loads(saved.read_text())} if args.only and saved.exists() else {}
    for name, data in scenarios.items():
        t0 = time.perf_counter()
        try:
            results[name] = run_scenario(name, data, cost, trials=trials, seed=args.seed)
        except ScenarioError as exc:  # reported in its row; the other scenarios still run
            results[name] = {"scenario": name, "about": data.get("about", ""), "policies": {},
                             "pending": {"*": f"cannot run: {exc}"}}
        print(markdown(results[name]))
        print(f"({time.perf_counter() - t0:.1f} s)\n", flush=True)
    results = list(results.values())
    table = ("Weighted goodput per second (SLO attainment, p99 TTFT of finished requests); details per scenario "
             "below.\n\n" + summary(results) + "\n")
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scenarios.json").write_text(json.dumps(results, indent=1) + "\n")  # first: the runs are dear
    sections = [header, table, *(markdown(r) for r in results)]
    (args.out / "scenarios.md").write_text("\n".join(sections))
    print(f"wrote {args.out / 'scenarios.md'} and {args.out / 'scenarios.json'}")


if __name__ == "__main__":
    main()
