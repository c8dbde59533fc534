"""The batch being formed: a request's scheduled tokens and the KV blocks they need, its
entry in the batch, and the optional step-time cap (``step_time_cap_ms``).
"""

from __future__ import annotations

from numba import njit

from costmodels.steptable import step_seconds
from policies import fairness as fm
from policies import prefix_cache as pcm
from policies.engine.codes import I_BLOCK_SIZE, I_COST_UNIT, I_STEP_CAP_MS, I_W_IN
from policies.engine.state import (
    _cache,
    _cache_prompt_blocks,
    _cover_reservation,
    _is_decode,
    _shares,
)
from policies.kernel_state import (
    B_DECODES,
    B_KV_DECODE,
    B_LOGITS,
    B_PAIRS,
    B_PREFILL,
    B_TOKENS,
    BUDGET,
    CACHING,
    COMPUTED,
    FREE,
    GENERATED,
    HELD,
    L_BATCH,
    N_BATCH,
    PC_REQ,
    PC_STATS,
    PEAK,
    QUOTAS,
    S_CLASS,
    S_PROMPT,
    S_TENANT,
    SCHED,
    SWAP_S,
    USED,
    VLLM_CACHE,
)


@njit(cache=True, nogil=True, inline="always")
def _batch_account(ri, g, prompt, r, n, sign):
    """Add (sign=1) or remove (sign=-1) n tokens of r from the step-time aggregates."""
    c = ri[COMPUTED, r]
    g[B_TOKENS] += sign * n
    if c + n == prompt[r] + ri[GENERATED, r]:
        g[B_LOGITS] += sign
    if _is_decode(ri, prompt, r, n):
        g[B_DECODES] += sign
        g[B_KV_DECODE] += sign * (c + 1)
    else:
        g[B_PAIRS] += sign * (n * c + n * (n + 1) // 2)
        g[B_PREFILL] += sign * n


@njit(cache=True, nogil=True, inline="always")
def _need_blocks(ri, pc, r, ctx, held, idle_blocks, block_size):
    """Blocks r must add to hold ``ctx`` computed tokens while holding ``held`` cached units
    (``idle_blocks`` of them not yet acquired). Full units it completes count whole
    (``policies.prefix_cache``); without caching this is
    ``ceil(ctx / block_size) - blocks held``."""
    h_after = max(held, min(pc.req[pcm.R_N_FULL, r], ctx // pc.unit_tokens))
    return (pcm.private_blocks(ctx, h_after, pc.unit_tokens, block_size)
            + pc.unit_blocks * (h_after - held) + idle_blocks - ri[HELD, r])


@njit(cache=True, nogil=True, inline="always")
def _charge_prefill(rep, st, cfg, r, n, sign):
    """Tokens unit: charge (sign=1) or refund (-1) the prompt tokens of a scheduled chunk."""
    if int(cfg[I_COST_UNIT]) == fm.TOKENS and not _is_decode(rep.ri, st.si[S_PROMPT], r, n):
        fm.charge(_shares(rep), st.si[S_TENANT, r], sign * cfg[I_W_IN] * n)


@njit(cache=True, nogil=True, inline="always")
def _schedule(ri, g, batch, prompt, r, n, blocks):
    """Put n tokens of r in the batch with ``blocks`` new blocks (the caller checked they
    fit and made room in the prefix cache)."""
    g[FREE] -= blocks
    g[USED] += blocks
    ri[HELD, r] += blocks
    if g[USED] > g[PEAK]:
        g[PEAK] = g[USED]
    _cover_reservation(ri, g, r)
    _batch_account(ri, g, prompt, r, n, 1)
    ri[SCHED, r] = n
    batch[g[N_BATCH]] = r
    g[N_BATCH] += 1
    g[BUDGET] -= n


@njit(cache=True, nogil=True, _nrt=False)
def _schedule_shared(rep, st, cfg, r, n):
    """``_schedule`` with the sharing side: blocks past the cached prefix (evicting idle
    cached prefixes to make room), the tenant's usage and its prompt-token charge."""
    ri, g = rep.ri, rep.g
    pc = _cache(rep, st)
    blocks = _need_blocks(ri, pc, r, ri[COMPUTED, r] + n, ri[PC_REQ + pcm.R_HELD, r], 0, int(cfg[I_BLOCK_SIZE]))
    if g[CACHING]:
        short = blocks - (g[FREE] - g[PC_STATS + pcm.S_EVICTABLE])
        if short > 0:
            pcm.evict(pc, short)
    if g[QUOTAS]:
        sh = _shares(rep)
        fm.hold_kv(sh, st.si[S_TENANT, r], st.si[S_CLASS, r], blocks)
        fm.use_tokens(sh, st.si[S_TENANT, r], st.si[S_CLASS, r], n)
    _charge_prefill(rep, st, cfg, r, n, 1)
    _schedule(ri, g, rep.lists[L_BATCH], st.si[S_PROMPT], r, n, blocks)
    if g[VLLM_CACHE] and ri[PC_REQ + pcm.R_HELD, r] < ri[PC_REQ + pcm.R_N_FULL, r]:
        # vLLM caches a block once scheduled: a request started later in this step hits it
        # (vllm/v1/core/kv_cache_manager.py allocate_slots -> cache_blocks)
        _cache_prompt_blocks(rep, st, r, ri[COMPUTED, r] + n, int(cfg[I_BLOCK_SIZE]))


@njit(cache=True, nogil=True, _nrt=False)
def _fits_cap(ri, g, gf, tables, prompt, cap_s, r, n):
    _batch_account(ri, g, prompt, r, n, 1)
    seconds, _ = step_seconds(tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES], g[B_KV_DECODE], g[B_PAIRS])
    _batch_account(ri, g, prompt, r, n, -1)
    return seconds + gf[SWAP_S] <= cap_s


@njit(cache=True, nogil=True, _nrt=False)
def _fit_step_cap(ri, g, gf, tables, prompt, cfg, r, n, may_split):
    """Tokens of r the step-time cap allows (0 = none); decodes are never held back.

    With splitting, the largest chunk that keeps the step under the cap (binary search;
    a request for which one token already breaks it is answered by that one lookup, as a
    full step meets every waiting request); an empty batch always takes at least one token
    (or the whole prompt), so the engine progresses under any cap.
    """
    cap_s = cfg[I_STEP_CAP_MS] * 1e-3
    if cap_s <= 0.0 or _is_decode(ri, prompt, r, n):
        return n
    if may_split and g[B_TOKENS] > 0 and not _fits_cap(ri, g, gf, tables, prompt, cap_s, r, 1):
        return 0
    if may_split:
        lo = 0
        hi = n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _fits_cap(ri, g, gf, tables, prompt, cap_s, r, mid):
                lo = mid
            else:
                hi = mid - 1
        allowed = lo
    else:
        allowed = n if _fits_cap(ri, g, gf, tables, prompt, cap_s, r, n) else 0
    if allowed == 0 and g[B_TOKENS] == 0:
        allowed = 1 if may_split else n
    return allowed
