"""Deployable gains: what each engine's exported file delivers, beside servetune's what-ifs.

For each study (the README sample, the Azure 2023 conversation trace at x1 and x4, and the
scenario matrix's single-replica scenarios) and each target (vLLM, SGLang, and servetune's
what-if policies), a study searches that target's space; its recommendation is written as
the file the CLI writes, the file is written to disk, read back from disk as the engine
runs it and simulated. Printed per target:

- reported: the gain ``servetune tune`` states (its ``summary.json``: the robust answer's file,
  ``optimizer.robust``, or the defaults kept when no gain holds);
- file: the gain of the file read back from disk in this script, simulated again; it must
  equal the reported gain (the script fails otherwise);
- held out: the same file's gain on the last quarter of the trace window, which the study
  never saw (tuned on the first three quarters), at its rate and +-20%.

Traces carry no output caps, so every client sends none and the engine caps at the
context less the prompt; SJF orders by that cap (predictor ``cap``): no true lengths.

    python benchmarks/deployable.py [--trials 40] [--only sample-x0.3,azure-conv-x4,bursty] [--out benchmarks/results]
    python benchmarks/deployable.py --targets sglang   # rerun one target, keep the others' results
    python benchmarks/deployable.py --summarize benchmarks/results/deployable.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import optuna  # noqa: E402
from tuned import tune  # noqa: E402

from optimizer.outputs.exports import read_engine_file  # noqa: E402
from optimizer.robust.choice import ratio  # noqa: E402
from optimizer.search.evaluate import split_holdout  # noqa: E402
from optimizer.search.space import Fleet  # noqa: E402
from policies.config import FLEET_KNOBS, PolicyConfig  # noqa: E402
from policies.engines import target  # noqa: E402
from studies.scenarios import SCENARIOS, build_trace, scenario_slos  # noqa: E402
from studies.slo import parse_slo  # noqa: E402
from studies.traces import load_trace, write_trace  # noqa: E402
from studies.transforms import scale_rate  # noqa: E402

SHARED = ROOT.parent / "shared" / "traces"
TARGETS = ("vllm", "sglang", "servetune")
HOLDOUT = 0.25
#: Single-replica scenarios of the matrix (fleet scenarios need the fleet kernel's routers per engine).
SCENARIO_NAMES = ("bursty", "preemption-storm", "saturation", "multi-tenant", "overload", "recovery", "steady")


#: A bursty code-completion workload (1.5k-token prompts, 40-token answers) at a load where
#: vLLM's defaults miss a tight TPOT bound: long prefill chunks stall the decodes.
CODE_COMPLETION = {"about": "code completion: bursty (gamma cv 4) 1.5k-token prompts, 40-token answers", "seed": 12,
                   "slo": {"default": {"ttft": 1000, "tpot": 50}},
                   "workload": {"duration_s": 300, "arrivals": {"kind": "gamma", "rate": 12, "cv": 4},
                                "tenants": [{"name": "code", "prompt": {"mean": 1500, "cv": 0.6},
                                             "output": {"mean": 40, "cv": 0.8}}]}}


def studies() -> dict[str, dict[str, Any]]:
    """name -> {trace loader, SLO}; the Azure studies only when ../shared has the trace."""
    out: dict[str, dict[str, Any]] = {
        "sample-x0.3": {"load": lambda: scale_rate(load_trace(ROOT / "studies/data/mooncake_conversation_300s.parquet"),
                                                   0.3),
                        "slo": parse_slo("ttft:2000,tpot:100")}}
    azure = SHARED / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
    if azure.is_file():
        for scale in (1, 4):
            out[f"azure-conv-x{scale}"] = {"load": lambda s=scale: scale_rate(load_trace(azure), float(s)),
                                           "slo": parse_slo("ttft:2000,tpot:100")}
    out["code-completion"] = {"load": lambda: build_trace("code-completion", CODE_COMPLETION),
                              "slo": scenario_slos("code-completion", CODE_COMPLETION)}
    for name in SCENARIO_NAMES:
        data = SCENARIOS[name]
        out[name] = {"load": lambda d=data, n=name: build_trace(n, d), "slo": scenario_slos(name, data)}
    return out


def tune_target(name: str, engine: str, trace, slos, trials: int, seed: int) -> dict[str, Any]:
    """One target's study on ``trace`` (its first 75% tuned), the file ``tune`` writes for it, and the checks."""
    with tempfile.TemporaryDirectory() as tmp:
        tuned = tune(write_trace(trace, Path(tmp) / f"{name}.parquet"), name, engine, slos, trials=trials, seed=seed,
                     holdout=HOLDOUT, run_dir=Path(tmp) / engine)
        spec, evaluator, summary, seconds = tuned.spec, tuned.evaluator, tuned.summary, tuned.seconds
        file = summary["recommendation"]["file"]
        text = (spec.run_dir / file).read_text()  # the file as a user gets it: on disk, read back
    answer = summary["answer"]
    config = PolicyConfig.from_mapping(summary["best"]["config"])
    fleet = Fleet(**{k: v for k, v in summary["best"]["fleet"].items() if k in ("tp", "replicas", "moe_ep",
                                                                              "attention_dp")})
    baselines = evaluator.baselines()
    reports = evaluator.reports([config, *baselines.values()], fleets=[fleet] + [spec.fleet] * len(baselines))
    mine = reports[0].weighted_goodput
    stated = summary["best"]["report"]["weighted_goodput"]
    reported = {b: ratio(stated, e["report"]["weighted_goodput"]) for b, e in summary["baselines"].items()}
    if engine == "servetune":
        from_disk = PolicyConfig.from_toml(text)
    else:
        from_disk = read_engine_file(target(engine), text, spec.context,
                                     fleet_knobs={k: getattr(config, k) for k in FLEET_KNOBS})
    disk_goodput = evaluator.reports([from_disk], fleets=[fleet])[0].weighted_goodput
    file_gain = {b: ratio(disk_goodput, r.weighted_goodput) for b, r in zip(baselines, reports[1:], strict=True)}
    for b in baselines:
        if not _same(reported[b], file_gain[b]):
            raise SystemExit(f"{name}/{engine}: reported gain {reported[b]} over {b} differs from the file's "
                             f"{file_gain[b]}")
    held = summary["generalisation"]
    return {"engine": engine, "trials": trials, "seconds": round(seconds, 1),
            "file": file, "weighted_goodput": mine, "keep_defaults": answer["keep_defaults"],
            "knobs": [k["text"] for k in answer["knobs_changed"]], "gain_range": answer["gain"],
            "gpus": answer["sizing"]["recommended"]["gpus"],
            "baselines": {b: r.weighted_goodput for b, r in zip(baselines, reports[1:], strict=True)},
            "slo_attainment": reports[0].slo_attainment,
            "baseline_attainment": {b: r.slo_attainment for b, r in zip(baselines, reports[1:], strict=True)},
            "reported_gain": reported, "file_gain": file_gain,
            "held_out_gain": {scale: figures["gain"] for scale, figures in held["scales"].items()},
            "held_out_requests": held["requests"], "tuned_requests": evaluator.trace.n}


def _same(a: float, b: float) -> bool:
    return (math.isinf(a) and math.isinf(b)) or a == b


def _x(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:.2f}x"


def markdown(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| study | target | file | weighted goodput/s (default) | SLO met (default) | reported gain | "
             "file gain | held-out gain x0.8 / x1 / x1.2 |", "|---|---|---|---|---|---|---|---|"]
    for study, per_target in results.items():
        for engine, r in per_target.items():
            label = "servetune (what-if)" if engine == "servetune" else engine
            what = "defaults kept" if r.get("keep_defaults") else ", ".join(r.get("knobs", [])) or "no knob"
            for b in r["baselines"]:
                held = " / ".join(_x(r["held_out_gain"][s][b]) for s in ("x0.8", "x1", "x1.2"))
                lines.append(f"| {study} | {label} | {r['file']}: {what} | {r['weighted_goodput']:.2f} "
                             f"({r['baselines'][b]:.2f} {b}) | {r['slo_attainment']:.1%} "
                             f"({r['baseline_attainment'][b]:.1%}) | {_x(r['reported_gain'][b])} | "
                             f"{_x(r['file_gain'][b])} | {held} |")
    return "\n".join(lines) + "\n"


def summary(results: dict[str, dict[str, Any]]) -> str:
    """The README's table: each file's gain over its engine's default (the what-if's over the
    default with more goodput), in sample / held out at the trace rate."""
    lines = ["| study | vllm.yaml | sglang.yaml | what-if policy.toml (over the better default) |",
             "|---|---|---|---|"]
    for study, per_target in results.items():
        cells = []
        for engine in TARGETS:
            r = per_target.get(engine)
            if r is None:
                cells.append("-")
                continue
            base = max(r["baselines"], key=r["baselines"].get)
            cells.append(f"{_x(r['reported_gain'][base])} / {_x(r['held_out_gain']['x1'][base])}")
        lines.append(f"| {study} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", help="comma-separated study names")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--summarize", type=Path, help="print the tables of an earlier run's deployable.json")
    args = parser.parse_args(argv)
    if args.summarize:
        results = json.loads(args.summarize.read_text())
        print(markdown(results))
        print(summary(results))
        return 0
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    chosen = studies()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(chosen))
        if unknown:
            parser.error(f"unknown studies {unknown}; known: {sorted(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in wanted}
    out_json = args.out / "deployable.json"
    partial = bool(args.only) or args.targets != ",".join(TARGETS)  # rerun some: keep the rest
    results: dict[str, dict[str, Any]] = json.loads(out_json.read_text()) if partial and out_json.is_file() else {}
    for name, study in chosen.items():
        trace = study["load"]()
        tuned, held = split_holdout(trace, HOLDOUT)
        print(f"## {name}: {trace.n} requests ({tuned.n} tuned, {held.n} held out)", flush=True)
        results.setdefault(name, {})
        for engine in args.targets.split(","):
            r = tune_target(name, engine, trace, study["slo"], args.trials, args.seed)
            results[name][engine] = r
            print(markdown({name: {engine: r}}).splitlines()[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(results, indent=2, default=lambda v: None if v != v else v) + "\n")
    table = markdown(results)
    (args.out / "deployable.md").write_text(
        f"# Deployable gains ({args.trials} trials per target, seed {args.seed})\n\n"
        "Command: `python benchmarks/deployable.py`. Each gain is of the exported file read back and simulated; "
        "held out = the last 25% of the trace window, never tuned on.\n\n" + table
        + "\nIn sample / held out, over the same engine's default (what-if: over the default with more goodput):\n\n"
        + summary(results))
    print(table)
    print(summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
