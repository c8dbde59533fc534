"""What servetune's whole-block prefix sharing leaves out on a real trace: hits on part of a
trace block that another request is still computing in chunks.

vLLM caches each 16-token KV block as soon as it is scheduled, so a request admitted while
another computes a shared 512-token trace block in chunks hits the blocks scheduled so far;
servetune shares a trace block once it is computed whole (``policies/prefix_cache.py``; the
parity fixtures ``burst-pc-leapfrog-{b2048,b8192,seed3}`` differ from vLLM by it). This
replays a trace step by step with the vLLM target's defaults (prefix caching on) and, at
each request's first admission, looks at the first trace block of its prompt it did not hit:
if a running request is computing that same block, the full KV blocks of it computed so far
are what vLLM would have let it hit. It counts them two ways: with that request's progress
before the step (blocks cached when the step began: a floor) and after it (vLLM caches blocks
as they are scheduled, and schedules running requests before waiting ones, so a newcomer sees
what they scheduled in its own step; only a request admitted in the same step after it would
not: a ceiling, all but exact). Prompt tokens servetune's cached hits served are printed
beside them.

The replay is servetune's own, so past the first missed hit the trajectory is not vLLM's; the
figures size the gap, they are not vLLM's hit rate.

    python benchmarks/partial_hits.py [--model M] [--gpu G] [--rate-scale X]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.fidelity.parity import stepping_replica  # noqa: E402
from optimizer.search.targets import engine_context  # noqa: E402
from policies import engine as eng  # noqa: E402
from policies import prefix_cache as pcm  # noqa: E402
from policies.engines import preset  # noqa: E402
from policies.kernel_state import (  # noqa: E402
    CACHED_FIRST,
    COMPUTED,
    FIRST_SCHED,
    L_RUN,
    N_DELIVERED,
    N_DONE,
    N_RUN,
    N_WAIT,
    NEXT_DELIVERY,
    PC_REQ,
    STEPS,
)
from policies.kernel_state import T as CLOCK  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
TRACE = ("traces/mooncake/conversation_trace.jsonl", "mooncake")


def writers(ri, run, n_run, entry, offsets, bt, n_full):
    """Trace block (entry id) -> the most tokens of it a running request has computed."""
    progress: dict[int, int] = {}
    for r in run[:n_run]:
        j = ri[PC_REQ + pcm.R_HELD, r]
        inside = ri[COMPUTED, r] - j * bt
        if j < n_full[r] and 0 < inside < bt:
            e = int(entry[offsets[r] + j])
            progress[e] = max(progress.get(e, 0), int(inside))
    return progress


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival-rate multiplier (1 = as recorded)")
    args = parser.parse_args()
    trace = load_trace(SHARED / TRACE[0], TRACE[1])
    if args.rate_scale != 1.0:
        trace = scale_rate(trace, factor=args.rate_scale)
    cost = build(args.model, args.gpu)
    config = preset("vllm-default", engine_context(args.model, args.gpu))
    rep, st, cfg = stepping_replica(trace, cost, config)
    ri, rf, g, gf = rep.ri, rep.rf, rep.g, rep.gf
    bt, bs = st.block_tokens, config.block_size
    entry, offsets, n_full, prompt = st.entry, st.offsets, ri[PC_REQ + pcm.R_N_FULL], trace.prompt_tokens
    admitted = hit_tokens = 0
    missed_tokens, missed_requests = [0, 0], [0, 0]  # floor (progress before the step), ceiling (after it)
    while g[N_DONE] < g[N_DELIVERED]:
        t = gf[CLOCK]
        if g[N_RUN] + g[N_WAIT] == 0 and gf[NEXT_DELIVERY] > t:
            eng.advance(rep, st, cost.tables, cfg, gf[NEXT_DELIVERY])
            continue
        steps = g[STEPS]
        unscheduled = np.isnan(rf[FIRST_SCHED])
        before = writers(ri, rep.lists[L_RUN], int(g[N_RUN]), entry, offsets, bt, n_full)
        eng.advance(rep, st, cost.tables, cfg, np.nextafter(t, np.inf))
        if g[STEPS] == steps:
            continue
        after = writers(ri, rep.lists[L_RUN], int(g[N_RUN]), entry, offsets, bt, n_full)
        for r in np.flatnonzero(unscheduled & ~np.isnan(rf[FIRST_SCHED])):
            admitted += 1
            cached = int(ri[CACHED_FIRST, r])
            hit_tokens += cached
            k = cached // bt
            if cached % bt or k >= n_full[r]:
                continue  # it hit into a block (its own run or an evicted head), or its prompt has no next block
            e = int(entry[offsets[r] + k])
            cap_tokens = int(prompt[r]) - 1 - cached  # a hit leaves one token to compute
            for bound, progress in enumerate((before.get(e, 0), after.get(e, 0))):
                missed = min(progress // bs * bs, cap_tokens)
                if missed > 0:
                    missed_tokens[bound] += missed
                    missed_requests[bound] += 1
    looked_up = int(prompt.sum())
    print(f"{trace.source}: {trace.n:,} requests, {admitted:,} first admissions; vLLM defaults on {args.gpu} "
          f"({args.model}), rate x{args.rate_scale:g}, prefix caching on")
    print(f"  prompt tokens served by servetune's cached hits: {hit_tokens:,} ({hit_tokens / looked_up:.2%} of "
          f"{looked_up:,} prompt tokens)")
    (floor_tokens, ceiling_tokens), (floor_requests, ceiling_requests) = missed_tokens, missed_requests
    print(f"  left out, a block still computed by another request: {floor_tokens:,} to {ceiling_tokens:,} tokens "
          f"({floor_tokens / looked_up:.3%} to {ceiling_tokens / looked_up:.3%} of prompt tokens; "
          f"{floor_requests:,} to {ceiling_requests:,} admissions, "
          f"{floor_requests / max(admitted, 1):.2%} to {ceiling_requests / max(admitted, 1):.2%})")


if __name__ == "__main__":
    main()
