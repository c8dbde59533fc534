"""Closed-loop benchmarks on the engine, driven the way the benchmark client drives a server.

A closed-loop benchmark keeps ``clients`` requests in flight: each client (an AIPerf
worker slot, a ``vllm bench serve --max-concurrency`` slot) sends a prompt, waits for its
last token and sends the next one. The rows of aiconfigurator's ``silicon_*.csv`` come
from its benchmark script, which runs AIPerf in concurrency mode (``aiperf profile
--concurrency C --request-count ... --warmup-request-count 2C``, ``--random-seed 100``,
``ignore_eos``); ``BenchClient`` models that run, step by step inside the engine:

1. **start-up burst**: a phase starts with ``C`` requests sent at once (AIPerf's
   concurrency mode issues every credit it may at the phase start; ``ramp_s`` spreads
   them instead, as ``--concurrency-ramp-duration`` does);
2. **how concurrency is held**: a client sends its next request as soon as (``gap_s``
   after) its previous one finished, while the phase has credits left; a phase's tail
   runs below ``C`` as clients run out of credits;
3. **warm-up**: the first ``warmup_per_client * C`` requests are warm-up, not measured;
   AIPerf awaits every warm-up response before the profiling phase (``await_warmup``),
   so the profiled phase opens with a second synchronized burst, which is part of the
   measured mean;
4. **profiled count**: ``requests_per_client * C`` requests are measured (mean TTFT and
   TPOT over them, as AIPerf reports them);
5. **length distribution**: each request's prompt and output lengths are drawn (normal
   around ISL/OSL with ``isl_stddev``/``osl_stddev``, AIPerf's ``--isl-stddev`` and
   ``--osl-stddev``, default 0; or uniform within ``range_ratio``, the random-range
   ratio of ``vllm bench serve``/``sglang.bench_serving``, each its own way:
   ``RANGE_STYLES``), seeded, so a run is deterministic; drawn lengths make clients drift
   apart as real ones do, where fixed ones keep them sending in waves;
6. **the path between client and engine**: ``ingress_s`` (HTTP, tokenization, the
   frontend: counted in TTFT and delaying the engine) and ``jitter_s`` (a seeded random
   delay before each send); both 0 by default.

The loop runs inside a Numba kernel on the engine's resumable replica
(``policies.engine``: ``new_replica``, ``deliver``, ``advance``): every request is
delivered at the moment its client sends it (its arrival is set then, so queue order,
TTFT and TPOT are measured from the send), the engine runs until the next step in which
a request can finish (a horizon no finish can precede: fewest tokens left times the
shortest step the tables allow), and finished requests hand their client the next
credit. Each finish is checked to fall exactly on the step boundary the loop stopped at.
No request is cut short or refused in silence: a run with a request past a sequence limit
(``max_model_len``, the step budget without chunked prefill, or trtllm-serve's
``max_seq_len``, which it keeps apart from the step budget: ``server_max_seq_len``) or
the KV pool is an error naming the limit and its numbers.

Not every measured run came from that script: a run names its client (``client``, from
``costmodels.load_runs``), and ``client_for`` varies the AIPerf client as that one drove
the server (``CLIENT_VARIANTS``: InferenceX's rows draw their lengths); where the run's
launch script is public, ``run_server`` serves it with that script's scheduler
(``optimizer.inferencex``).

Facts and defaults (``BenchClient``): AIPerf's burst start and its one-credit-per-finish
rule are its documented concurrency mode; the warm-up count 2C, the seed 100 and zero
length stddev are those of aiconfigurator's benchmark scripts (its ``eval`` runner and
``bench_run.sh``); the profiled count differs between them (10C in the ``eval`` runner,
50C in ``bench_run.sh``) and the CSV does not record it, so ``requests_per_client``
defaults to 10 and is a parameter (10 fits the rows better than 50: ``benchmarks/fidelity.py``).
``LOCKSTEP`` is the previous harness (4 waves, continuous, wave 0 dropped), kept for
comparison; it reproduces that harness's fixed point exactly.

Calibration by replay (``calibrate_replay``, ``fit_replay``): the cost model's
``overhead_s``, ``prefill_scale``, ``decode_scale`` and, for TRT-LLM, ``prefill_step_s`` (the
fixed time of a step with prompt tokens: ``PREFILL_STEP_FRAMEWORKS``) are fitted so that this loop,
driven as the runs were, reproduces their mean TPOT and TTFT; the measured server's step
token budget and chunking (which the runs file does not record) are chosen among
``SERVER_CANDIDATES`` by the same fit and stored in the entry as ``measured_server``,
which ``servetune validate`` replays them with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from numba import njit

from costmodels.calibration import (
    SETUP,
    entry_family,
    entry_key,
    fitted_layouts,
    fitted_routing,
    step_source,
    with_key_columns,
    with_layout,
)
from costmodels.costmodel import CostModel, CostModelError
from costmodels.steptable import step_seconds
from optimizer.inferencex import known_server
from policies import engine
from policies import fairness as fm
from policies.config import PolicyConfig
from policies.engine import O_FINISH, O_FIRST_TOKEN, O_GENERATED, O_REASON, O_STATE
from policies.engines import EngineContext, preset
from policies.kernel_state import (
    DONE,
    ERROR,
    FINISH,
    GENERATED,
    MAX_LEN,
    RUNNING,
    S_ARRIVAL,
    STATE,
    STATUS,
    TARGET,
    WAITING,
)
from policies.result import Reject, SimResult, State
from policies.speculative import AcceptanceModel
from studies.metrics import request_latencies
from studies.traces import Trace

#: TensorRT-LLM's ``trtllm-serve`` scheduler defaults (1.0): 8192 tokens per step, up to
#: 2048 sequences, and the GUARANTEED_NO_EVICT capacity policy, which admits a request
#: only when KV for its prompt and all of its output tokens is reserved. Its longest
#: sequence (``max_seq_len``) is kept apart from the step budget: ``server_max_seq_len``.
TRTLLM_DEFAULT = PolicyConfig(max_num_batched_tokens=8192, max_num_seqs=2048, enable_chunked_prefill=False,
                              gpu_memory_utilization=0.9, admission_mode="reservation")


class ClosedLoopError(ValueError):
    """A closed loop that cannot run: bad sizes, requests that never finish."""


def framework_config(framework: str, ctx: EngineContext) -> PolicyConfig:
    """The scheduler a measured run used: each framework's serving defaults on ``ctx``."""
    if framework in ("vllm", "sglang"):
        return preset(f"{framework}-default", ctx)
    if framework == "trtllm":
        return TRTLLM_DEFAULT
    raise ClosedLoopError(f"unknown framework {framework!r}; valid: vllm, sglang, trtllm")


def server_max_seq_len(framework: str, model: str, model_config=None) -> int | None:
    """The longest prompt + output a ``framework`` server of ``model`` accepts when the
    server keeps that limit apart from its step budget, for ``run_benchmark``'s
    ``max_seq_len``; None where the engine's own rule holds.

    trtllm-serve does: ``max_seq_len`` defaults to the model's ``max_position_embeddings``
    while ``max_num_tokens`` bounds one step, so without chunked prefill a prompt must fit
    one step but prompt + output may run past it (the engine's rule, vLLM's, would cap the
    sequence at the step budget: 8192-token prompts refused, 1024 -> 8192 runs cut at
    7168 outputs). vLLM and SGLang run chunked, where only ``max_model_len`` limits it.
    0: the model's context is unknown (as long as the KV pool holds)."""
    if framework != "trtllm":
        return None
    from costmodels.architecture import load_model

    try:
        return load_model(model, model_config).context_len
    except CostModelError:  # its cost model cannot be built either, and says why
        return 0


#: How a length ``range_ratio`` r spreads lengths around the asked length L: "centred",
#: uniform in [(1 - r) L, (1 + r) L] (``vllm bench serve --random-range-ratio``); "floor",
#: uniform in [r L, L] (``sglang.bench_serving`` and InferenceX's ``benchmark_serving.py``,
#: whose mean length is therefore (1 + r) L / 2, not L).
RANGE_STYLES = frozenset({"centred", "floor"})


@dataclass(frozen=True)
class BenchClient:
    """How the benchmark client drives the server (defaults: AIPerf in concurrency mode
    as aiconfigurator's benchmark script runs it; see the module docstring)."""

    requests_per_client: float = 10.0  # profiled requests = round(this * C)
    warmup_per_client: float = 2.0  # warm-up requests = round(this * C), never measured
    await_warmup: bool = True  # profiling starts once every warm-up response is in (a second burst)
    isl_stddev: float = 0.0  # tokens; prompt lengths ~ round(normal(isl, isl_stddev)), at least 1
    osl_stddev: float = 0.0
    range_ratio: float = 0.0  # > 0: lengths uniform within r of L instead, as range_style says
    range_style: str = "centred"  # "centred": [(1 - r) L, (1 + r) L]; "floor": [r L, L] (RANGE_STYLES)
    warmup_repeats_first: bool = False  # every warm-up request resends the first profiled prompt
    ramp_s: float = 0.0  # client k of a phase starts at k * ramp_s / C (0: every client at once)
    gap_s: float = 0.0  # from a response's last token to the client's next send
    ingress_s: float = 0.0  # from a send to the engine seeing the request (HTTP, tokenization, frontend); in TTFT
    jitter_s: float = 0.0  # mean of an exponential delay added to each send (client and network variability)
    seed: int = 100  # AIPerf --random-seed in aiconfigurator's script

    def __post_init__(self):
        for name in ("requests_per_client", "warmup_per_client", "isl_stddev", "osl_stddev", "range_ratio",
                     "ramp_s", "gap_s", "ingress_s", "jitter_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ClosedLoopError(f"BenchClient.{name} must be a finite number >= 0, got {value!r}")
        if self.range_ratio >= 1:
            raise ClosedLoopError(f"BenchClient.range_ratio must be < 1, got {self.range_ratio!r}")
        if self.range_style not in RANGE_STYLES:
            raise ClosedLoopError(f"BenchClient.range_style must be one of {sorted(RANGE_STYLES)}, "
                                  f"got {self.range_style!r}")
        if self.range_ratio > 0 and (self.isl_stddev > 0 or self.osl_stddev > 0):
            raise ClosedLoopError("BenchClient: give either range_ratio or isl/osl stddevs, not both")

    def counts(self, clients: int) -> tuple[int, int]:
        """(warm-up, profiled) request counts for ``clients`` clients."""
        warm, prof = int(round(self.warmup_per_client * clients)), int(round(self.requests_per_client * clients))
        if prof < 1:
            raise ClosedLoopError(f"no profiled request: requests_per_client {self.requests_per_client} x "
                                  f"{clients} clients rounds to 0")
        return warm, prof

    def lengths(self, n: int, isl: int, osl: int, n_warm: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Prompt and output lengths of the n requests in send order (seeded draws), the
        first ``n_warm`` of them warm-up."""
        rng = np.random.default_rng(self.seed)

        def draw(length, sd):
            if self.range_ratio > 0:
                r = self.range_ratio
                lo, hi = ((int(math.floor(length * (1 - r))), int(math.ceil(length * (1 + r))))
                          if self.range_style == "centred" else (int(length * r), length))
                return rng.integers(max(1, lo), hi + 1, n)
            if sd > 0:
                return np.maximum(1, np.rint(rng.normal(length, sd, n))).astype(np.int64)
            return np.full(n, int(length), dtype=np.int64)

        prompt, output = draw(isl, self.isl_stddev), draw(osl, self.osl_stddev)
        if self.warmup_repeats_first and 0 < n_warm < n:
            prompt[:n_warm], output[:n_warm] = prompt[n_warm], output[n_warm]
        return prompt, output

    def jitters(self, n: int) -> np.ndarray:
        """The send delay of each credit in issue order (seeded apart from the lengths)."""
        if self.jitter_s <= 0:
            return np.zeros(n)
        return np.random.default_rng([self.seed, 1]).exponential(self.jitter_s, n)


#: How each benchmark client a measured run may name (``costmodels.calibration.CLIENT_NAMES``)
#: departs from AIPerf as aiconfigurator's script runs it (``BenchClient()``). InferenceX's
#: ``benchmark_serving.py`` (``benchmarks/benchmark_lib.sh``: ``--random-range-ratio 0.8
#: --num-prompts 10C --max-concurrency C --num-warmups 2C --ignore-eos``) draws each prompt
#: and output length uniformly in [0.8 L, L] and sends its warm-up requests as copies of
#: the first prompt, awaiting them all before the measured phase; its counts are AIPerf's.
#: A variant sets the whole length distribution, so AIPerf's stddevs do not carry over.
CLIENT_VARIANTS = {
    "aiperf": {},
    "inferencex": {"range_ratio": 0.8, "range_style": "floor", "warmup_repeats_first": True,
                   "isl_stddev": 0.0, "osl_stddev": 0.0},
}


def client_for(name: str | None, bench: BenchClient) -> BenchClient:
    """``bench`` (the AIPerf client or a variant of it, such as one with an ingress delay)
    as the client ``name`` of a measured run drives the server (None: AIPerf)."""
    return replace(bench, **CLIENT_VARIANTS[name or "aiperf"])


#: The harness this module replaced: every client starts together and sends 4 requests
#: back to back; the first is dropped as start-up (no warm-up phase, no second burst).
LOCKSTEP = BenchClient(requests_per_client=3, warmup_per_client=1, await_warmup=False, seed=0)


@dataclass(frozen=True, eq=False)
class ClosedLoopResult:
    """One benchmark run: per request (in send order) its client, phase and times."""

    client: np.ndarray  # i8[n], the client (slot) that sent it
    profiled: np.ndarray  # bool[n], measured (False: warm-up)
    sent_s: np.ndarray  # f8[n], send time = arrival at the server
    first_token_s: np.ndarray
    finish_s: np.ndarray
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    result: SimResult  # the engine's outputs, rows in send order
    trace: Trace  # the requests as sent (arrivals = send times, drawn lengths)
    bench: BenchClient = field(default_factory=BenchClient)

    @property
    def mean_ttft_ms(self) -> float:
        """Mean TTFT over the profiled requests, as the benchmark reports it."""
        return float(np.mean(self.ttft_ms[self.profiled]))

    @property
    def mean_tpot_ms(self) -> float:
        """Mean TPOT ((E2E - TTFT) / (tokens - 1)) over the profiled requests with more than one token."""
        sel = self.profiled & (self.result.tokens_generated > 1)
        return float(np.mean(self.tpot_ms[sel])) if sel.any() else 0.0

    def in_flight(self, t: float) -> int:
        """Requests sent by ``t`` that had not finished by then (the concurrency the server sees)."""
        return int(np.sum((self.sent_s <= t) & (self.finish_s > t)))


def run_benchmark(cost_model: CostModel, config: PolicyConfig, clients: int, isl: int, osl: int,
                  bench: BenchClient | None = None, *, seed: int = 0, exact_steps: bool = False,
                  max_seq_len: int | None = None, acceptance: AcceptanceModel | None = None) -> ClosedLoopResult:
    """Simulate ``clients`` closed-loop clients sending ``isl``-token prompts for ``osl``
    output tokens, as ``bench`` (default ``BenchClient()``) drives them.

    Raises ClosedLoopError for bad sizes, when a request exceeds a sequence limit (naming
    it) or does not finish (e.g. it never fits the KV pool): every request runs in full or
    the run is an error. ``seed`` is the engine's seed (stochastic policies only); the
    length draws use ``bench.seed``. ``exact_steps`` runs the engine one step per call
    instead of up to the finish horizon (slower; the same run bit for bit).
    ``max_seq_len``: the server's longest sequence when it is kept apart from the step
    budget (``server_max_seq_len``); None: the engine's rule (``config.max_model_len``,
    capped at the step budget without chunked prefill). ``acceptance``: the drafter's
    when ``config`` speculates (``policies.speculative.AcceptanceModel``; None: its default).
    """
    bench = bench or BenchClient()
    placeholder, n_warm, client, sent, bufs, tenant_params = _simulate(cost_model, config, clients, isl, osl, bench,
                                                                        seed, exact_steps, max_seq_len, acceptance)
    trace = replace(placeholder, arrival_s=sent)
    result = engine.sim_result(trace, *bufs, tenant_params[:, fm.T_WEIGHT])
    lat = request_latencies(result, trace)
    profiled = np.arange(trace.n) >= n_warm
    return ClosedLoopResult(client=client, profiled=profiled, sent_s=sent, first_token_s=result.first_token_s,
                            finish_s=result.finish_s, ttft_ms=lat["ttft"], tpot_ms=lat["tpot"], result=result,
                            trace=trace, bench=bench)


def benchmark_means(cost_model: CostModel, config: PolicyConfig, clients: int, isl: int, osl: int,
                    bench: BenchClient | None = None, *, seed: int = 0, max_seq_len: int | None = None,
                    acceptance: AcceptanceModel | None = None) -> tuple[float, float]:
    """(mean TTFT ms, mean TPOT ms) of ``run_benchmark`` over the profiled requests,
    without building its result (a replay fit calls it thousands of times)."""
    bench = bench or BenchClient()
    placeholder, n_warm, _, sent, bufs, _ = _simulate(cost_model, config, clients, isl, osl, bench, seed,
                                                      max_seq_len=max_seq_len, acceptance=acceptance)
    out_i, out_f = bufs[0], bufs[1]
    prof = slice(n_warm, None)
    first, finish, n_out = out_f[O_FIRST_TOKEN, prof], out_f[O_FINISH, prof], out_i[O_GENERATED, prof]
    ttft = (first - sent[prof]) * 1e3
    many = n_out > 1
    tpot = (finish[many] - first[many]) / (n_out[many] - 1) * 1e3
    return float(ttft.mean()), float(tpot.mean()) if len(tpot) else 0.0


def _sequence_limit(config: PolicyConfig, max_seq_len: int | None) -> tuple[int, str] | None:
    """The longest prompt + output the server accepts short of the KV pool, and what sets
    it; None when only the KV pool does. ``max_seq_len`` None: the engine's rule
    (``policies.engine.new_replica``: ``max_model_len``, capped at the step budget without
    chunked prefill); else that (``server_max_seq_len``; 0: none)."""
    if max_seq_len is not None:
        return (max_seq_len, f"max_seq_len={max_seq_len} (the model's context length)") if max_seq_len else None
    limits = [(config.max_model_len, f"max_model_len={config.max_model_len}")] if config.max_model_len else []
    if not config.enable_chunked_prefill:
        limits.append((config.max_num_batched_tokens, f"the step budget max_num_batched_tokens="
                       f"{config.max_num_batched_tokens}, which caps a sequence without chunked prefill"))
    return min(limits) if limits else None


def _check_lengths(prompt: np.ndarray, output: np.ndarray, config: PolicyConfig, max_seq_len: int | None) -> None:
    """Refuse, naming the limit and its numbers, a run with a request the server would
    refuse or cut short: past the longest sequence, or (a server that keeps the sequence
    apart from the step budget) an unchunked prompt larger than one step."""
    limit = _sequence_limit(config, max_seq_len)
    i = int(np.argmax(prompt + output))
    if limit is not None and prompt[i] + output[i] > limit[0]:
        raise ClosedLoopError(f"a request of {prompt[i]} + {output[i]} tokens exceeds {limit[1]}")
    budget = config.max_num_batched_tokens
    if max_seq_len is not None and not config.enable_chunked_prefill and prompt.max() > budget:
        raise ClosedLoopError(f"a {prompt.max()}-token prompt exceeds the step budget max_num_batched_tokens="
                              f"{budget}, which must hold a whole prompt without chunked prefill")


def _check_finished(out_i, prompt, output, cost_model, config, cap):
    """Raise unless every request finished with all of its output tokens. ``_check_lengths``
    refused what a sequence limit would cut, so a request refused or cut short here met the
    KV pool, whose size the error gives."""
    state, reason, generated = out_i[O_STATE], out_i[O_REASON], out_i[O_GENERATED]
    bs = config.block_size
    pool = (f"the KV pool holds {cap * bs} tokens ({cap} blocks of {bs} at gpu_memory_utilization="
            f"{config.gpu_memory_utilization})")
    bad = np.flatnonzero(state != State.FINISHED)
    if len(bad):
        i = bad[0]
        raise ClosedLoopError(
            f"{len(bad)} of {len(state)} requests did not finish under {cost_model.name} "
            f"(first: state {State(state[i]).name}, reject reason {Reject(reason[i]).name}, {prompt[i]} + "
            f"{output[i]} tokens); {pool}")
    short = np.flatnonzero(generated < output)
    if len(short):
        i = short[0]
        raise ClosedLoopError(f"{len(short)} of {len(state)} requests were cut short under {cost_model.name} "
                              f"(first: {generated[i]} of {output[i]} output tokens after a {prompt[i]}-token "
                              f"prompt); {pool}, prompt and output included")


def _simulate(cost_model, config, clients, isl, osl, bench, seed, exact_steps=False, max_seq_len=None,
              acceptance=None):
    """The kernel run, checked (``_check_lengths``, ``_check_finished``): (placeholder
    trace, warm-up count, client and send time per request, the engine's output buffers,
    tenant params)."""
    for name, value in (("clients", clients), ("isl", isl), ("osl", osl)):
        if int(value) != value or value < 1:
            raise ClosedLoopError(f"{name} must be an integer >= 1, got {value!r}")
    clients, isl, osl = int(clients), int(isl), int(osl)
    n_warm, n_prof = bench.counts(clients)
    n = n_warm + n_prof
    prompt, output = bench.lengths(n, isl, osl, n_warm)
    placeholder = Trace(
        arrival_s=np.zeros(n), prompt_tokens=prompt, output_tokens=output, max_tokens=output.copy(),
        tenant=np.zeros(n, np.int32), priority=np.zeros(n, np.int32), slo_class=np.zeros(n, np.int32),
        deadline_s=np.full(n, np.nan), block_offsets=np.zeros(n + 1, np.int64), block_hashes=np.zeros(0, np.int64),
        source=f"closed-loop({clients} clients, {isl}->{osl} tokens)")
    cap, host = engine.validate(placeholder, cost_model, config)
    _check_lengths(prompt, output, config, max_seq_len)
    # -1: the replica keeps the engine's own limit
    max_len = -1 if max_seq_len is None else max_seq_len or cap * config.block_size
    tenant_params, class_params = engine.fairness_params(placeholder, config, None)
    st = engine.statics(placeholder, cost_model, [config], acceptance)
    tables = cost_model.tables
    # the shortest step the tables allow (one decode, or one prompt token): no step is shorter
    floor = min(step_seconds(tables, 1, 1, 1, 1.0, 0.0)[0], step_seconds(tables, 1, 1, 0, 0.0, 1.0)[0])
    bufs = [b[0] for b in engine.output_buffers(1, n, len(tenant_params))]
    # the most tokens a request gains in one step: a verify accepts every draft and adds one
    tokens_per_step = 1 + config.num_speculative_tokens if config.speculative_mode != "off" else 1
    client = np.full(n, -1, dtype=np.int64)
    sent = np.zeros(n)
    status = np.zeros(3, dtype=np.int64)
    _drive(st, tables, config.to_vector(), cap, host, cost_model.kv_bytes_per_token, cost_model.swap_bytes_per_s,
           seed, 0.05, engine.fast_forward_enabled(), tenant_params, class_params, clients, n_warm, n,
           bench.await_warmup, bench.ramp_s, bench.gap_s, bench.ingress_s, bench.jitters(n),
           0.0 if exact_steps or floor <= 0 else 0.999 * floor, max_len, tokens_per_step, client, sent, status,
           *bufs)
    if status[0] == _STALLED:
        raise ClosedLoopError(f"{clients} clients x ({isl} + {osl}) tokens: the engine made no progress "
                              f"(engine error {status[2]}) under {cost_model.name}")
    if status[0] != 0:
        raise RuntimeError(f"closed loop: internal error {status[0]} at request {status[1]}; please report this run")
    _check_finished(bufs[0], prompt, output, cost_model, config, cap)
    return placeholder, n_warm, client, sent, bufs, tenant_params


# status codes of _drive (status[0])
_OK, _LATE_FINISH, _STALLED = 0, 1, 2


@njit(cache=True, nogil=True)
def _drive(st, tables, cfg, cap, host, kv_bytes, swap_bw, seed, series_every, fast_forward, tenant_params,
           class_params, clients, n_warm, n_total, await_warm, ramp_s, gap_s, ingress_s, jitter, dt_floor, max_len,
           tokens_per_step, client, sent, status, out_i, out_f, out_counts, out_fcounts, series, out_cached,
           out_service, out_prefix):
    """The closed loop (``run_benchmark``): request r is the r-th sent, at ``sent[r]`` by
    ``client[r]``; it reaches the engine ``ingress_s`` later, which is its arrival there
    (``st.sf[S_ARRIVAL, r]``, written then). ``jitter[i]`` delays the i-th credit's send;
    ``dt_floor`` is a lower bound of any step's seconds (0: one engine step per call).
    ``max_len``: the longest prompt + output a request may reach (-1: the engine's limit);
    ``tokens_per_step``: the most tokens a request gains in one step.
    ``status``: (code, request, engine error). Fills the engine's output buffers."""
    rep = engine.new_replica(st, cfg, cap, host, kv_bytes, swap_bw, seed, series_every, fast_forward,
                             tenant_params, class_params, 0.0)
    if max_len >= 0:  # a server whose longest sequence is not its step budget (trtllm-serve)
        rep.g[MAX_LEN] = max_len
    arrival = st.sf[S_ARRIVAL]
    ri, rf = rep.ri, rep.rf
    waiting_on = np.full(clients, -1, dtype=np.int64)  # the request each client awaits
    pending = np.full(clients, np.inf)  # when each client's next request reaches the engine (inf: none)
    n_sent = 0
    issued = 0  # credits handed out (sent or pending)
    done = 0
    phase_end = n_warm if (await_warm and n_warm > 0) else n_total
    for k in range(min(clients, phase_end)):
        pending[k] = k * ramp_s / clients + ingress_s + jitter[issued]
        issued += 1
    guard = 0
    while done < n_total:
        guard += 1
        if guard > 100 * n_total + 10_000_000:
            status[0] = _STALLED
            return
        t = engine.clock(rep)
        if engine.outstanding(rep) == 0:
            t_next = np.inf
            for k in range(clients):
                t_next = min(t_next, pending[k])
            if t_next == np.inf:
                status[0] = _STALLED
                return
            t = max(t, t_next)
        while True:  # send what is due by t, in time order (ties: client order)
            k_min, t_min = -1, np.inf
            for k in range(clients):
                if pending[k] < t_min:
                    k_min, t_min = k, pending[k]
            if k_min < 0 or t_min > t:
                break
            arrival[n_sent] = t_min
            sent[n_sent] = t_min - ingress_s  # the jitter delays the send itself
            client[n_sent] = k_min
            engine.deliver(rep, n_sent, t_min)
            waiting_on[k_min] = n_sent
            pending[k_min] = np.inf
            n_sent += 1
        # how far the engine may run with no request finishing and no send due
        fewest = np.iinfo(np.int64).max
        for k in range(clients):
            r = waiting_on[k]
            if r >= 0:
                s = ri[STATUS, r]
                if s == RUNNING or s == WAITING:
                    fewest = min(fewest, ri[TARGET, r] - ri[GENERATED, r])
                elif s != DONE:
                    fewest = 1  # in the inbox: admitted at the next boundary
        steps = (fewest + tokens_per_step - 1) // tokens_per_step  # the fewest steps until one can finish
        limit = t + (steps - 1) * dt_floor if fewest < np.iinfo(np.int64).max else np.inf
        for k in range(clients):
            limit = min(limit, pending[k])
        if limit > t:
            engine.advance(rep, st, tables, cfg, limit)
        else:
            engine.advance_through(rep, st, tables, cfg, t)
        if rep.g[ERROR] != 0:
            status[0] = _STALLED
            status[2] = rep.g[ERROR]
            return
        now = engine.clock(rep)
        for k in range(clients):
            r = waiting_on[k]
            if r < 0 or ri[STATUS, r] != DONE:
                continue
            waiting_on[k] = -1
            done += 1
            f = rf[FINISH, r]
            if ri[STATE, r] == 0 and f != now:  # a finish the loop stepped past: its client sent late
                status[0] = _LATE_FINISH
                status[1] = r
                return
            if issued < phase_end:
                pending[k] = max(f, now) + gap_s + ingress_s + jitter[issued]
                issued += 1
        if done == phase_end and phase_end < n_total:  # warm-up over: the profiling phase bursts
            phase_end = n_total
            now = engine.clock(rep)
            for k in range(min(clients, n_total - issued)):
                pending[k] = now + gap_s + k * ramp_s / clients + ingress_s + jitter[issued]
                issued += 1
    engine.write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)


# ======================================================================================
# calibration by replay: fit the cost model's terms so the closed loop reproduces the runs
# ======================================================================================
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
FIT_TERMS = ("overhead_s", "prefill_scale", "decode_scale", "prefill_step_s")
FIT_LOWER = np.array([0.0, 0.2, 0.2, 0.0])
FIT_UPPER = np.array([50.0, 10.0, 5.0, 500.0])
#: How close to a limit, as a share of the range, counts as on it.
PINNED_TOLERANCE = 1e-3


def pinned_terms(x) -> list[str]:
    """The terms of a replay fit ``x`` (``FIT_TERMS`` order, fit units) that ended on a
    limit of their search range other than a physical 0 ms floor: the least-squares
    optimum lies beyond it, so the model could not reproduce the runs with a plausible
    value, and the term's figure is the limit's, not a measurement."""
    x = np.asarray(x, dtype=float)
    lo, hi = FIT_LOWER[:x.size], FIT_UPPER[:x.size]
    near = PINNED_TOLERANCE * (hi - lo)
    on_floor = (lo > 0) & (x - lo <= near)
    return [FIT_TERMS[i] for i in np.flatnonzero(on_floor | (hi - x <= near))]


def warmup() -> None:
    """Compile (or load from the cache) the closed-loop kernel for the types
    ``servetune validate`` and the replay calibration pass it: a tiny run of each
    framework's scheduler shape (``servetune warmup`` calls it)."""
    cost = CostModel.synthetic(kv_capacity_tokens=4096)
    bench = BenchClient(requests_per_client=1, warmup_per_client=1)
    for config, max_seq_len in ((preset("vllm-default", _WARMUP_CTX), None), (TRTLLM_DEFAULT, 4096)):
        benchmark_means(cost, config.replace(max_model_len=0), 2, 16, 4, bench, max_seq_len=max_seq_len)


_WARMUP_CTX = EngineContext("h100", 80.0)


def server_config(framework: str, ctx: EngineContext, overrides: dict | None = None) -> PolicyConfig:
    """``framework_config`` with a fitted measured-server override (``SERVER_CANDIDATES``);
    a limit relative to the run's clients is applied per run (``for_clients``)."""
    config = framework_config(framework, ctx)
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
    (``optimizer.inferencex.known_server``), else the ``fitted`` measured server for its clients."""
    known = known_server(row)
    if known is not None:
        return framework_config(framework, ctx).replace(**known.overrides), known.acceptance
    return for_clients(server_config(framework, ctx, fitted), fitted, row["batch_size"]), None


def _mape(pred: np.ndarray, measured: np.ndarray) -> float:
    ok = np.isfinite(pred)
    return float(np.mean(np.abs(pred[ok] / measured[ok] - 1.0)) * 100.0) if ok.any() else math.nan


class ReplayRows:
    """Measured runs (``costmodels.load_runs`` rows) ready to replay under trial cost-model
    terms: each row's uncalibrated cost model, engine context, longest sequence
    (``server_max_seq_len``) and measurements."""

    def __init__(self, runs, bench: BenchClient | None = None, builder=None):
        from costmodels import build
        from optimizer.targets import context_of

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
                                     gemm_dtype=r["gemm_dtype"], kv_dtype=r["gemm_dtype"], calibration=False,
                                     moe_ep_size=r["moe_ep_size"], attention_dp_size=r["attention_dp_size"])
            self._cost.append(built[key])
            self._ctx.append(context_of(built[key], r["gpu"], context_len=0, tp=r["tp"]))

    def predict(self, overhead_s: float, prefill_scale: float, decode_scale: float, server: dict | None = None,
                scale: float = 1.0, prefill_step_s: float = 0.0) -> np.ndarray:
        """(n, 2) mean TTFT and TPOT (ms) of every row under these terms; NaN where a run
        cannot be simulated (it never fits the KV pool)."""
        out = np.full((len(self.rows), 2), np.nan)
        swapped: dict[int, CostModel] = {}
        for i, (r, cost, ctx, seq, bench) in enumerate(zip(self.rows, self._cost, self._ctx, self._seq, self._bench,
                                                           strict=True)):
            if id(cost) not in swapped:
                swapped[id(cost)] = replace(cost, tables=cost.tables._replace(
                    overhead_s=overhead_s, scale=scale, prefill_scale=prefill_scale, decode_scale=decode_scale,
                    prefill_step_s=prefill_step_s))
            try:
                config, acceptance = run_server(r["framework"], ctx, server, r)
                out[i] = benchmark_means(swapped[id(cost)], config, r["batch_size"], r["isl"], r["osl"], bench,
                                         max_seq_len=seq, acceptance=acceptance)
            except ClosedLoopError:
                pass
        return out


def fit_replay(runs, *, bench: BenchClient | None = None, start: tuple[float, float] | None = None,
               ttft_weight: float = TTFT_WEIGHT, residual_scale: float = RESIDUAL_SCALE,
               candidates: tuple[dict, ...] | None = None, builder=None, max_nfev: int = 40) -> dict:
    """Fit ``overhead_s``, ``prefill_scale``, ``decode_scale`` and, for a framework of
    ``PREFILL_STEP_FRAMEWORKS``, ``prefill_step_s`` (else 0; ``scale`` 1) to ``runs`` (one framework's rows) by replaying every run as the benchmark client drove it
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
    terms = 4 if framework in PREFILL_STEP_FRAMEWORKS else 3
    lo, hi = FIT_LOWER[:terms], FIT_UPPER[:terms]
    x0 = np.clip([scale0 * overhead0 * 1e3, scale0, scale0, PREFILL_STEP_START_MS][:terms],
                 [0.0, 0.21, 0.21, 0.0][:terms], [49.0, 9.9, 4.9, 499.0][:terms])  # inside the range

    def predict(x, server):
        return rows.predict(x[0] * 1e-3, x[1], x[2], server, prefill_step_s=x[3] * 1e-3 if terms > 3 else 0.0)

    def residuals(x, server):
        pred = predict(x, server)
        res = np.concatenate([np.log(pred[:, 1] / rows.tpot_ms), ttft_weight * np.log(pred[:, 0] / rows.ttft_ms)])
        return np.where(np.isfinite(res), res, 3.0)

    best = None
    for server in candidates:
        fit = least_squares(residuals, x0, args=(server,), bounds=(lo, hi), loss="soft_l1", f_scale=residual_scale,
                            diff_step=0.03, x_scale=[1.0, 0.1, 0.1, 10.0][:terms], max_nfev=max_nfev)
        if best is None or fit.cost < best[0].cost:
            best = (fit, server)
    fit, server = best
    before = rows.predict(rows._cost[0].tables.overhead_s, 1.0, 1.0, None)
    after = predict(fit.x, server)
    return {
        "overhead_s": float(fit.x[0] * 1e-3), "scale": 1.0, "prefill_scale": float(fit.x[1]),
        "decode_scale": float(fit.x[2]), "prefill_step_s": float(fit.x[3] * 1e-3) if terms > 3 else 0.0,
        "measured_server": dict(server), "fit": "replay", "pinned_terms": pinned_terms(fit.x),
        "step_source": step_source(rows._cost[0]), **fitted_routing(rows._cost),
        "tpot_mape_before": _mape(before[:, 1], rows.tpot_ms), "ttft_mape_before": _mape(before[:, 0], rows.ttft_ms),
        "tpot_mape_after": _mape(after[:, 1], rows.tpot_ms), "ttft_mape_after": _mape(after[:, 0], rows.ttft_ms),
    }


def calibrate_replay(runs, *, bench: BenchClient | None = None, ttft_weight: float = TTFT_WEIGHT,
                     residual_scale: float = RESIDUAL_SCALE, builder=None, keys: list[tuple] | None = None,
                     max_nfev: int = 40) -> list[dict]:
    """Calibration entries (``costmodels.calibration`` format, for ``build(calibration=...)``)
    fitted by replay (``fit_replay``): one per (GPU, framework, model, GEMM dtype, parallel
    path) across its layouts of that path, then one pooled per (GPU, framework, GEMM dtype,
    parallel path) (``model`` "*") for models without their own, the fallback chain
    ``apply_calibration`` walks (``costmodels.calibration.match_entry``: setup, model,
    family, pooled, other GPU, another path last). The steady-state formula fit
    (``costmodels.calibrate``) gives the starting point. ``keys`` limits the fit to those
    (gpu, framework, model, gemm_dtype, path) entries (model "*" for a pooled one): a
    leave-one-out fold needs only the entry its held-out setup falls back to. A pooled fit
    over the same runs as a model's entry reuses its result."""
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
                                                    builder=builder, max_nfev=max_nfev)
            family = "" if pooled else entry_family({"model": model})
            entries.append({"gpu": gpu, "framework": fw, "model": model, "family": family, "gemm_dtype": dtype,
                            "kv_dtype": dtype, "path": path,
                            "tp": sorted(set(group["tp"].to_list())),
                            "layouts": fitted_layouts(group.select(list(SETUP)).iter_rows()), "n_runs": len(group), **fitted,
                            "error": {"in_sample_tpot_mape": fitted["tpot_mape_after"],
                                      "in_sample_ttft_mape": fitted["ttft_mape_after"], "out_of_sample": None}})
    return entries
