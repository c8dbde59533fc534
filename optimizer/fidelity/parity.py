"""The vLLM target against vLLM 0.33.0's own scheduler: recorded runs replayed and compared.

A recorded scenario (``../shared/oracle/vllm-0.33.0/<name>/``, ``tests/fixtures/vllm_oracle/``;
made with ``../shared/tools/vllm-oracle/``) holds a trace, a ``vllm serve`` config file, the
KV pool in blocks, a step-time rule, and what vLLM's ``Scheduler`` (``sync``) and
``EngineCore.step_with_batch_queue`` (``async``, what ``vllm serve`` runs) did with them:
per request its first-token and finish times, per step its start, tokens and outputs.
``replay`` runs the same through servetune's vLLM target, reading the file as ``servetune
simulate --config`` does, with ``no-async-scheduling`` for a sync run; ``agreement`` counts
what matches exactly. The comparison is about scheduling alone: both sides time a step by
the same rule on the same batch aggregates and see the same pool.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODES = ("sync", "async")


@dataclass(frozen=True)
class Scenario:
    """One recorded scenario, ready to replay."""

    name: str
    folder: Path
    meta: dict
    trace: object  # studies.traces.Trace
    cost_model: object  # costmodels.costmodel.CostModel
    config: object  # policies.config.PolicyConfig, as the file resolves (async on unless it says no)

    @property
    def modes(self) -> tuple[str, ...]:
        """The runs of vLLM recorded for this scenario."""
        return tuple(m for m in MODES if (self.folder / f"vllm-{m}_requests.csv").is_file())

    def config_for(self, mode: str):
        return self.config.replace(async_scheduling=mode == "async")


def scenarios(*roots: Path) -> list[Path]:
    """Scenario folders under ``roots`` (those that exist), by name."""
    found = [d for root in roots if root.is_dir() for d in root.iterdir() if (d / "scenario.json").is_file()]
    return sorted(found, key=lambda d: d.name)


def load(folder: Path, model: str = "meta-llama/Llama-3.1-8B", gpu: str = "h100") -> Scenario:
    """Read a scenario: its trace, a cost model whose KV pool is exactly its ``num_blocks``
    and whose steps take the scenario's rule, and its config file read by the vLLM target."""
    from optimizer.outputs.exports import read_engine_file
    from optimizer.search.targets import engine_context
    from policies.engines import target

    meta = json.loads((folder / "scenario.json").read_text())
    trace = _trace(dict(np.load(folder / "trace.npz")), folder.name)
    cost_model = _cost_model(meta, folder)
    ctx = engine_context(model, gpu, 1, "vllm")
    config = read_engine_file(target("vllm"), (folder / "vllm.yaml").read_text(), ctx)
    return Scenario(folder.name, folder, meta, trace, cost_model, config.replace(gpu_memory_utilization=1.0))


def _trace(z: dict, name: str):
    from studies.traces import Trace

    n = len(z["arrival_s"])
    return Trace(
        arrival_s=z["arrival_s"], prompt_tokens=z["prompt_tokens"], output_tokens=z["output_tokens"],
        max_tokens=np.minimum(z["max_tokens"], z["output_tokens"]),  # as the harness sends them (ignore_eos)
        tenant=np.zeros(n, dtype=np.int32), priority=z["priority"].astype(np.int32),
        slo_class=np.zeros(n, dtype=np.int32), deadline_s=np.full(n, np.nan), block_offsets=z["block_offsets"],
        block_hashes=z["block_hashes"], block_tokens=int(z["block_tokens"]), source=f"vLLM oracle scenario {name}",
    )


def _cost_model(meta: dict, folder: Path):
    from costmodels.costmodel import CostModel
    from costmodels.steptable import StepTables, linear_tables

    tokens = int(meta["num_blocks"]) * int(meta["block_size"])
    step = meta["step"]
    if step["kind"] == "const":  # every step that computes a token takes exactly `seconds`
        tables = linear_tables(per_token_s=0.0, per_seq_s=0.0, per_kv_token_s=0.0, per_pair_s=0.0,
                               overhead_s=float(step["seconds"]))
        return CostModel.synthetic(tokens, tables=tables)
    if step["kind"] != "costmodel":
        raise ValueError(f"{folder}: unknown step rule {step['kind']!r}")
    z = np.load(folder / "steptables.npz")  # the tables vLLM's steps were timed with
    tables = StepTables(z["data"], float(z["overhead_s"]), float(z["scale"]), float(z["prefill_scale"]),
                        float(z["decode_scale"]), float(z["prefill_step_s"]))
    return dataclasses.replace(CostModel.synthetic(tokens, tables=tables), name=step.get("name", "recorded tables"))


def vllm_requests(folder: Path, mode: str) -> dict[str, np.ndarray]:
    """vLLM's per-request record: first token, finish (seconds), preemptions."""
    with open(folder / f"vllm-{mode}_requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"first_token": np.array([float(r["first_token"]) for r in rows]),
            "finish": np.array([float(r["finish"]) for r in rows]),
            "preemptions": np.array([int(r["preemptions"]) for r in rows])}


def vllm_steps(folder: Path, mode: str) -> list[tuple[float, int, tuple[int, ...], tuple[int, ...]]]:
    """vLLM's steps that computed tokens: (start, tokens, first tokens, finished)."""
    with gzip.open(folder / f"vllm-{mode}_steps.jsonl.gz", "rt") as f:
        records = [json.loads(line) for line in f]
    return [(s["t"], s["tokens"], tuple(sorted(s["first_token"])), tuple(sorted(s["finished"]))) for s in records]


def replay(scenario: Scenario, mode: str):
    """servetune's run of the scenario (``policies.engine.simulate``, fast-forward on)."""
    from policies.engine import simulate

    return simulate(scenario.trace, scenario.cost_model, scenario.config_for(mode), seed=0)


def stepping_replica(trace, cost_model, config):
    """A replica of ``config`` for stepping through ``trace`` by hand: fast-forward off, every
    request delivered at its arrival; returns (replica, statics, config vector) for
    ``policies.engine.advance``."""
    from policies import engine as eng
    from policies.engine.run import default_series_every, fairness_params, statics

    cap, host = eng.validate(trace, cost_model, config)
    st = statics(trace, cost_model, [config])
    cfg = config.to_vector()
    tenants, classes = fairness_params(trace, config, None)
    rep = eng.new_replica(st, cfg, cap, host, cost_model.kv_bytes_per_token, cost_model.swap_bytes_per_s, 0,
                          default_series_every(trace), False, tenants, classes, float(trace.arrival_s[0]))
    for r in range(trace.n):
        eng.deliver(rep, r, float(trace.arrival_s[r]))
    return rep, st, cfg


def replay_steps(scenario: Scenario, mode: str) -> list[tuple[float, int, tuple[int, ...], tuple[int, ...]]]:
    """servetune's steps, one ``advance`` per step with fast-forward off, as ``vllm_steps``."""
    from policies import engine as eng
    from policies.kernel_state import (
        B_TOKENS,
        DONE,
        FIRST_TOKEN,
        N_DELIVERED,
        N_DONE,
        N_RUN,
        N_WAIT,
        NEXT_DELIVERY,
        STATUS,
        STEPS,
    )
    from policies.kernel_state import T as CLOCK

    trace, cost_model = scenario.trace, scenario.cost_model
    rep, st, cfg = stepping_replica(trace, cost_model, scenario.config_for(mode))
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    steps = []
    while g[N_DONE] < g[N_DELIVERED]:
        t = gf[CLOCK]
        if g[N_RUN] + g[N_WAIT] == 0 and gf[NEXT_DELIVERY] > t:
            eng.advance(rep, st, cost_model.tables, cfg, gf[NEXT_DELIVERY])  # idle until the next arrival
            continue
        before = g.copy()
        no_token = np.isnan(rf[FIRST_TOKEN])
        done = ri[STATUS] == DONE
        eng.advance(rep, st, cost_model.tables, cfg, np.nextafter(t, np.inf))
        if g[STEPS] == before[STEPS]:
            if gf[CLOCK] == t and np.array_equal(g, before):
                raise RuntimeError(f"{scenario.name}: no progress at t={t}")
            continue  # lingering requests left, or the replica idled
        firsts = np.flatnonzero(no_token & ~np.isnan(rf[FIRST_TOKEN]))
        finished = np.flatnonzero(~done & (ri[STATUS] == DONE))
        steps.append((t, int(g[B_TOKENS]), tuple(firsts.tolist()), tuple(finished.tolist())))
    return steps


@dataclass(frozen=True)
class Agreement:
    """What servetune's replay shares exactly with vLLM's run."""

    requests: int
    same_first_token: int
    same_finish: int
    same_both: int
    same_preemptions: int
    steps_vllm: int
    steps_servetune: int
    same_steps: int  # leading steps identical in start, tokens, first tokens and finishes

    @property
    def exact(self) -> bool:
        return self.same_both == self.requests and self.same_steps == self.steps_vllm == self.steps_servetune


def agreement(scenario: Scenario, mode: str, steps: bool = True) -> Agreement:
    vllm = vllm_requests(scenario.folder, mode)
    ours = replay(scenario, mode)
    first = ours.first_token_s == vllm["first_token"]
    finish = ours.finish_s == vllm["finish"]
    theirs_steps = vllm_steps(scenario.folder, mode) if steps else []
    our_steps = replay_steps(scenario, mode) if steps else []
    same = 0
    for a, b in zip(theirs_steps, our_steps, strict=False):
        if a != b:
            break
        same += 1
    return Agreement(len(first), int(first.sum()), int(finish.sum()), int((first & finish).sum()),
                     int((ours.preemptions == vllm["preemptions"]).sum()), len(theirs_steps), len(our_steps), same)
