"""A run folder's bench replay as servetune re-simulates it: the replayed traffic, the
config file it was sent to, and the measured requests turned back into a trace.

``BenchRun.open`` reads a target folder (``runs/<study>/<engine>``) or a study folder
(``runs/<study>``, the engine then told by ``engine`` or the result's client). Its
``traffic(measured)`` is the trace the client actually sent: the replay's requests, in
the file's order, with the measured send times (where the client records them) and
prompt lengths (SGLang's and AIPerf's tokenizers rebuild prompts near, not on, the
trace's), after checking the result belongs to this replay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.bench.results import BenchResultError, RequestTimes
from optimizer.bench.scripts import MANIFEST, read_manifest
from policies.config import PolicyConfig
from studies.traces import Trace

#: prompt lengths a client may rebuild differently from the trace's (tokens, share)
PROMPT_SLACK = {"vllm": (0, 0.0), "aiperf": (16, 0.02), "sglang": (96, 0.1)}


@dataclass(frozen=True)
class BenchRun:
    folder: Path
    manifest: dict[str, Any]
    spec: Any  # StudySpec
    config: PolicyConfig
    trace: Trace  # the replayed trace, with the study's SLO classes and tenants
    notes: tuple[str, ...] = ()

    @classmethod
    def open(cls, folder: str | Path, engine: str | None = None) -> BenchRun:
        folder = _target_folder(Path(folder), engine)
        manifest = read_manifest(folder)
        spec = _spec(folder)
        config = _config(folder, manifest, spec)
        trace, notes = _replayed_trace(folder, manifest, spec)
        return cls(folder, manifest, spec, config, trace, notes)

    @property
    def engine(self) -> str:
        return self.manifest["engine"]

    def cost_model(self, calibration: str | Path | bool | None = None):
        """The study's cost model (``calibration``: a file, False for none; default the study's)."""
        from costmodels import build

        spec, deployment = self.spec, self.manifest["deployment"]
        chosen = spec.calibration if calibration is None else calibration
        return build(spec.model, spec.gpu, tp=int(deployment["tp"]), framework=spec.framework,
                     calibration=chosen, model_config=spec.model_config, gemm_dtype=spec.dtype,
                     kv_dtype=spec.kv_cache_dtype, moe_ep_size=int(deployment.get("moe_ep", 1)),
                     attention_dp_size=int(deployment.get("attention_dp", 1)))

    def traffic(self, measured: RequestTimes) -> Trace:
        """The trace the client sent (module docstring); BenchResultError when ``measured``
        is not a run of this replay."""
        trace, where = self.trace, measured.source
        if measured.n != trace.n:
            raise BenchResultError(f"{where}: {measured.n} requests, but {self.folder / self.manifest['trace']} has "
                                   f"{trace.n}: the result belongs to another trace")
        done = measured.ok & (measured.output_tokens > 0)
        wrong = np.flatnonzero(done & (measured.output_tokens != trace.output_tokens))
        if len(wrong):
            i = int(wrong[0])
            raise BenchResultError(f"{where}: request {i} produced {measured.output_tokens[i]} output tokens where the "
                                   f"replayed trace asks {trace.output_tokens[i]} ({len(wrong)} such): another trace, "
                                   "or a replay without ignore_eos")
        client = where.split(":", 1)[0]
        tokens, share = PROMPT_SLACK.get(client, (0, 0.0))
        sent = measured.prompt_tokens > 0
        off = np.abs(measured.prompt_tokens - trace.prompt_tokens) > tokens + share * trace.prompt_tokens
        wrong = np.flatnonzero(sent & off)
        if len(wrong):
            i = int(wrong[0])
            raise BenchResultError(f"{where}: request {i} sent a {measured.prompt_tokens[i]}-token prompt where the "
                                   f"replayed trace has {trace.prompt_tokens[i]} ({len(wrong)} such, {client} allows "
                                   f"{tokens} + {share:.0%}): the result belongs to another trace")
        from studies.replay import with_prompts

        out = with_prompts(trace, np.where(sent, measured.prompt_tokens, trace.prompt_tokens))
        if np.all(np.isfinite(measured.sent_s)):
            # send order is trace order; clients may record a later request a hair earlier
            out = out.replace(arrival_s=np.maximum.accumulate(measured.sent_s))
        return out

    def simulate(self, trace: Trace, cost_model):
        """The config file replayed on ``trace`` (one scheduler, or the fleet kernel)."""
        spec = self.spec
        options = {} if spec.speculative is None else {"acceptance": spec.speculative.acceptance}
        deployment = self.manifest["deployment"]
        # one scheduler per attention-DP group of each replica (optimizer.search.space.Fleet.schedulers),
        # the groups of a replica stepping together
        ranks = int(deployment.get("attention_dp", 1))
        replicas = int(deployment["replicas"]) * ranks
        if replicas > 1:
            from policies.fleet import simulate_fleet

            return simulate_fleet(trace, cost_model, self.config, seed=spec.seed, replicas=replicas, lockstep=ranks,
                                  **options)
        from policies.engine import simulate

        return simulate(trace, cost_model, self.config, seed=spec.seed, **options)


def _target_folder(folder: Path, engine: str | None) -> Path:
    if not folder.is_dir():
        raise BenchResultError(f"run folder {folder} does not exist")
    if (folder / MANIFEST).is_file():
        return folder
    found = sorted(p.parent.name for p in folder.glob(f"*/{MANIFEST}"))
    if engine is not None:
        if engine not in found:
            raise BenchResultError(f"{folder} has no {engine} bench replay (found: {found or 'none'})")
        return folder / engine
    if len(found) == 1:
        return folder / found[0]
    if not found:
        raise BenchResultError(f"{folder} has no {MANIFEST}: not a servetune run folder with a bench replay")
    raise BenchResultError(f"{folder} holds replays for {found}; name one with --engine")


def _spec(folder: Path):
    from optimizer.search.spec import SpecError, spec_from_dict
    from optimizer.search.study import MANIFEST as STUDY

    try:
        stored = json.loads((folder / STUDY).read_text())
        return spec_from_dict(stored["spec"], run_dir=folder)
    except (OSError, json.JSONDecodeError, KeyError) as exc:
        raise BenchResultError(f"{folder / STUDY}: cannot read the study's spec ({exc})") from None
    except SpecError as exc:
        raise BenchResultError(f"{folder / STUDY}: {exc}") from None


def _config(folder: Path, manifest: dict, spec) -> PolicyConfig:
    from optimizer.outputs.exports import ExportError, read_engine_file
    from policies.engines import target

    path = folder / manifest["config"]
    try:
        return read_engine_file(target(manifest["engine"]), path.read_text(), spec.context, drafter=spec.speculative,
                                fleet_knobs=manifest.get("fleet_knobs") or {})
    except OSError as exc:
        raise BenchResultError(f"{path}: cannot read the config the replay ran ({exc.strerror})") from None
    except ExportError as exc:
        raise BenchResultError(f"{path}: {exc}") from None


def _replayed_trace(folder: Path, manifest: dict, spec) -> tuple[Trace, tuple[str, ...]]:
    """trace.jsonl as replayed, with the SLO classes and tenants of the study's trace
    (which the Mooncake layout cannot hold) when that trace is still at its path."""
    from studies.formats import mooncake
    from studies.traces import TraceError

    path = folder / manifest["trace"]
    try:
        replayed = mooncake.read(path, spread="raw", block_tokens=int(manifest["block_tokens"]))
    except (OSError, TraceError) as exc:
        raise BenchResultError(f"{path}: {exc}") from None
    replayed = replayed.replace(max_tokens=np.maximum(replayed.output_tokens, 1))
    try:
        from optimizer.search.evaluate import load_study_trace
        from studies.replay import as_replayed

        study = as_replayed(load_study_trace(spec))
    except (OSError, TraceError) as exc:
        return replayed, (f"the study's trace {spec.trace} could not be read ({exc}): every request is scored "
                          "against the default SLO class",)
    if study.n != replayed.n or not np.array_equal(study.prompt_tokens, replayed.prompt_tokens):
        return replayed, (f"the study's trace {spec.trace} no longer matches {path}: every request is scored against "
                          "the default SLO class",)
    return replayed.replace(slo_class=study.slo_class, slo_class_names=study.slo_class_names, tenant=study.tenant,
                            tenant_names=study.tenant_names), ()
