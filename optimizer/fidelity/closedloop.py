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
the server (``CLIENT_VARIANTS``: InferenceX's rows draw their lengths).

Facts and defaults (``BenchClient``): AIPerf's burst start and its one-credit-per-finish
rule are its documented concurrency mode; the warm-up count 2C, the seed 100 and zero
length stddev are those of aiconfigurator's benchmark scripts (its ``eval`` runner and
``bench_run.sh``); the profiled count differs between them (10C in the ``eval`` runner,
50C in ``bench_run.sh``) and the CSV does not record it, so ``requests_per_client``
defaults to 10 and is a parameter (10 fits the rows better than 50: ``benchmarks/fidelity.py``).
``LOCKSTEP`` is the previous harness (4 waves, continuous, wave 0 dropped), kept for
comparison; it reproduces that harness's fixed point exactly.

Calibration by replay, which fits the cost model so this loop reproduces measured runs,
is ``optimizer.fidelity.replayfit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from numba import njit, typed

from costmodels.costmodel import CostModel, CostModelError
from costmodels.steptable import linear_step_seconds, step_seconds
from policies import engine
from policies import fairness as fm
from policies.config import PolicyConfig
from policies.engine import O_FINISH, O_FIRST_TOKEN, O_GENERATED, O_REASON, O_STATE
from policies.engines import EngineContext, preset
from policies.engines.vllm import async_by_default
from policies.kernel_state import (
    C_ERROR,
    C_N_SAMPLES,
    C_PEAK_STEP,
    DONE,
    ERROR,
    F_BUSY,
    F_END,
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


def framework_config(framework: str, ctx: EngineContext, version: str | None = None) -> PolicyConfig:
    """The scheduler a measured run used: each framework's serving defaults on ``ctx``, as
    its ``version`` set them (None: the pinned version's); a vLLM before async scheduling
    was the default ran the synchronous loop."""
    if framework == "vllm":
        config = preset("vllm-default", ctx)
        return config if async_by_default(version) else config.replace(async_scheduling=False)
    if framework == "sglang":
        return preset("sglang-default", ctx)
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


#: How each benchmark client a measured run may name (``costmodels.runs.CLIENT_NAMES``)
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
                  max_seq_len: int | None = None, acceptance: AcceptanceModel | None = None,
                  ranks: int = 1) -> ClosedLoopResult:
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
    ``ranks`` > 1: the server is an attention-DP instance of that many ranks (``cost_model``
    one rank's), stepping together, the clients spread over them in turn; the result's
    counters add the ranks' and its series is the first rank's.
    """
    bench = bench or BenchClient()
    placeholder, n_warm, client, sent, bufs, tenant_params = _simulate(cost_model, config, clients, isl, osl, bench,
                                                                        seed, exact_steps, max_seq_len, acceptance,
                                                                        ranks)
    trace = replace(placeholder, arrival_s=sent)
    result = engine.sim_result(trace, *bufs, tenant_params[:, fm.T_WEIGHT])
    lat = request_latencies(result, trace)
    profiled = np.arange(trace.n) >= n_warm
    return ClosedLoopResult(client=client, profiled=profiled, sent_s=sent, first_token_s=result.first_token_s,
                            finish_s=result.finish_s, ttft_ms=lat["ttft"], tpot_ms=lat["tpot"], result=result,
                            trace=trace, bench=bench)


def benchmark_means(cost_model: CostModel, config: PolicyConfig, clients: int, isl: int, osl: int,
                    bench: BenchClient | None = None, *, seed: int = 0, max_seq_len: int | None = None,
                    acceptance: AcceptanceModel | None = None, ranks: int = 1) -> tuple[float, float]:
    """(mean TTFT ms, mean TPOT ms) of ``run_benchmark`` over the profiled requests,
    without building its result (a replay fit calls it thousands of times)."""
    bench = bench or BenchClient()
    placeholder, n_warm, _, sent, bufs, _ = _simulate(cost_model, config, clients, isl, osl, bench, seed,
                                                      max_seq_len=max_seq_len, acceptance=acceptance, ranks=ranks)
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
              acceptance=None, ranks=1):
    """The kernel run, checked (``_check_lengths``, ``_check_finished``): (placeholder
    trace, warm-up count, client and send time per request, the engine's output buffers,
    tenant params)."""
    for name, value in (("clients", clients), ("isl", isl), ("osl", osl), ("ranks", ranks)):
        if int(value) != value or value < 1:
            raise ClosedLoopError(f"{name} must be an integer >= 1, got {value!r}")
    clients, isl, osl, ranks = int(clients), int(isl), int(osl), int(ranks)
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
    # the shortest step the tables allow (one decode, or one prompt token): no step is shorter;
    # ranks stepping together read the token-linear ops at their mean (policies.engine.lockstep)
    floor = min(step_seconds(tables, 1, 1, decode, decode, 1 - decode)[0] - linear_step_seconds(tables, 1, decode)
                + linear_step_seconds(tables, 1 / ranks, decode / ranks) for decode in (1, 0))
    bufs = [b[0] for b in engine.output_buffers(1, n, len(tenant_params))]
    # the most tokens a request gains in one step: a verify accepts every draft and adds one
    tokens_per_step = 1 + config.num_speculative_tokens if config.speculative_mode != "off" else 1
    client = np.full(n, -1, dtype=np.int64)
    sent = np.zeros(n)
    status = np.zeros(3, dtype=np.int64)
    _drive(st, tables, config.to_vector(), cap, host, cost_model.kv_bytes_per_token, cost_model.swap_bytes_per_s,
           seed, 0.05, engine.fast_forward_enabled(), tenant_params, class_params, clients, n_warm, n,
           bench.await_warmup, bench.ramp_s, bench.gap_s, bench.ingress_s, bench.jitters(n),
           0.0 if exact_steps or floor <= 0 else 0.999 * floor, max_len, tokens_per_step, ranks, client, sent,
           status, *bufs)
    if status[0] == _STALLED:
        raise ClosedLoopError(f"{clients} clients x ({isl} + {osl}) tokens on {ranks} rank(s): the engine made no "
                              f"progress (engine error {status[2]}) under {cost_model.name}")
    if status[0] != 0:
        raise RuntimeError(f"closed loop: internal error {status[0]} at request {status[1]}; please report this run")
    _check_finished(bufs[0], prompt, output, cost_model, config, cap)
    return placeholder, n_warm, client, sent, bufs, tenant_params


# status codes of _drive (status[0])
_OK, _LATE_FINISH, _STALLED = 0, 1, 2


@njit(cache=True, nogil=True)
def _drive(st, tables, cfg, cap, host, kv_bytes, swap_bw, seed, series_every, fast_forward, tenant_params,
           class_params, clients, n_warm, n_total, await_warm, ramp_s, gap_s, ingress_s, jitter, dt_floor, max_len,
           tokens_per_step, ranks, client, sent, status, out_i, out_f, out_counts, out_fcounts, series, out_cached,
           out_service, out_prefix):
    """The closed loop (``run_benchmark``): request r is the r-th sent, at ``sent[r]`` by
    ``client[r]``; it reaches the engine ``ingress_s`` later, which is its arrival there
    (``st.sf[S_ARRIVAL, r]``, written then). ``jitter[i]`` delays the i-th credit's send;
    ``dt_floor`` is a lower bound of any step's seconds (0: one engine step per call).
    ``max_len``: the longest prompt + output a request may reach (-1: the engine's limit);
    ``tokens_per_step``: the most tokens a request gains in one step. ``ranks`` > 1: the
    engine is an attention-DP instance of that many ranks stepping together
    (``engine.advance_group``), client k sending to rank k mod ranks.
    ``status``: (code, request, engine error). Fills the engine's output buffers."""
    reps = typed.List()
    nodes = typed.List()
    for _ in range(ranks):
        rep = engine.new_replica(st, cfg, cap, host, kv_bytes, swap_bw, seed, series_every,
                                 fast_forward and ranks == 1, tenant_params, class_params, 0.0)
        if max_len >= 0:  # a server whose longest sequence is not its step budget (trtllm-serve)
            rep.g[MAX_LEN] = max_len
        reps.append(rep)
        nodes.append((engine.borrow_replica(rep), engine.borrow_statics(st), engine.borrow_tables(tables)))
    arrival = st.sf[S_ARRIVAL]
    lead = reps[0]
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
        t = engine.clock(lead)
        outstanding = 0
        for j in range(ranks):
            outstanding += engine.outstanding(reps[j])
        if outstanding == 0:
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
            engine.deliver(reps[k_min % ranks], n_sent, t_min)
            waiting_on[k_min] = n_sent
            pending[k_min] = np.inf
            n_sent += 1
        # how far the engine may run with no request finishing and no send due
        fewest = np.iinfo(np.int64).max
        for k in range(clients):
            r = waiting_on[k]
            if r >= 0:
                ri = reps[k % ranks].ri
                s = ri[STATUS, r]
                if s == RUNNING or s == WAITING:
                    fewest = min(fewest, ri[TARGET, r] - ri[GENERATED, r])
                elif s != DONE:
                    fewest = 1  # in the inbox: admitted at the next boundary
        steps = (fewest + tokens_per_step - 1) // tokens_per_step  # the fewest steps until one can finish
        limit = t + (steps - 1) * dt_floor if fewest < np.iinfo(np.int64).max else np.inf
        for k in range(clients):
            limit = min(limit, pending[k])
        if ranks > 1:
            engine.advance_group(nodes, 0, ranks, cfg, max(limit, t), limit <= t)
        elif limit > t:
            engine.advance(lead, st, tables, cfg, limit)
        else:
            engine.advance_through(lead, st, tables, cfg, t)
        for j in range(ranks):
            if reps[j].g[ERROR] != 0:
                status[0] = _STALLED
                status[2] = reps[j].g[ERROR]
                return
        now = engine.clock(lead)
        for k in range(clients):
            r = waiting_on[k]
            ri, rf = reps[k % ranks].ri, reps[k % ranks].rf
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
            now = engine.clock(lead)
            for k in range(min(clients, n_total - issued)):
                pending[k] = now + gap_s + k * ramp_s / clients + ingress_s + jitter[issued]
                issued += 1
    for k in range(len(nodes)):
        engine.drain_pipeline(nodes[k][0], st)  # the run is over: requests that ended with the last step leave
    engine.write_outputs(lead, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)
    if ranks > 1:
        _add_ranks(reps, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)


@njit(cache=True, nogil=True)
def _add_ranks(reps, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix):
    """Ranks 1.. of a group into outputs rank 0 wrote: their requests' rows, and their
    counters added (the instance's steps, tokens and KV pools are the ranks' sums; its
    error and largest step the worst rank's); the series stays rank 0's."""
    counts, fcounts = np.zeros_like(out_counts), np.zeros_like(out_fcounts)
    service, prefix = np.zeros_like(out_service), np.zeros_like(out_prefix)
    scratch = np.zeros_like(series)
    for j in range(1, len(reps)):
        engine.write_outputs(reps[j], out_i, out_f, counts, fcounts, scratch, out_cached, service, prefix)
        for c in range(counts.shape[0]):
            if c == C_ERROR or c == C_PEAK_STEP:
                out_counts[c] = max(out_counts[c], counts[c])
            elif c != C_N_SAMPLES:
                out_counts[c] += counts[c]
        out_fcounts[F_BUSY] += fcounts[F_BUSY]
        out_fcounts[F_END] = max(out_fcounts[F_END], fcounts[F_END])
        out_service += service
        out_prefix += prefix


def warmup() -> None:
    """Compile (or load from the cache) the closed-loop kernel for the types
    ``servetune validate`` and the replay calibration pass it: a tiny run of each
    framework's scheduler shape (``servetune warmup`` calls it)."""
    cost = CostModel.synthetic(kv_capacity_tokens=4096)
    bench = BenchClient(requests_per_client=1, warmup_per_client=1)
    for config, max_seq_len in ((preset("vllm-default", _WARMUP_CTX), None), (TRTLLM_DEFAULT, 4096)):
        benchmark_means(cost, config.replace(max_model_len=0), 2, 16, 4, bench, max_seq_len=max_seq_len)


_WARMUP_CTX = EngineContext("h100", 80.0)
