"""What vLLM's 16-token prefix cache serves beyond whole trace blocks on a real trace: hits on
part of a trace block that another request is still computing in chunks.

vLLM caches each 16-token KV block as soon as it is scheduled, so a request admitted while
another computes a shared 512-token trace block in chunks hits the blocks scheduled so far.
servetune's vLLM target does the same since stop 65 (``policies/prefix_cache.py``); before,
it shared a trace block once computed whole, and this script sized that gap (stop 64: 404 of
12,031 first admissions, 101,584 prompt tokens on Mooncake at vLLM's defaults). It replays a
trace step by step with the vLLM target's defaults (prefix caching on) and, at each request's
first admission, looks at the trace block its hit ends in or stops before: if a running
request is computing that block (its progress before the step, or after it: vLLM schedules
running requests first, so a newcomer sees what they scheduled in its own step), the hit's
tokens inside it are *served* from a block still being computed; a hit that stops at the
start of a block some of which was cached as the step began is *left out* (0 when the engine
shares blocks as vLLM does); blocks computed in the same step by a request admitted after it
(in queue order) were never hittable, and are counted apart: the old script's ceiling. Prompt
tokens all cached hits served are printed beside them.

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
    UNIT_TOKENS,
)
from policies.kernel_state import T as CLOCK  # noqa: E402
from studies.traces import load_trace  # noqa: E402
from studies.transforms import scale_rate  # noqa: E402

SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
TRACE = ("traces/mooncake/conversation_trace.jsonl", "mooncake")


def writers(ri, run, n_run, entry, offsets, bt, unit_tokens, n_full):
    """Trace block (entry id) -> the most tokens of it a running request has computed, for
    blocks some running request is inside of (``n_full``: cacheable trace blocks per request)."""
    progress: dict[int, int] = {}
    for r in run[:n_run]:
        j = ri[PC_REQ + pcm.R_HELD, r] * unit_tokens // bt  # the trace block its cached units reach into
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
    bt, bs, ut = st.block_tokens, config.block_size, int(g[UNIT_TOKENS])
    entry, offsets, prompt = st.entry, st.offsets, trace.prompt_tokens
    n_full = ri[PC_REQ + pcm.R_N_FULL] * ut // bt
    admitted = hit_tokens = 0
    served, left_out, later = [0, 0], [0, 0], [0, 0]  # (admissions, tokens)
    while g[N_DONE] < g[N_DELIVERED]:
        t = gf[CLOCK]
        if g[N_RUN] + g[N_WAIT] == 0 and gf[NEXT_DELIVERY] > t:
            eng.advance(rep, st, cost.tables, cfg, gf[NEXT_DELIVERY])
            continue
        steps = g[STEPS]
        unscheduled = np.isnan(rf[FIRST_SCHED])
        before = writers(ri, rep.lists[L_RUN], int(g[N_RUN]), entry, offsets, bt, ut, n_full)
        eng.advance(rep, st, cost.tables, cfg, np.nextafter(t, np.inf))
        if g[STEPS] == steps:
            continue
        after = writers(ri, rep.lists[L_RUN], int(g[N_RUN]), entry, offsets, bt, ut, n_full)
        for r in np.flatnonzero(unscheduled & ~np.isnan(rf[FIRST_SCHED])):
            admitted += 1
            cached = int(ri[CACHED_FIRST, r])
            hit_tokens += cached
            k, inside = divmod(cached, bt)
            if k >= n_full[r]:
                continue  # past its cacheable blocks (its own run)
            e = int(entry[offsets[r] + k])
            if inside and max(before.get(e, 0), after.get(e, 0)) >= inside:
                served[0] += 1
                served[1] += inside
            missed = min(before.get(e, 0) // bs * bs, int(prompt[r]) - 1 - cached) if not inside else 0
            if missed > 0:  # cached as the step began, so any newcomer of the step could hit it
                left_out[0] += 1
                left_out[1] += missed
            elif not inside and after.get(e, 0) >= bs:
                later[0] += 1  # computed by a request admitted after it in its own step: no one could
                later[1] += min(after[e] // bs * bs, int(prompt[r]) - 1 - cached)
    looked_up = int(prompt.sum())
    print(f"{trace.source}: {trace.n:,} requests, {admitted:,} first admissions; vLLM defaults on {args.gpu} "
          f"({args.model}), rate x{args.rate_scale:g}, prefix caching on")
    print(f"  prompt tokens served by cached hits: {hit_tokens:,} ({hit_tokens / looked_up:.2%} of "
          f"{looked_up:,} prompt tokens)")
    print(f"  ... of them from a trace block another request was still computing: {served[1]:,} tokens "
          f"({served[1] / looked_up:.3%}), {served[0]:,} admissions ({served[0] / max(admitted, 1):.2%})")
    print(f"  left out (a hit stopping at the start of a block cached as the step began): {left_out[1]:,} tokens, "
          f"{left_out[0]:,} admissions")
    print(f"  not hittable (computed in the same step by a request admitted after it): {later[1]:,} tokens, "
          f"{later[0]:,} admissions")

if __name__ == "__main__":
    main()
