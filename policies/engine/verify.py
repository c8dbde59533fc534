"""Speculative decoding within a step: verify budgets planned once the batch is formed
(``policies.speculative``), the drafts' outcomes settled at its end.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from policies import fairness as fm
from policies import prefix_cache as pcm
from policies import speculative as spm
from policies.engine.codes import (
    I_BLOCK_SIZE,
    I_COST_UNIT,
    I_DRAFT_COST,
    I_DRAFT_MODE,
    I_MAX_SEQS,
    I_SPEC_BATCH_2,
    I_SPEC_BATCH_3,
    I_SPEC_GAMMA,
    I_SPEC_K_2,
    I_SPEC_K_3,
    I_SPEC_MODE,
    I_W_OUT,
    SP_ACCEPTED,
    SP_ELL,
    SP_HEAP,
    SP_LIM,
    SP_REQS,
    SP_SCRATCH,
    SP_SLACK,
    SP_TOK,
)
from policies.engine.state import _cache, _cover_reservation, _is_decode, _shares
from policies.kernel_state import (
    B_DECODES,
    B_KV_DECODE,
    B_LOGITS,
    B_PAIRS,
    B_TOKENS,
    BUDGET,
    CACHING,
    COMPUTED,
    DRAFT_S,
    FL_ALPHA,
    FREE,
    GENERATED,
    HELD,
    L_BATCH,
    L_SPEC,
    MAX_OUT,
    N_BATCH,
    PC_REQ,
    PC_STATS,
    PEAK,
    QUOTAS,
    RNG_SEED,
    RUNNING,
    S_CLASS,
    S_PROMPT,
    S_SPEC_ROW,
    S_TENANT,
    SCHED,
    SPEC_ACCEPTED,
    SPEC_DECODES,
    SPEC_DRAFTED,
    SPEC_EST,
    SPEC_HITS,
    SPEC_LAG,
    SPEC_SLOTS,
    SPEC_TRIALS,
    SPEC_VERIFIES,
    STATUS,
    STEPS,
    TARGET,
    UNIT_TOKENS,
    USED,
)


@njit(cache=True, nogil=True, _nrt=False)
def _plan_verify(rep, st, tables, cfg, spec):
    """Give the batch's decodes their verify budgets (``policies.speculative``) from the
    token budget and KV the formed batch left, taking blocks for the draft tokens.
    ``spec``: ``st.spec``; None compiles to nothing."""
    if spec is None:  # pruned by type: the planner is not compiled for runs that never speculate
        return
    ri, g, gf, lists = rep.ri, rep.g, rep.gf, rep.lists
    batch = lists[L_BATCH]
    prompt = st.si[S_PROMPT]
    held_units = ri[PC_REQ + pcm.R_HELD]
    reqs, tok, lim = lists[L_SPEC + SP_REQS], lists[L_SPEC + SP_TOK], lists[L_SPEC + SP_LIM]
    slack, ell = lists[L_SPEC + SP_SLACK], lists[L_SPEC + SP_ELL]
    mode = int(cfg[I_SPEC_MODE])
    gamma = int(cfg[I_SPEC_GAMMA])
    block_size = int(cfg[I_BLOCK_SIZE])
    unit_tokens = g[UNIT_TOKENS]
    n_req = np.int64(0)  # not a literal 0: Numba would compile the speculative planners for it too
    for i in range(g[N_BATCH]):
        r = batch[i]
        # a lingering request's decode past its stop (async scheduling) verifies no drafts
        if ri[SCHED, r] == 1 and ri[STATUS, r] == RUNNING and _is_decode(ri, prompt, r, 1):
            reqs[n_req] = r
            tok[n_req] = ri[GENERATED, r]
            lim[n_req] = max(0, min(gamma, ri[MAX_OUT, r] - ri[GENERATED, r] - 1))
            slack[n_req] = held_units[r] * unit_tokens + ri[HELD, r] * block_size - ri[COMPUTED, r] - 1
            n_req += 1
    k_fixed = gamma
    if mode == spm.MODE_BATCH_SCHEDULE:  # the k the previous step's batch size chose (replica._form_step)
        k_fixed = spm.batch_schedule_k(gamma, int(cfg[I_SPEC_BATCH_2]), int(cfg[I_SPEC_K_2]),
                                       int(cfg[I_SPEC_BATCH_3]), int(cfg[I_SPEC_K_3]), g[SPEC_LAG])
    g[SPEC_SLOTS] = n_req
    if n_req == 0:
        return
    if g[CACHING]:
        _evict_for_drafts(rep, st, lim, slack, n_req, block_size)
    surv, alpha = rep.surv, rep.fl[FL_ALPHA]
    if mode == spm.MODE_DSPARK or mode == spm.MODE_DSPARK_LAGGED:
        spm.draft_confidences(reqs, tok, n_req, spec.profiles, st.si[S_SPEC_ROW], g[RNG_SEED], spec.spread,
                              spec.bias, gamma, surv)
    elif mode == spm.MODE_SMARTSPEC:
        spm.acceptance_estimate(rep.rf[SPEC_HITS], rep.rf[SPEC_TRIALS], gf[SPEC_EST:SPEC_EST + 2], reqs, n_req, alpha)
    draft_pp = spm.draft_seconds_per_position(tables, int(cfg[I_DRAFT_MODE]), cfg[I_DRAFT_COST], n_req,
                                              g[B_KV_DECODE])
    free_blocks = max(0, g[FREE] - g[PC_STATS + pcm.S_EVICTABLE])
    if mode == spm.MODE_ADAPTIVE or mode == spm.MODE_SPS_TABLE or mode == spm.MODE_SPS_CAP_ACCEPT:
        x, charged, positions = _engine_budgets(rep, st, tables, cfg, spec, mode, n_req, draft_pp, free_blocks)
    else:
        lag = SPEC_LAG + g[STEPS] % 2  # written two steps ago, rewritten now
        x, _, positions, k_now = spm.verify_budgets(
            mode, gamma, k_fixed, n_req, surv, alpha, lim, tables, g[B_TOKENS], g[B_LOGITS], g[B_DECODES],
            g[B_KV_DECODE], g[B_PAIRS], draft_pp, g[BUDGET], slack, free_blocks, block_size, g[lag], ell,
            lists[L_SPEC + SP_HEAP], lists[L_SPEC + SP_SCRATCH])
        g[lag] = k_now
        charged = x
    for k in range(n_req):
        m = ell[k]
        if m == 0:
            continue
        r = reqs[k]
        take = pcm.private_blocks(ri[COMPUTED, r] + 1 + m, held_units[r], unit_tokens, block_size) - ri[HELD, r]
        g[FREE] -= take
        g[USED] += take
        ri[HELD, r] += take
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], take)
        g[SPEC_VERIFIES] += 1
    if g[USED] > g[PEAK]:
        g[PEAK] = g[USED]
    g[BUDGET] -= charged
    g[B_TOKENS] += x
    g[B_LOGITS] += x
    g[B_KV_DECODE] += x
    gf[DRAFT_S] = positions * draft_pp
    g[SPEC_DECODES] += n_req
    g[SPEC_DRAFTED] += x


@njit(cache=True, nogil=True, _nrt=False)
def _evict_for_drafts(rep, st, lim, slack, n_req, block_size):
    """Evict idle cached blocks so that every decode's whole draft window fits: the engines
    allocate the draft slots of the block before the verify, from a pool whose free blocks
    include idle cached ones (vLLM's num_lookahead_tokens in allocate_slots; SGLang's
    per-decode reserve, mem_cache/allocation_sizing.py:28-70). Held past the step only as
    far as the verify uses them (the lookahead reserve itself is not modelled)."""
    g = rep.g
    need = 0
    for k in range(n_req):
        need += (max(0, lim[k] - slack[k]) + block_size - 1) // block_size
    short = need - (g[FREE] - g[PC_STATS + pcm.S_EVICTABLE])
    if short > 0:
        pcm.evict(_cache(rep, st), short)


@njit(cache=True, nogil=True, _nrt=False)
def _engine_budgets(rep, st, tables, cfg, spec, mode, n_req, draft_pp, free_blocks):
    """``adaptive_verify`` / ``sps_table`` / ``sps_cap_accept`` (``policies.speculative``):
    the budget from stale survivals, then the top drafts by fresh ones. Under
    ``adaptive_verify`` vLLM's scheduler has charged every decode its k drafts first; under
    ``sps_cap_accept`` the whole blocks are verified and ``ell`` only caps acceptance.
    Returns (verify tokens, tokens charged to the step's budget, drafted positions)."""
    g, lists = rep.g, rep.lists
    reqs, tok, lim = lists[L_SPEC + SP_REQS], lists[L_SPEC + SP_TOK], lists[L_SPEC + SP_LIM]
    ell, heap, scheduled = lists[L_SPEC + SP_ELL], lists[L_SPEC + SP_HEAP], lists[L_SPEC + SP_SCRATCH]
    gamma = int(cfg[I_SPEC_GAMMA])
    rows, surv = st.si[S_SPEC_ROW], rep.surv
    token_left = g[BUDGET]
    charged = 0
    for k in range(n_req):
        scheduled[k] = lim[k]
        if mode == spm.MODE_ADAPTIVE:
            scheduled[k] = max(0, min(lim[k], token_left - charged))
            charged += scheduled[k]
    spm.stale_confidences(reqs, tok, n_req, spec.profiles, rows, g[RNG_SEED], spec.spread, spec.bias, gamma, surv)
    positions = spm.drafted_positions(gamma, scheduled, n_req)
    tau0 = g[B_LOGITS] if mode == spm.MODE_ADAPTIVE else n_req
    b = spm.engine_budget(mode, surv, scheduled, n_req, float(tau0), gamma, tables, g[B_TOKENS],
                          positions * draft_pp, int(cfg[I_MAX_SEQS]), spm.SPS_TABLE_CONTEXT,
                          int(cfg[I_DRAFT_MODE]), cfg[I_DRAFT_COST], ell, heap)
    spm.draft_confidences(reqs, tok, n_req, spec.profiles, rows, g[RNG_SEED], spec.spread, spec.bias, gamma, surv)
    x, _, _ = spm.topk_budgets(surv, scheduled, n_req, gamma, b, token_left, rep.lists[L_SPEC + SP_SLACK],
                               free_blocks, int(cfg[I_BLOCK_SIZE]), ell, heap)
    if mode == spm.MODE_SPS_CAP_ACCEPT:
        x = 0
        for k in range(n_req):
            x += scheduled[k]
    return x, (charged if mode == spm.MODE_ADAPTIVE else x), positions


@njit(cache=True, nogil=True, _nrt=False)
def _settle_verify(rep, st, cfg, spec):
    """Sample the verifies and keep the accepted drafts: each request advances by them on
    top of its own token (up to its output length), and the rejected drafts' KV is freed.
    ``spec`` as in ``_plan_verify``."""
    if spec is None:  # pruned by type
        return
    ri, g, lists = rep.ri, rep.g, rep.lists
    reqs, tok = lists[L_SPEC + SP_REQS], lists[L_SPEC + SP_TOK]
    ell, accepted = lists[L_SPEC + SP_ELL], lists[L_SPEC + SP_ACCEPTED]
    n_req = g[SPEC_SLOTS]
    spm.sample_verify(reqs, tok, ell, n_req, spec.profiles, st.si[S_SPEC_ROW], g[RNG_SEED], spec.spread, accepted)
    if int(cfg[I_SPEC_MODE]) == spm.MODE_SMARTSPEC:
        spm.observe_acceptance(rep.rf[SPEC_HITS], rep.rf[SPEC_TRIALS], rep.gf[SPEC_EST:SPEC_EST + 2], reqs, ell,
                               accepted, n_req)
    block_size = int(cfg[I_BLOCK_SIZE])
    tokens_unit = int(cfg[I_COST_UNIT]) == fm.TOKENS
    for k in range(n_req):
        if ell[k] == 0:
            continue
        r = reqs[k]
        kept = min(accepted[k], ri[TARGET, r] - ri[GENERATED, r] - 1)
        ri[GENERATED, r] += kept
        ri[SCHED, r] += kept
        g[SPEC_ACCEPTED] += kept
        extra = ri[HELD, r] - pcm.private_blocks(ri[COMPUTED, r] + 1 + kept, ri[PC_REQ + pcm.R_HELD, r],
                                                 g[UNIT_TOKENS], block_size)
        g[FREE] += extra
        g[USED] -= extra
        ri[HELD, r] -= extra
        if g[QUOTAS]:
            fm.hold_kv(_shares(rep), st.si[S_TENANT, r], st.si[S_CLASS, r], -extra)
        _cover_reservation(ri, g, r)
        if tokens_unit and kept > 0:
            fm.charge(_shares(rep), st.si[S_TENANT, r], cfg[I_W_OUT] * kept)
    g[SPEC_SLOTS] = 0
