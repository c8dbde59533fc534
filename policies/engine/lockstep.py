"""Attention-data-parallel ranks stepping together: one clock for a group of replicas.

With attention data parallelism (vLLM ``data-parallel-size`` with expert parallelism,
SGLang ``enable-dp-attention``, TensorRT-LLM ``enable_attention_dp``) each rank schedules
its own batch, but the MoE layers run over every rank's tokens, so the ranks run each
forward pass together: a rank with nothing to run joins with an empty batch, and a step
lasts as long as the slowest rank's. ``advance_group`` replays that. At each group step
every rank takes its deliveries and deadlines and forms its batch as ``advance`` does, and
every rank's step ends after

    max over ranks (its step time - its token-linear part) + token-linear part at the mean

where a rank's tables time the token-linear ops (GEMMs, MoE layers, collectives) with the
MoE layer at d x its own tokens: at the ranks' mean the MoE sees the instance's tokens,
while attention, sampling and the per-step overheads go as the slowest rank's. (The engines
pad every rank to the fullest only for CUDA-graph-sized batches, vLLM
v1/worker/dp_utils.py:175-185, where the MoE's time hardly depends on the tokens.) The
GEMMs outside the MoE run per rank, so taking them at the mean understates an uneven
step's slowest rank. A rank with no batch sits the step out; with none to form on any rank,
the group jumps to the next delivery. Fast-forward stretches are off: a rank's stretch
would need the others'.

With ``dp_balance_timeout_iters`` set, the group balances new prompts as TensorRT-LLM's
attention DP does (``_balance``), before the ranks form their batches.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from costmodels.steptable import linear_step_seconds
from policies import speculative as spm
from policies.engine.codes import (
    ERROR_NO_PROGRESS,
    ERROR_STALLED,
    I_DP_BALANCE_BATCHING,
    I_DP_BALANCE_TIMEOUT,
    I_MAX_SEQS,
    I_MAX_WAIT,
    I_SPEC_MODE,
)
from policies.engine.events import _arrive, _expire, _next_delivery
from policies.engine.pipeline import _visible_until
from policies.engine.replica import _commit_step, _form_or_restart, _idle_until, _progress
from policies.engine.state import borrowed
from policies.engine.step_end import _sample_until
from policies.kernel_state import (
    ADVANCES,
    B_DECODES,
    B_TOKENS,
    DP_BATCHED,
    DP_HOLD,
    DP_WAITED,
    ERROR,
    GHOSTS,
    ITERATIONS,
    L_DHEAP,
    N_DELIVERED,
    N_DONE,
    N_RUN,
    N_WAIT,
    PIPELINE_T,
    PREEMPTED_NOW,
    PROGRESS_BASE,
    PROGRESS_PER,
)
from policies.kernel_state import T as CLOCK


@njit(cache=True, nogil=True, _nrt=True)
def advance_group(nodes, first, count, cfg, t_limit, through):
    """Run the steps of the group ``nodes[first:first + count]`` (borrowed (replica,
    statics, tables) triples, clocks equal) that start before ``t_limit`` (``through``: at
    it too). The first rank's counters hold the group's progress guard."""
    cfg = borrowed(cfg)
    lead = nodes[first][0]
    for k in range(first, first + count):
        if nodes[k][0].g[ERROR] != 0:
            return  # a rank in error runs no more: the group's state is not to be trusted
        nodes[k][0].g[ADVANCES] += 1
    speculating = int(cfg[I_SPEC_MODE]) != spm.MODE_OFF
    dts = np.empty(count)
    oors = np.zeros(count, dtype=np.bool_)
    while _outstanding(nodes, first, count):
        t = lead.gf[CLOCK]
        if t > t_limit or (t == t_limit and not through):
            break
        lead.g[ITERATIONS] += 1
        if lead.g[ITERATIONS] > _budget(nodes, first, count):
            lead.g[ERROR] = ERROR_NO_PROGRESS  # the loop spins: stop, reported instead of hanging
            return
        busy = False
        for k in range(first, first + count):
            rep, st, tables = nodes[k]
            if rep.g[N_RUN] + rep.g[N_WAIT] == 0:
                rep.gf[PIPELINE_T] = np.nan  # nothing in flight: what has arrived by now is seen now
            seen = _visible_until(rep.gf, cfg)
            if _next_delivery(rep) <= seen:
                _arrive(rep, st, tables, cfg, seen)
            if rep.lists[L_DHEAP][0] > 0 or cfg[I_MAX_WAIT] > 0.0:
                _expire(rep, st, cfg, t)
            busy = busy or rep.g[N_RUN] + rep.g[N_WAIT] > 0
        if not _outstanding(nodes, first, count):
            break
        if not busy:  # every rank idle: jump to the next delivery (or the limit)
            t_next = t_limit
            for k in range(first, first + count):
                t_next = min(t_next, _next_delivery(nodes[k][0]))
            if t_next <= t or t_next == np.inf:
                break
            _idle_group(nodes, first, count, cfg, t_next)
            continue
        if cfg[I_DP_BALANCE_TIMEOUT] > 0:
            _balance(nodes, first, count, cfg)
        rest, tokens, decodes, formed = 0.0, 0.0, 0.0, False
        for k in range(first, first + count):
            rep, st, tables = nodes[k]
            dts[k - first] = -1.0
            if rep.g[N_RUN] + rep.g[N_WAIT] == 0:
                continue
            dts[k - first], oors[k - first] = _form_or_restart(rep, st, tables, cfg, speculating)
            if dts[k - first] < 0.0:
                if rep.g[PREEMPTED_NOW] == 0 and rep.g[N_RUN] + rep.g[N_WAIT] > 0:
                    rep.g[ERROR] = ERROR_STALLED
                    return
                continue
            formed = True
            rest = max(rest, dts[k - first] - linear_step_seconds(tables, rep.g[B_TOKENS], rep.g[B_DECODES]))
            tokens += rep.g[B_TOKENS]
            decodes += rep.g[B_DECODES]
        if not formed:
            continue  # the ranks only preempted or rejected: they form again at once
        step = rest + linear_step_seconds(nodes[first][2], tokens / count, decodes / count)
        for k in range(first, first + count):
            rep, st, _ = nodes[k]
            if dts[k - first] >= 0.0:
                _commit_step(rep, st, cfg, step, oors[k - first])
            else:
                _sit_out(rep, cfg, t + step)
    if lead.gf[CLOCK] < t_limit < np.inf and not _outstanding(nodes, first, count):
        _idle_group(nodes, first, count, cfg, t_limit)


@njit(cache=True, nogil=True, _nrt=True)
def _balance(nodes, first, count, cfg):
    """TensorRT-LLM's attention-DP balancing (PyExecutor._balance_adp_requests, on the
    ranks' allgathered counts), setting every rank's DP_HOLD: when every rank has a prompt
    to start and room for it, they start, unless every rank also decodes and they have
    waited fewer than ``dp_balance_batching_iters`` steps for that; otherwise they wait,
    the count of such steps releasing them every ``dp_balance_timeout_iters`` (it runs
    whether or not a prompt waits, as there) and at once when some rank has nothing to
    decode. A rank holding waiting requests stands for one with prompts to schedule, and
    one holding running requests for one with generation requests."""
    every_prompt, every_decode, every_room = True, True, True
    for k in range(first, first + count):
        g = nodes[k][0].g
        every_prompt = every_prompt and g[N_WAIT] > 0
        every_decode = every_decode and g[N_RUN] > 0
        every_room = every_room and g[N_RUN] < cfg[I_MAX_SEQS]
    lead = nodes[first][0].g
    hold = False
    if every_room and every_prompt:
        lead[DP_WAITED] = 0
        if every_decode:
            if lead[DP_BATCHED] < cfg[I_DP_BALANCE_BATCHING]:
                lead[DP_BATCHED] += 1
                hold = True
            else:
                lead[DP_BATCHED] = 0
    else:
        lead[DP_WAITED] += 1
        hold = True
        if lead[DP_WAITED] >= cfg[I_DP_BALANCE_TIMEOUT] or not every_decode:
            lead[DP_WAITED] = 0
            hold = False
    for k in range(first, first + count):
        nodes[k][0].g[DP_HOLD] = 1 if hold else 0


@njit(cache=True, nogil=True, _nrt=True)
def _outstanding(nodes, first, count):
    """Whether a rank holds a delivered request that has not ended."""
    for k in range(first, first + count):
        if nodes[k][0].g[N_DONE] < nodes[k][0].g[N_DELIVERED] or nodes[k][0].g[GHOSTS] > 0:
            return True
    return False


@njit(cache=True, nogil=True, _nrt=True)
def _budget(nodes, first, count):
    """The group's progress guard: the sum of its ranks' (``replica.bound_progress``)."""
    total = 0
    for k in range(first, first + count):
        g = nodes[k][0].g
        total += g[PROGRESS_BASE] + g[PROGRESS_PER] * _progress(g)
    return total


@njit(cache=True, nogil=True, _nrt=True)
def _idle_group(nodes, first, count, cfg, t):
    for k in range(first, first + count):
        rep = nodes[k][0]
        _idle_until(rep.g, rep.gf, rep.series, cfg, t)


@njit(cache=True, nogil=True, _nrt=False)
def _sit_out(rep, cfg, t_end):
    """A rank with no batch this step waits for the group's to end: idle if it holds
    nothing, else (it only preempted) with its state kept."""
    if rep.g[N_RUN] + rep.g[N_WAIT] == 0:
        _idle_until(rep.g, rep.gf, rep.series, cfg, t_end)
    else:
        _sample_until(rep.g, rep.gf, rep.series, t_end)
        rep.gf[CLOCK] = t_end
