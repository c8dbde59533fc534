"""Calibration by replay: the cost model's terms fitted so the closed loop reproduces measured runs.

``fit_replay`` fits ``overhead_s``, ``prefill_scale``, ``decode_scale`` and, for TRT-LLM,
``prefill_step_s`` (the fixed time of a step with prompt tokens: ``PREFILL_STEP_FRAMEWORKS``;
asked, also ``comm_scale``, its collectives against their tables: ``COMM_SCALE_FRAMEWORKS``)
so that the closed loop of ``optimizer.fidelity.closedloop``, driven as each run's benchmark client
drove its server, reproduces the runs' mean TPOT and TTFT. The measured server's step
token budget and chunking, which a runs file does not record, are chosen among
``SERVER_CANDIDATES`` by the same fit and stored in the entry as ``measured_server``, which
``servetune validate`` replays them with; where a run's launch script is public,
``run_server`` serves it with that script's scheduler (``optimizer.fidelity.inferencex``) instead.
A term the fit leaves on a limit of its range is named in the entry (``pinned_terms``).
``calibrate_replay`` turns fits into the entries of the calibration fallback chain.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from costmodels.calibration import (
    entry_family,
    entry_key,
    fitted_layouts,
    fitted_routing,
    step_source,
    with_key_columns,
)
from costmodels.compose import with_comm_scale
from costmodels.costmodel import CostModel
from costmodels.runs import SETUP, kv_dtype_of, with_layout
from optimizer.fidelity.closedloop import (
    BenchClient,
    ClosedLoopError,
    benchmark_means,
    client_for,
    framework_config,
    server_max_seq_len,
)
from optimizer.fidelity.inferencex import known_server
from policies.config import PolicyConfig
from policies.engines import EngineContext
from policies.speculative import AcceptanceModel

#: The scheduler settings a replay fit chooses between for a measured server whose own
#: settings the runs file does not record, per framework: overrides of ``framework_config``
#: (the first is the framework's serving defaults). aiconfigurator's rows come from servers
#: launched from its generated configs (vLLM through its engine arguments, TRT-LLM with
#: ``max_num_tokens`` and ``enable_chunked_prefill`` set per config), so the step token
#: budget and chunking of a measured run are unknowns of the fit, like its scales.
#: A server that runs one request fewer than the benchmark's concurrency (``for_clients``):
#: one client always waits a completion, so light-load TTFT grows by about the decode time
#: over the clients, ``(OSL - 1) x TPOT / (C - 1)``, as the Llama-3.1-8B TRT-LLM rows do at
#: every TP (their TTFT at C 8-16 rises with OSL at 0.8-1.2x that rate; Qwen3-32B's on the
#: same TRT-LLM version at under 0.3x). Which servers behave so is for the fit to say.
#: The last TRT-LLM candidate caps each waiting prompt at 1,024 tokens a step while another
#: request is in the engine, so prompts that wait together progress together: the
#: Qwen3-32B TRT-LLM rows queue long prompts at a burst more (ISL 4096, 8 clients: TTFT 3.4x
#: a lone prefill at TP 1) and interleave them less with decodes than prompts served one
#: after another do.
SEQS_BELOW_CLIENTS = "seqs_below_clients"
SERVER_CANDIDATES: dict[str, tuple[dict, ...]] = {
    "vllm": ({}, {"max_num_batched_tokens": 4096}, {"max_num_batched_tokens": 2048}),
    "sglang": ({},),
    "trtllm": ({}, {"enable_chunked_prefill": True}, {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096},
               {"enable_chunked_prefill": True, SEQS_BELOW_CLIENTS: 1},
               {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, SEQS_BELOW_CLIENTS: 1},
               {"enable_chunked_prefill": True, "max_num_batched_tokens": 4096, "long_prefill_token_threshold": 1024}),
}
#: The measured server replayed where no calibration entry of the run's model applies: the
#: fits choose those settings per model (the dense and breadth fits pick four different
#: TRT-LLM servers for six models), so another model's choice says nothing of this one's.
#: It is the plainest candidate that chunks prompts, as every fitted TRT-LLM server does:
#: TRT-LLM's defaults queue a burst's prompts whole (DeepSeek TTFT 40-57x the measured).
UNMEASURED_SERVER: dict[str, dict] = {"vllm": {}, "sglang": {}, "trtllm": {"enable_chunked_prefill": True}}
#: Where the replay fit starts the fixed time a step with prompt tokens adds
#: (``StepTables.prefill_step_s``), in ms: off zero, so the fit's finite differences see it.
PREFILL_STEP_START_MS = 20.0
#: Frameworks whose replay fit has that time as a fourth term: TRT-LLM runs context and
#: mixed iterations eagerly unless its prefill CUDA graphs are configured. vLLM V1 replays
#: piecewise CUDA graphs for mixed batches (its "CUDA Graphs" design doc), so its fit keeps
#: three terms: on the Qwen3-32B vLLM runs the term traded TTFT for TPOT out of sample (16.4%
#: / 6.1% without, 15.2% / 6.5% with), and, lent by the pooled entry to a smaller model, its
#: 9.6 ms would all but double Llama-3.1-8B's short mixed steps.
PREFILL_STEP_FRAMEWORKS = frozenset({"trtllm"})
#: Frameworks whose replay fit can scale the communication in the step on its own, when
#: asked (``fit_replay(comm_scale=True)``; ``CostModel.comm_s``): TRT-LLM fuses its
#: all-reduce with the residual add and RMSNorm and picks one-shot or two-shot kernels by
#: message size, so an in-model all-reduce costs other than the microbenchmarked
#: collective plus separate norms. With one decode scale for compute and communication
#: alike, every TRT-LLM plain-TP setup's out-of-sample TPOT bias rises with TP
#: (Llama-3.1-70B on B200 -13.6% at TP1 to +15.4% at TP8; Llama-3.1-8B and Qwen3-32B on
#: H100 about -2.5% to +2.5%; `benchmarks/fidelity.py`, column "bias"); vLLM's does not.
#: It is off by default: it meets the breadth TPOT target and misses the dense one
#: (`benchmarks/fidelity.py --comm-scale`; docs/results.md).
COMM_SCALE_FRAMEWORKS = frozenset({"trtllm"})
#: Weight of a run's TTFT residual against its TPOT residual in a replay fit (both as log
#: ratios): TTFT carries the run-to-run scatter of the queueing a closed loop sees, so it
#: steers the prefill scale without letting a few queue-bound runs pull the decode scale.
TTFT_WEIGHT = 0.3
#: Soft-L1 scale of those log-ratio residuals: quadratic within 20%, L1 beyond, so a run
#: the model cannot reach pulls no harder than any other. A near-L1 scale (0.02), closer to
#: the MAPE the figures score, fits the dense runs' TPOT better out of sample (8.5% against
#: 9.4%, before SEQS_BELOW_CLIENTS) but picks another measured server in one fold and loses TTFT (30.2% against 28.1%;
#: `benchmarks/fidelity.py --residual-scale 0.02`), so it is not the default.
RESIDUAL_SCALE = 0.2
#: The replay fit's terms, in the order and units it searches them (times in ms), and
#: their search ranges. The 0 ms floors are physics (no time is negative); every other
#: limit bounds what servetune takes for a plausible correction of the tables, so a term
#: the fit leaves on one was not placed by the runs (``pinned_terms``).
FIT_TERMS = ("overhead_s", "prefill_scale", "decode_scale", "prefill_step_s", "comm_scale")
FIT_LOWER = np.array([0.0, 0.2, 0.2, 0.0, 0.2])
FIT_UPPER = np.array([50.0, 10.0, 5.0, 500.0, 5.0])
#: How close to a limit, as a share of the range, counts as on it.
PINNED_TOLERANCE = 1e-3


def fit_terms(framework: str, comm_scale: bool = False) -> list[int]:
    """Which ``FIT_TERMS`` (indexes) a framework's replay fit searches (``comm_scale``: with
    the communication scale where the framework has one)."""
    return [0, 1, 2] + ([3] if framework in PREFILL_STEP_FRAMEWORKS else []) + (
        [4] if comm_scale and framework in COMM_SCALE_FRAMEWORKS else [])


def pinned_terms(x, terms: list[int] | None = None) -> list[str]:
    """The terms of a replay fit ``x`` (fit units; ``terms``: which ``FIT_TERMS`` they are,
    the first ``len(x)`` if not given) that ended on a limit of their search range other
    than a physical 0 ms floor: the least-squares optimum lies beyond it, so the model
    could not reproduce the runs with a plausible value, and the term's figure is the
    limit's, not a measurement."""
    x = np.asarray(x, dtype=float)
    terms = list(range(x.size)) if terms is None else terms
    lo, hi = FIT_LOWER[terms], FIT_UPPER[terms]
    near = PINNED_TOLERANCE * (hi - lo)
    on_floor = (lo > 0) & (x - lo <= near)
    return [FIT_TERMS[terms[i]] for i in np.flatnonzero(on_floor | (hi - x <= near))]


def server_config(framework: str, ctx: EngineContext, overrides: dict | None = None,
                  version: str | None = None) -> PolicyConfig:
    """``framework_config`` with a fitted measured-server override (``SERVER_CANDIDATES``);
    a limit relative to the run's clients is applied per run (``for_clients``)."""
    config = framework_config(framework, ctx, version)
    fixed = {k: v for k, v in (overrides or {}).items() if k != SEQS_BELOW_CLIENTS}
    return config.replace(**fixed) if fixed else config


def for_clients(config: PolicyConfig, overrides: dict | None, clients: int) -> PolicyConfig:
    """``config`` for a run of ``clients`` clients: with ``SEQS_BELOW_CLIENTS`` k in the
    measured-server overrides, the server runs at most ``clients - k`` requests at once."""
    below = (overrides or {}).get(SEQS_BELOW_CLIENTS)
    return config if below is None else config.replace(max_num_seqs=max(1, int(clients) - int(below)))


def run_server(framework: str, ctx: EngineContext, fitted: dict | None,
               row: dict) -> tuple[PolicyConfig, AcceptanceModel | None]:
    """The scheduler a measured run (a ``load_runs`` row) is replayed with, and its
    drafter's acceptance when it speculates: the server its script set where that is known
    (``optimizer.fidelity.inferencex.known_server``), else the ``fitted`` measured server for its clients."""
    known = known_server(row)
    version = row.get("framework_version")
    if known is not None:
        return framework_config(framework, ctx, version).replace(**known.overrides), known.acceptance
    return for_clients(server_config(framework, ctx, fitted, version), fitted, row["batch_size"]), None


def run_clients(row: dict) -> tuple[int, int]:
    """(clients, ranks) a measured run is replayed with: an attention-DP run's
    ``batch_size`` clients per rank on each of its ``attention_dp_size`` ranks, which step
    together (``closedloop.run_benchmark``'s ``ranks``)."""
    ranks = int(row.get("attention_dp_size") or 1)
    return int(row["batch_size"]) * ranks, ranks


def _mape(pred: np.ndarray, measured: np.ndarray) -> float:
    ok = np.isfinite(pred)
    return float(np.mean(np.abs(pred[ok] / measured[ok] - 1.0)) * 100.0) if ok.any() else math.nan


class ReplayRows:
    """Measured runs (``costmodels.load_runs`` rows) ready to replay under trial cost-model
    terms: each row's uncalibrated cost model, engine context, longest sequence
    (``server_max_seq_len``) and measurements."""

    def __init__(self, runs, bench: BenchClient | None = None, builder=None):
        from costmodels import build
        from optimizer.search.targets import context_of

        builder = builder or build
        self.bench = bench or BenchClient()
        self.rows = list(with_layout(runs).iter_rows(named=True))
        self.ttft_ms = np.array([r["ttft_ms"] for r in self.rows], dtype=float)
        self.tpot_ms = np.array([r["tpot_ms"] for r in self.rows], dtype=float)
        self._cost, self._ctx = [], []
        self._seq = [server_max_seq_len(r["framework"], r["model"]) for r in self.rows]
        self._bench = [client_for(r.get("client"), self.bench) for r in self.rows]
        built: dict[tuple, CostModel] = {}
        for r in self.rows:  # each run on the cost model of one attention-DP group of its layout
            key = (r["model"], r["gpu"], r["framework"], r["gemm_dtype"], *(r[c] for c in SETUP))
            if key not in built:
                built[key] = builder(r["model"], r["gpu"], tp=r["tp"], framework=r["framework"],
                                     gemm_dtype=r["gemm_dtype"], kv_dtype=kv_dtype_of(r["gemm_dtype"]), calibration=False,
                                     moe_ep_size=r["moe_ep_size"], attention_dp_size=r["attention_dp_size"])
            self._cost.append(built[key])
            self._ctx.append(context_of(built[key], r["gpu"], context_len=0, tp=r["tp"]))

    def predict(self, overhead_s: float, prefill_scale: float, decode_scale: float, server: dict | None = None,
                scale: float = 1.0, prefill_step_s: float = 0.0, comm_scale: float = 1.0) -> np.ndarray:
        """(n, 2) mean TTFT and TPOT (ms) of every row under these terms; NaN where a run
        cannot be simulated (it never fits the KV pool)."""
        out = np.full((len(self.rows), 2), np.nan)
        swapped: dict[int, CostModel] = {}
        for i, (r, cost, ctx, seq, bench) in enumerate(zip(self.rows, self._cost, self._ctx, self._seq, self._bench,
                                                           strict=True)):
            if id(cost) not in swapped:
                swapped[id(cost)] = replace(cost, tables=with_comm_scale(cost.tables, cost.comm_s, comm_scale)._replace(
                    overhead_s=overhead_s, scale=scale, prefill_scale=prefill_scale, decode_scale=decode_scale,
                    prefill_step_s=prefill_step_s))
            try:
                config, acceptance = run_server(r["framework"], ctx, server, r)
                clients, ranks = run_clients(r)
                out[i] = benchmark_means(swapped[id(cost)], config, clients, r["isl"], r["osl"], bench,
                                         max_seq_len=seq, acceptance=acceptance, ranks=ranks)
            except ClosedLoopError:
                pass
        return out


def fit_replay(runs, *, bench: BenchClient | None = None, start: tuple[float, float] | None = None,
               ttft_weight: float = TTFT_WEIGHT, residual_scale: float = RESIDUAL_SCALE,
               candidates: tuple[dict, ...] | None = None, builder=None, max_nfev: int = 40,
               comm_scale: bool = False) -> dict:
    """Fit ``overhead_s``, ``prefill_scale``, ``decode_scale`` and, for a framework of
    ``PREFILL_STEP_FRAMEWORKS``, ``prefill_step_s`` (else 0) and, asked (``comm_scale``) for
    one of ``COMM_SCALE_FRAMEWORKS``, ``comm_scale`` (else 1; ``scale`` 1) to ``runs`` (one framework's rows) by replaying every run as the benchmark client drove it
    (``ReplayRows``) and least-squares on the log ratios of simulated to measured TPOT and,
    weighted by ``ttft_weight``, TTFT (soft-L1 at ``residual_scale``, so runs the model
    cannot reach, such as a KV-bound queue, do not pull the rest). Each measured-server candidate
    (``SERVER_CANDIDATES`` of the framework) is fitted; the best is kept as
    ``measured_server``. It applies to runs whose server is unknown: a run whose launch
    script is known replays on that (``run_server``), and where every run's is, no
    candidate is tried ({}). ``start``: (overhead_s, scale) from the steady-state formula fit.

    Returns the fitted terms, those left on a limit of their range (``pinned_terms``) and
    their in-sample MAPE (``*_mape_after``; ``*_before`` for the uncalibrated model under
    the framework defaults)."""
    from scipy.optimize import least_squares

    frameworks = set(runs["framework"].to_list())
    if len(frameworks) != 1:
        raise ClosedLoopError(f"fit_replay fits one framework's runs, got {sorted(frameworks)}")
    framework = frameworks.pop()
    rows = ReplayRows(runs, bench, builder)
    candidates = candidates if candidates is not None else SERVER_CANDIDATES.get(framework, ({},))
    if all(known_server(r) is not None for r in rows.rows):  # no server left to choose
        candidates = ({},)
    overhead0, scale0 = start or (rows._cost[0].tables.overhead_s, 1.0)
    terms = fit_terms(framework, comm_scale)
    lo, hi = FIT_LOWER[terms], FIT_UPPER[terms]
    x0 = np.clip(np.array([scale0 * overhead0 * 1e3, scale0, scale0, PREFILL_STEP_START_MS, 1.0])[terms],
                 np.array([0.0, 0.21, 0.21, 0.0, 0.21])[terms], np.array([49.0, 9.9, 4.9, 499.0, 4.9])[terms])

    def term(x, i, default):  # FIT_TERMS[i] in the units the engine takes
        return x[terms.index(i)] * (1e-3 if i in (0, 3) else 1.0) if i in terms else default

    def predict(x, server):
        return rows.predict(term(x, 0, 0.0), x[1], x[2], server, prefill_step_s=term(x, 3, 0.0),
                            comm_scale=term(x, 4, 1.0))

    def residuals(x, server):
        pred = predict(x, server)
        res = np.concatenate([np.log(pred[:, 1] / rows.tpot_ms), ttft_weight * np.log(pred[:, 0] / rows.ttft_ms)])
        return np.where(np.isfinite(res), res, 3.0)

    best = None
    for server in candidates:
        fit = least_squares(residuals, x0, args=(server,), bounds=(lo, hi), loss="soft_l1", f_scale=residual_scale,
                            diff_step=0.03, x_scale=np.array([1.0, 0.1, 0.1, 10.0, 0.1])[terms], max_nfev=max_nfev)
        if best is None or fit.cost < best[0].cost:
            best = (fit, server)
    fit, server = best
    before = rows.predict(rows._cost[0].tables.overhead_s, 1.0, 1.0, None)
    after = predict(fit.x, server)
    return {
        "overhead_s": float(fit.x[0] * 1e-3), "scale": 1.0, "prefill_scale": float(fit.x[1]),
        "decode_scale": float(fit.x[2]), "prefill_step_s": float(term(fit.x, 3, 0.0)),
        "comm_scale": float(term(fit.x, 4, 1.0)),
        "measured_server": dict(server), "fit": "replay", "pinned_terms": pinned_terms(fit.x, terms),
        "step_source": step_source(rows._cost[0]), **fitted_routing(rows._cost),
        "tpot_mape_before": _mape(before[:, 1], rows.tpot_ms), "ttft_mape_before": _mape(before[:, 0], rows.ttft_ms),
        "tpot_mape_after": _mape(after[:, 1], rows.tpot_ms), "ttft_mape_after": _mape(after[:, 0], rows.ttft_ms),
    }


def calibrate_replay(runs, *, bench: BenchClient | None = None, ttft_weight: float = TTFT_WEIGHT,
                     residual_scale: float = RESIDUAL_SCALE, builder=None, keys: list[tuple] | None = None,
                     max_nfev: int = 40, comm_scale: bool = False) -> list[dict]:
    """Calibration entries (``costmodels.calibration`` format, for ``build(calibration=...)``)
    fitted by replay (``fit_replay``): one per (GPU, framework, model, GEMM dtype, parallel
    path) across its layouts of that path, then one pooled per (GPU, framework, GEMM dtype,
    parallel path) (``model`` "*") for models without their own, the fallback chain
    ``apply_calibration`` walks (``costmodels.calibration.match_entry``: setup, model,
    family, pooled, other GPU, another path last). The steady-state formula fit
    (``costmodels.calibrate``) gives the starting point. ``keys`` limits the fit to those
    (gpu, framework, model, gemm_dtype, path) entries (model "*" for a pooled one): a
    leave-one-out fold needs only the entry its held-out setup falls back to. A pooled fit
    over the same runs as a model's entry reuses its result. ``comm_scale``: fit the
    communication scale too (``fit_replay``)."""
    from costmodels import calibrate

    runs = with_key_columns(runs).with_row_index("_r")
    formula = {entry_key(e): e for e in calibrate(runs.drop("_gpu", "_r", "_path"), builder)}
    entries, done = [], {}
    for pooled in (False, True):
        cols = ["_gpu", "framework", "gemm_dtype", "_path"] if pooled else ["_gpu", "framework", "model", "gemm_dtype",
                                                                            "_path"]
        for key, group in runs.group_by(cols, maintain_order=True):
            gpu, fw, dtype, path = key[0], key[1], key[-2], key[-1]
            model = "*" if pooled else key[2]
            if keys is not None and (gpu, fw, model, dtype, path) not in keys:
                continue
            rows_id = tuple(sorted(group["_r"].to_list()))
            f = formula.get((gpu, fw, model, dtype, path))
            start = (f["overhead_s"], f["scale"]) if f else None
            if rows_id in done:
                fitted = dict(done[rows_id])
            else:
                fitted = done[rows_id] = fit_replay(group.drop("_gpu", "_r", "_path"), bench=bench, start=start,
                                                    ttft_weight=ttft_weight, residual_scale=residual_scale,
                                                    builder=builder, max_nfev=max_nfev, comm_scale=comm_scale)
            family = "" if pooled else entry_family({"model": model})
            entries.append({"gpu": gpu, "framework": fw, "model": model, "models": sorted(set(group["model"])),
                            "family": family, "gemm_dtype": dtype,
                            "kv_dtype": kv_dtype_of(dtype), "path": path,
                            "tp": sorted(set(group["tp"].to_list())),
                            "layouts": fitted_layouts(group.select(list(SETUP)).iter_rows()), "n_runs": len(group), **fitted,
                            "error": {"in_sample_tpot_mape": fitted["tpot_mape_after"],
                                      "in_sample_ttft_mape": fitted["ttft_mape_after"], "out_of_sample": None}})
    return entries
