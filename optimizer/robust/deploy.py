"""The answer as a deployment: the replicas its file carries, and the lines that say what to
deploy (the file's header, the console and the review print the same lines)."""

from __future__ import annotations

import dataclasses
import math

from optimizer.robust.answer import Answer


def deployed_fleet(spec, evaluator, answer: Answer):
    """(fleet to deploy, whether the file carries its replica count).

    The sized count goes into the file where the engine runs replicas itself
    (``data-parallel-size``, ``dp-size``; the what-if target's ``router.yaml``); where the
    engine refuses that layout (a MoE model's vLLM instance, SGLang's attention DP with
    replicas, vLLM's per-batch-size k) the file stays one instance and its header says how
    many to run.
    """
    size = answer.sizing["recommended"].deploy
    if size.replicas is None or size.replicas == answer.fleet.replicas:
        return answer.fleet, True
    fleet = dataclasses.replace(answer.fleet, replicas=size.replicas)
    target = evaluator.target
    if target.what_if:
        return fleet, True
    deployment = evaluator.deployment(fleet)
    if not (target.layout_violations(deployment, spec.context) or target.config_layout_violations(
            target.resolve(answer.config, spec.context), deployment)):
        return fleet, True
    return answer.fleet, False


def flag_name(target, knob: str) -> str:
    """How ``target``'s file spells ``knob`` (the what-if target's policy.toml: the knob's name)."""
    return next((f.key for f in target.flags if f.knob == knob), knob)


def answer_lines(answer: Answer, target, spec, carried: bool) -> list[str]:
    """What to deploy, in the order a capacity engineer reads it."""
    name = "policy.toml" if target.what_if else f"{target.name}.yaml"
    lines = []
    if answer.keep_defaults:
        lines.append(f"Keep {answer.reference}: {answer.reason}. This file is those defaults.")
    else:
        lines.append(f"Deploy {name}: {answer.knobs_text(target.display)} (every other knob at "
                     f"{answer.reference}); chosen because {answer.reason}.")
    sizing = answer.sizing["recommended"]
    deploy = sizing.deploy
    if deploy.replicas is None:
        lines.append(f"GPUs: no fleet of up to {deploy.max_replicas} replicas keeps SLO attainment >= "
                     f"{spec.capacity_target:.0%} on the {sizing.sized_on}: the SLOs are out of reach here.")
    else:
        spread = sizing.replicas
        how = ("" if deploy.replicas == 1 else
               " (router.yaml routes across them)" if target.what_if else
               " (this file carries the count)" if carried else
               f" (run {deploy.replicas} instances of this file behind a load balancer: {target.display} does not "
               "take this layout as replicas of one server)")
        parts = [f"tuning part {_at(sizing.tuning)}"] + ([f"held-out part {_at(sizing.holdout)}"]
                                                        if sizing.holdout is not None else [])
        spread_text = ("the same on every traffic fold and cost-model corner" if spread.low == spread.high else
                       f"range {_replicas(spread.low)}-{_replicas(spread.high)} replicas over traffic folds and the "
                       "cost model's error")
        lines.append(f"GPUs: {deploy.gpus} = {deploy.replicas} replica(s) x {deploy.gpus_per_replica} GPU(s)"
                     f"{how}, {spread_text}; the fewest replicas whose simulated fleet keeps SLO attainment >= "
                     f"{spec.capacity_target:.0%}, sized on the {sizing.sized_on} ({', '.join(parts)}).")
    corners = sum(c.startswith("step times") for c in answer.conditions)
    lines.append(f"Gain over {answer.reference}: {answer.gain.describe(_x)} weighted goodput; goodput "
                 f"{answer.goodput.describe(lambda v: f'{v:.3g}')}/s (range: {len(answer.conditions) - corners} "
                 f"traffic variants and {corners} corners of the cost model's error).")
    lines.append(f"Step-time model error: {answer.model_error.stated}.")
    return lines


def _at(size) -> str:
    if size.replicas is None:
        return f"over {size.max_replicas} replicas"
    return f"{size.replicas} at {100 * (size.attainment or 0):.1f}%"


def _replicas(value: float) -> str:
    return "out of reach" if math.isinf(value) else f"{value:.0f}"


def _x(value: float) -> str:
    return "unbounded" if math.isinf(value) else f"{value:.2f}x"
