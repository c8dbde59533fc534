"""The recommendation as deployed: its exported file read back, and the bench replay of it.

``export``, the robust answer's candidates and the run folder all read a file back through
``file_replay``, so a figure stated for a file is always that file's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from optimizer.outputs.exports import (
    Deployment,
    engine_yaml,
    policy_toml,
    read_engine_file,
    serve_command,
)
from optimizer.search.space import Fleet
from policies.config import FLEET_KNOBS, PolicyConfig


@dataclass(frozen=True)
class FileReplay:
    """The recommendation as deployed: the file written for the target, read back as the
    engine runs it, and that config's simulation. Every figure servetune reports for a
    recommendation is this replay's, never the searched trial's."""

    name: str  # the file: vllm.yaml, sglang.yaml or policy.toml
    text: str
    config: PolicyConfig


def file_replay(spec, target, config: PolicyConfig, fleet: Fleet, note: str = "",
                expected: Mapping[str, float] | None = None) -> FileReplay:
    """Write ``config`` as the study's ``target`` writes it and read it back (``optimizer.outputs.exports``)."""
    ctx = spec.context
    if target.what_if:
        text = policy_toml(config, note, what_if=True)
        return FileReplay("policy.toml", text, PolicyConfig.from_toml(text))
    deployment = deployment_of(spec, fleet)
    text = engine_yaml(target, config, deployment, ctx, note, expected)
    replayed = read_engine_file(target, text, ctx, drafter=spec.speculative,
                                fleet_knobs={k: getattr(config, k) for k in FLEET_KNOBS})
    return FileReplay(f"{target.name}.yaml", text, replayed)


def deployment_of(spec, fleet: Fleet | None = None) -> Deployment:
    """Where a config runs: the spec's model and GPU on ``fleet`` (default: the spec's)."""
    fleet = fleet or spec.fleet
    return Deployment(spec.model, tp=fleet.tp, replicas=fleet.replicas, gpu=spec.gpu, drafter=spec.speculative,
                      moe_ep=fleet.moe_ep, attention_dp=fleet.attention_dp)


def write_bench_replay(run_dir: Path, spec, evaluator, replay: FileReplay, fleet: Fleet,
                       expected: Mapping[str, float]) -> dict[str, Path]:
    """The bench replay of the exported file (``optimizer.bench.scripts``): the whole study
    trace as a timed replay sends it, and that file simulated on exactly that."""
    from optimizer.bench.results import RequestTimes
    from optimizer.bench.scripts import write_bench
    from studies.replay import as_replayed

    replayed = as_replayed(evaluator.full_trace)
    result = evaluator.simulate_on(replayed, replay.config, fleet)
    name = evaluator.target.name
    deployment = {"model": spec.model, "gpu": spec.gpu, **fleet.to_dict(), "framework": spec.framework}
    return write_bench(run_dir, engine=name, config_file=replay.name,
                       server=serve_command(evaluator.target, replay.config, replay.name),
                       deployment=deployment, trace=replayed, slos=spec.slos,
                       simulated=RequestTimes.simulated(result, replayed), study=spec.study_name,
                       study_figures=expected, fleet_knobs={k: getattr(replay.config, k) for k in FLEET_KNOBS})
