"""How long scoring a run takes, against a per-request Python loop measured in the same run.

The baseline is what ``vllm bench serve`` does: loop over requests, compute TTFT / TPOT /
E2E and test each bound. Both score the same synthetic 20k-request result; the script
checks they agree on the good count, then prints ms per score and the speed-up.

    python benchmarks/score_speed.py [--requests 20000] [--repeat 50]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from policies.result import Reject, SimResult, State
from studies.metrics import score
from studies.slo import SLOClass, SLOSet
from studies.traces import Trace


def synthetic_run(n: int, seed: int = 0) -> tuple[Trace, SimResult, SLOSet]:
    """A plausible mixed outcome: most finish, some rejected, timed out or cancelled."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(0.2, n))
    generated = rng.integers(1, 800, n)
    state = rng.choice([State.FINISHED, State.REJECTED, State.TIMED_OUT, State.CANCELLED],
                       p=[0.85, 0.08, 0.04, 0.03], size=n).astype(np.int8)
    queue = rng.exponential(0.3, n)
    first = arrival + queue + rng.exponential(0.2, n)
    finish = first + generated * rng.uniform(0.01, 0.06, n)
    started = (state == State.FINISHED) | (state == State.TIMED_OUT)
    first = np.where(started, first, np.nan)
    generated = np.where(started, generated, 0)
    trace = Trace(
        arrival_s=arrival, prompt_tokens=rng.integers(10, 4000, n), output_tokens=generated,
        max_tokens=np.full(n, 4096), tenant=rng.integers(0, 4, n), priority=np.zeros(n),
        slo_class=rng.integers(0, 2, n), deadline_s=np.full(n, np.nan), block_offsets=np.zeros(n + 1),
        block_hashes=np.zeros(0), tenant_names=("a", "b", "c", "d"), slo_class_names=("chat", "batch"),
    )
    result = SimResult(
        state=state, reject_reason=np.where(state == State.REJECTED, Reject.QUEUE_FULL, 0).astype(np.int8),
        first_token_s=first, finish_s=finish, tokens_generated=generated,
        preemptions=rng.integers(0, 2, n).astype(np.int32), cached_prompt_tokens=np.zeros(n, np.int64),
        queue_s=np.where(state == State.REJECTED, np.nan, queue), replica=np.zeros(n, np.int32),
        steps=0, busy_s=0.0, prefill_tokens_computed=0, out_of_range_steps=0,
        kv_capacity_blocks=1000, kv_peak_blocks=900, series_t=np.zeros(0),
        series_kv_blocks=np.zeros(0), series_running=np.zeros(0), series_waiting=np.zeros(0),
    )
    slos = SLOSet((SLOClass("chat", ttft_ms=1000, tpot_ms=40, weight=2.0),
                   SLOClass("batch", e2el_ms=30_000, weight=1.0)))
    return trace, result, slos


def loop_good_count(trace: Trace, result: SimResult, slos: SLOSet) -> int:
    """The baseline: one request at a time, as vLLM bench's calculate_metrics does."""
    good = 0
    for i in range(trace.n):
        if result.state[i] != State.FINISHED:
            continue
        ttft = (result.first_token_s[i] - trace.arrival_s[i]) * 1e3
        e2el = (result.finish_s[i] - trace.arrival_s[i]) * 1e3
        n = result.tokens_generated[i]
        tpot = (e2el - ttft) / (n - 1) if n > 1 else 0.0
        bounds = slos.lookup(trace.slo_class_names[trace.slo_class[i]]).bounds_ms
        if all(math.isinf(b) or m <= b for m, b in zip((ttft, tpot, e2el), bounds, strict=True)):
            good += 1
    return good


def best_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    trace, result, slos = synthetic_run(args.requests)
    report = score(result, trace, slos)  # warm-up
    baseline_good = loop_good_count(trace, result, slos)
    assert report.n_good == baseline_good, (report.n_good, baseline_good)
    full_ms = best_ms(lambda: score(result, trace, slos), args.repeat)
    loop_ms = best_ms(lambda: loop_good_count(trace, result, slos), max(args.repeat // 10, 3))
    print(f"requests scored:            {trace.n:,} ({report.n_good:,} good)")
    print(f"score() full report:        {full_ms:8.2f} ms (best of {args.repeat})")
    print(f"baseline loop, good only:   {loop_ms:8.2f} ms")
    print(f"full report vs baseline:    {loop_ms / full_ms:8.1f}x faster")


if __name__ == "__main__":
    main()
