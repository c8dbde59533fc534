"""The run folder a finished (or interrupted) study leaves behind.

``write_run_outputs(run_dir, study, spec, evaluator)`` writes, for the recommended trial:
the engine configs and bench command (``optimizer.outputs.exports``), ``summary.json``
(``optimizer.outputs.summary``), ``trials.parquet`` (``optimizer.outputs.frame``), the plots
(``optimizer.outputs.runplots``) and the capacity review (``optimizer.outputs.review``). It
only reads the study; running it again regenerates the same files. The outputs are swapped
in whole (``optimizer.outputs.staging``).

The pieces it puts together work on plain data (trials, PolicyConfig, Report dicts) so they
can be tested and reused without a study.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial

from optimizer.outputs.exports import TrafficShape, write_exports
from optimizer.outputs.frame import trials_frame
from optimizer.outputs.measure import (
    Evaluated,
    generalisation_check,
    gpu_curves,
    oracle_bound,
    rate_curves,
    sweep_scales,
)
from optimizer.outputs.replay import deployment_of, file_replay, write_bench_replay
from optimizer.outputs.review import (
    Capacity,
    ConfigFigures,
    LoadSignals,
    ReviewInputs,
    diagnose,
    routing_label,
    write_review,
)
from optimizer.outputs.runplots import write_plots
from optimizer.outputs.staging import staged_outputs
from optimizer.outputs.summary import residual, run_summary, verdict
from optimizer.outputs.trials import (
    OutputError,
    baseline_trials,
    candidates,
    directions,
    fleet_front,
    is_feasible,
    metric_names,
    recommend,
)
from optimizer.robust.answer import robust_answer
from optimizer.robust.deploy import answer_lines, deployed_fleet, flag_name
from optimizer.search.capacity import capacity_many
from optimizer.search.space import speculative_searched
from studies.metrics import json_safe


@dataclass(frozen=True)
class RunOutputs:
    """The files written (name -> path) and the summary that went into summary.json."""

    files: dict[str, Path]
    summary: dict[str, Any]


def write_run_outputs(run_dir, study, spec, evaluator) -> RunOutputs:
    """Write every run-folder output for the study's recommended trial; return paths and summary.

    The recommended figures are those of the exported file read back and simulated
    (``file_replay``); the run also scores that file and the baselines on the held-out end
    of the trace and at +-20% of its rate (``generalisation``). A folder that cannot be
    written (read-only, a full disk) is an OutputError naming it; the previous outputs stay.
    """
    run_dir = Path(run_dir)
    try:
        with staged_outputs(run_dir) as out:
            outputs = _write_outputs(out, study, spec, evaluator)
    except OSError as exc:
        where = exc.filename or run_dir
        raise OutputError(f"cannot write the outputs to {where}: {exc.strerror or exc}; the study's trials are "
                          "kept and the previous outputs stay; free the disk or fix the folder's permissions, then "
                          f"run `servetune report {run_dir}`") from None
    return RunOutputs({k: run_dir / path.relative_to(out) for k, path in outputs.files.items()}, outputs.summary)


def _write_outputs(out: Path, study, spec, evaluator) -> RunOutputs:
    """``write_run_outputs`` into the folder ``out``."""
    trials = study.get_trials(deepcopy=False)
    dirs, names = directions(study), metric_names(study)
    presets = evaluator.baselines()
    found = baseline_trials(trials)
    answer = robust_answer(spec, evaluator, candidates(trials, spec, dirs, evaluator.target, presets), presets,
                           as_file=lambda config, fleet: file_replay(spec, evaluator.target, config, fleet).config,
                           flag_of=lambda knob: flag_name(evaluator.target, knob),
                           knobs=(*evaluator.target.knobs, *speculative_searched(spec.search_space)))
    best = answer.trial or found.get(answer.reference) or recommend(trials, spec, dirs)
    note = f"servetune study {spec.study_name}, trial {best.number}" + (
        "" if answer.trial is not None else f" ({answer.reference} kept)")
    replay = file_replay(spec, evaluator.target, answer.config, answer.fleet)
    label = replay.name + (f" (trial {best.number})" if answer.trial is not None else " (defaults kept)")
    configs = {label: replay.config, **presets}
    fleets = [answer.fleet, *[spec.fleet] * len(presets)]  # baselines: the deployment's fleet
    trial_of = {label: answer.trial, **{name: found.get(name) for name in presets}}
    sizing = {label: answer.sizing["recommended"], **{name: answer.sizing[name] for name in presets}}

    traffic = TrafficShape.of(evaluator.trace)
    found_capacity = capacity_many(evaluator, list(configs.values()), spec.capacity_target, fleets=fleets)
    curves = rate_curves(evaluator, configs, sweep_scales([c.rate_scale for c in found_capacity]), traffic.rate_rps,
                         fleets)
    evaluated = []
    runs = evaluator.simulate_batch(list(configs.values()), fleets=fleets)
    for (name, config), fleet, (result, report), cap in zip(configs.items(), fleets, runs, found_capacity,
                                                            strict=True):
        capacity = Capacity(cap.rate_scale, traffic.rate_rps, fleet.replicas, fleet.tp, capped=not cap.bracketed,
                            sized=sizing[name])
        # What limits a config shows where it saturates: at its capacity, not at a light trace rate.
        limit_scale = cap.rate_scale if cap.rate_scale > 0 else 1.0
        at_limit, limit_report = evaluator.simulate(config, rate_scale=limit_scale, fleet=fleet)
        diagnosis = diagnose(LoadSignals.of(at_limit, limit_report.to_dict()))
        evaluated.append(Evaluated(name, config, fleet, trial_of[name], result, report.to_dict(), curves[name],
                                   capacity, diagnosis, limit_scale * traffic.rate_rps))
    recommended, baselines = evaluated[0], evaluated[1:]

    # the file deploys the sized fleet where the engine carries it; its header states that fleet's figures
    deploy_fleet, carried = deployed_fleet(spec, evaluator, answer)
    deployment = deployment_of(spec, recommended.fleet)  # what the review's figures ran on
    files: dict[str, Path] = {}
    deployed = (recommended.report if deploy_fleet == recommended.fleet else
                evaluator.reports([replay.config], fleets=[deploy_fleet])[0].to_dict())
    expected = {k: deployed[k] for k in ("request_goodput", "slo_attainment", "p99_ttft_ms", "p99_tpot_ms")
                if deployed.get(k) is not None}
    lines = answer_lines(answer, evaluator.target, spec, carried)  # the header, review and summary say the same
    header = "\n".join([note, *lines])
    files.update(write_exports(out, evaluator.target, replay.config, deployment_of(spec, deploy_fleet), spec.context,
                               note=header, expected=expected,
                               tables=evaluator.cost_model_of(deploy_fleet).tables))
    if not evaluator.target.what_if:
        files.update(write_bench_replay(out, spec, evaluator, replay, deploy_fleet, expected))
    generalisation = generalisation_check(spec, evaluator, {e.name: e.config for e in evaluated},
                                          [e.fleet for e in evaluated])
    plot_files = write_plots(out / "plots", study, trials, dirs, names, evaluated, evaluator.trace, spec,
                              traffic.rate_rps, gpu_curves(evaluator, evaluated))
    files.update(plot_files)
    review = ReviewInputs(
        title=f"Capacity review: {spec.study_name}",
        deployment=deployment, slos=spec.slos, target_attainment=spec.capacity_target,
        trace_description=(f"{spec.trace.name}, {evaluator.trace.n} requests at {traffic.rate_rps:.3g} req/s "
                           f"(burstiness {traffic.burstiness:.2g}, mean {traffic.mean_prompt_tokens} prompt / "
                           f"{traffic.mean_output_tokens} output tokens)"),
        best=_figures(recommended), baselines=[_figures(e) for e in baselines],
        objectives=tuple(zip(names, best.values, dirs, strict=True)),
        plots={caption: str(path.relative_to(out)) for caption, path in plot_files.items()
               if path.suffix == ".png"},
        notes=_notes(best, recommended, evaluated, spec, evaluator.target, generalisation,
                     residual(evaluator.cost_model)),
        fleet_front=fleet_front(trials),
        failures=None if spec.failures is None else spec.failures.describe(),
        answer=lines,
    )
    files["capacity-review.md"], files["capacity-review.html"] = write_review(out, review)

    summary = run_summary(study, spec, evaluator, best, names, dirs, recommended, baselines, traffic)
    summary["recommendation"] = {"engine": evaluator.target.name, "version": evaluator.target.version,
                                 "what_if": evaluator.target.what_if, "file": replay.name,
                                 "figures_are": "the exported file, read back and simulated"}
    summary["generalisation"] = generalisation
    summary["answer"] = {**answer.to_dict(), "lines": lines,
                         "deploy": {**deploy_fleet.to_dict(), "gpus": deploy_fleet.gpus,
                                    "replicas_in_file": carried, "report": deployed}}
    summary["verdict"] = verdict(recommended, baselines, spec.capacity_target)
    if evaluator.target.what_if:
        summary["oracle_upper_bound"] = oracle_bound(spec, evaluator, {e.name: e.config for e in evaluated},
                                                     [e.fleet for e in evaluated])
    files["summary.json"] = out / "summary.json"
    files["summary.json"].write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    files["trials.parquet"] = out / "trials.parquet"
    trials_frame(trials, names).write_parquet(files["trials.parquet"])
    return RunOutputs(files, summary)


def _figures(e: Evaluated) -> ConfigFigures:
    return ConfigFigures(e.name, e.config, e.report, e.capacity, e.diagnosis,
                         trial=e.trial.number if e.trial else None, diagnosed_at_rps=e.diagnosed_at_rps)


#: What stands behind a gain on an attention-DP layout: the groups' lockstep is simulated
#: (``policies.engine.lockstep``), but no measured run of the engines' DP checks it.
ATTENTION_DP_CAVEAT = ("Attention DP is simulated as groups stepping together, each step as long as the slowest "
                       "group's, its MoE layers over every group's tokens; no measured vLLM or SGLang DP run has "
                       "checked this (the only measured DP runs are six of TensorRT-LLM's, whose calibration ends "
                       "a term on its limit): measure a DP layout with the bench script before relying on its "
                       "gain.")


def _notes(best: FrozenTrial, recommended: Evaluated, evaluated: Sequence[Evaluated], spec, target,
           generalisation: Mapping[str, Any] | None = None, calibration: Mapping[str, Any] | None = None) -> list[str]:
    notes = []
    if target.what_if:
        notes.append("WHAT-IF: this recommendation uses servetune's own policies, which no engine runs; its gain is "
                     "what this traffic would gain if your engine had them (policy.toml only).")
    else:
        notes.append(f"Every figure of the recommendation is the exported {target.name}.yaml, read back as "
                     f"{target.display} {target.version} runs it and simulated.")
    if generalisation is not None:
        at = generalisation["scales"].get("x1", {}).get("gain", {})
        notes.append(f"Held out: tuned on the first {1 - spec.holdout:.0%} of the trace window; on the last "
                     f"{spec.holdout:.0%} ({generalisation['requests']} requests) the gain is "
                     + ", ".join(f"{g:.2f}x over {n}" if math.isfinite(g) else f"unbounded over {n}"
                                 for n, g in at.items()) + ".")
    if calibration is not None:
        which = ("no calibration" if calibration.get("file") is None else
                 f"calibration {calibration['file']} ({calibration['match']} entry, fitted on "
                 + ", ".join(calibration.get("models") or [calibration.get("model", "?")]) + ")")
        notes.append(f"Cost model: {which}; its error: {calibration['stated_error']}. Read every gain against it.")
    if not is_feasible(best):
        violated = ", ".join(k for k, v in best.constraints.items() if v > 0)
        notes.append(f"No trial met every constraint; trial {best.number} is the best of all and violates {violated}.")
    if spec.objective == "goodput-gpus":
        notes.append(f"Goodput vs GPUs: the recommendation is the fewest GPUs on the Pareto front that keep SLO "
                     f"attainment >= {spec.capacity_target:.0%} (the most goodput if none does).")
    if recommended.fleet != spec.fleet:
        notes.append(f"The recommendation runs on {recommended.fleet.describe()}; the baselines on the "
                     f"deployment's {spec.fleet.describe()}.")
    if any(e.fleet.schedulers > 1 for e in evaluated):
        notes.append("Replicas are simulated as one fleet under one clock, each request routed by the config's "
                     "router as it arrives: "
                     + "; ".join(f"{e.name}: {routing_label(e.config, e.fleet.schedulers)}" for e in evaluated)
                     + ". The fleet's KV high-water is the sum of the replicas' peaks.")
    if any(e.fleet.attention_dp > 1 for e in evaluated):
        notes.append(ATTENTION_DP_CAVEAT)
    if spec.failures is not None:
        notes.append(f"Every simulation ran with the study's failures ({spec.failures.describe()}), compressed "
                     "with the trace at other arrival rates.")
    out_of_range = recommended.report.get("out_of_range_steps")
    if out_of_range:
        notes.append(f"{out_of_range} simulated steps fell outside the profiled step-time tables; "
                     "their timing is extrapolated and less certain.")
    return notes
