"""Engine speed: full replays of the real traces with the vLLM default preset.

Prints, per trace, simulated requests per wall second, steps per second and ms per full
replay (best of ``--repeats`` after warm-up), with fast-forward on and prefix caching
off, and the ratio against a baseline measured in the same run: the same kernel stepping
one by one (``SERVETUNE_ENGINE_FAST_FORWARD=0``), whose results must be identical. It
also drives the resumable replica as a fleet does (advance to each arrival, then deliver
it; ``replay_event_by_event``) and prints its cost relative to ``simulate``, with the same
results. Also times ``simulate_many`` over 8 configs. Target: < 50 ms per Azure conv
replay on one core.
On traces with prefix hashes (Mooncake) it also replays with prefix caching on (the
preset's default) and prints the ratio to caching off (target: at most 2x) with the hit
rate and prefill saved.

    python benchmarks/engine_speed.py [--model meta-llama/Llama-3.1-8B] [--gpu h100] [--rate-scale 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import build  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies import engine  # noqa: E402
from policies.engines import preset  # noqa: E402
from policies.kernel_state import S_ARRIVAL  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
TRACES = {
    "azure-conv": ("traces/azure2023/AzureLLMInferenceTrace_conv.csv", "azure"),
    "mooncake-conversation": ("traces/mooncake/conversation_trace.jsonl", "mooncake"),
}


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = np.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


@njit(cache=True, nogil=True)
def replay_event_by_event(st, tables, cfg, cap, host, kv_bytes, swap_bw, every, tenant_params, class_params, out_i,
                          out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix):
    """``engine.simulate_kernel`` driven as a fleet drives a replica: advance to each
    arrival, then deliver it (one ``advance`` call per request)."""
    arrival = st.sf[S_ARRIVAL]
    rep = engine.new_replica(st, cfg, cap, host, kv_bytes, swap_bw, 0, every, True, tenant_params, class_params,
                             arrival[0])
    # borrowed once, as the fleet holds its replicas (rep, st and tables outlive them)
    b_rep, b_st, b_tables = engine.borrow_replica(rep), engine.borrow_statics(st), engine.borrow_tables(tables)
    for r in range(arrival.shape[0]):
        engine.advance(b_rep, b_st, b_tables, cfg, arrival[r])
        engine.deliver(b_rep, r, arrival[r])
    engine.advance(b_rep, b_st, b_tables, cfg, np.inf)
    engine.write_outputs(rep, out_i, out_f, out_counts, out_fcounts, series, out_cached, out_service, out_prefix)


def timed_event_by_event(trace, cost, config, repeats: int):
    """Best time and result of ``replay_event_by_event`` (the same inputs as ``simulate``)."""
    cap, host = engine.validate(trace, cost, config)
    tenant_params, class_params = engine.fairness_params(trace, config, None)

    def once():
        bufs = engine.output_buffers(1, trace.n, len(tenant_params))
        replay_event_by_event(engine.statics(trace, cost, [config]), cost.tables, config.to_vector(), cap, host,
                              cost.kv_bytes_per_token, cost.swap_bytes_per_s, engine.default_series_every(trace),
                              tenant_params, class_params, *(b[0] for b in bufs))
        return engine.sim_result(trace, *(b[0] for b in bufs), tenant_params[:, 0])

    once()  # compile
    return best_of(once, repeats)


def timed_replay(trace, cost, config, fast_forward: bool, repeats: int):
    os.environ["SERVETUNE_ENGINE_FAST_FORWARD"] = "1" if fast_forward else "0"
    try:
        return best_of(lambda: engine.simulate(trace, cost, config), repeats)
    finally:
        os.environ.pop("SERVETUNE_ENGINE_FAST_FORWARD", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival-rate multiplier (1 = as recorded)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"shared data not found at {SHARED}; set SERVETUNE_SHARED")

    cost = build(args.model, args.gpu)
    config = preset("vllm-default", engine_context(args.model, args.gpu)).replace(enable_prefix_caching=False)
    t0 = time.perf_counter()
    engine.warmup()
    print(f"cost model: {cost.name} ({cost.source}); preset vllm-default on {args.gpu}; "
          f"warm-up {time.perf_counter() - t0:.1f} s; rate x{args.rate_scale:g}")
    for label, (rel, fmt) in TRACES.items():
        trace = load_trace(SHARED / rel, fmt)
        if args.rate_scale != 1.0:
            trace = scale_rate(trace, factor=args.rate_scale)
        engine.simulate(trace, cost, config)  # compile for this trace's array types
        fast_s, fast = timed_replay(trace, cost, config, True, args.repeats)
        slow_s, slow = timed_replay(trace, cost, config, False, max(1, args.repeats // 2))
        identical = all(np.array_equal(getattr(fast, k), getattr(slow, k), equal_nan=True)
                        for k in ("state", "first_token_s", "finish_s", "tokens_generated", "preemptions"))
        print(f"{label}: {trace.n} requests, {fast.steps} steps, {fast.preemptions.sum()} preemptions, "
              f"{np.mean(fast.state == 0):.1%} finished")
        print(f"  fast-forward   : {fast_s * 1e3:8.1f} ms/replay  {trace.n / fast_s:12,.0f} req/s  "
              f"{fast.steps / fast_s:14,.0f} steps/s")
        print(f"  step-by-step   : {slow_s * 1e3:8.1f} ms/replay  {trace.n / slow_s:12,.0f} req/s  "
              f"{slow.steps / slow_s:14,.0f} steps/s")
        print(f"  speed-up {slow_s / fast_s:.1f}x; results identical: {identical}")
        events_s, events = timed_event_by_event(trace, cost, config, args.repeats)
        same = all(np.array_equal(getattr(fast, k), getattr(events, k), equal_nan=True)
                   for k in ("state", "first_token_s", "finish_s", "tokens_generated", "preemptions"))
        print(f"  event by event : {events_s * 1e3:8.1f} ms/replay ({events_s / fast_s:.2f}x simulate; one advance "
              f"per arrival); results identical: {same}")
        if trace.block_hashes.size:
            cached_cfg = config.replace(enable_prefix_caching=True)
            engine.simulate(trace, cost, cached_cfg)
            on_s, on = timed_replay(trace, cost, cached_cfg, True, args.repeats)
            print(f"  prefix caching : {on_s * 1e3:8.1f} ms/replay on vs {fast_s * 1e3:.1f} ms off "
                  f"({on_s / fast_s:.2f}x; target <= 2x); hit {on.prefix_hit_tokens / max(on.prefix_query_tokens, 1):.1%} "
                  f"of prompt tokens looked up, prefill {fast.prefill_tokens_computed:,} -> "
                  f"{on.prefill_tokens_computed:,} tokens, {on.prefill_time_saved_s:,.0f} s of prefill saved, "
                  f"{on.prefix_evictions:,} evictions")
    configs = [config.replace(max_num_batched_tokens=b, max_num_seqs=s)
               for b in (2048, 4096, 8192, 16384) for s in (256, 1024)]
    trace = load_trace(SHARED / TRACES["azure-conv"][0], "azure")
    engine.simulate_many(trace, cost, configs)
    many_s, _ = best_of(lambda: engine.simulate_many(trace, cost, configs), 3)
    one_s, _ = best_of(lambda: [engine.simulate(trace, cost, c) for c in configs], 1)
    print(f"simulate_many, 8 configs on azure-conv: {many_s * 1e3:.1f} ms "
          f"({one_s * 1e3:.1f} ms one by one, {one_s / many_s:.2f}x on {os.cpu_count()} cores)")


if __name__ == "__main__":
    main()
