"""Speculative decoding: draft confidences, verify outcomes and per-step verify budgets.

A decode request that speculates verifies ``1 + l_r`` tokens in one target step: the
token it would decode anyway plus ``l_r`` draft tokens. The target accepts the longest
run of drafts that match and adds one token of its own (the bonus), so the step yields
``1 + accepted`` tokens. The scheduler picks ``l_r`` per request and step (its *verify
budget*) against the step time the extra tokens cost.

Acceptance model
    Request r has a profile row of conditional acceptance probabilities ``p_i`` (position
    i is accepted given 1..i-1 were; e.g. ``[0.85, 0.6, 0.4]``), chosen by SLO class or
    tenant (``AcceptanceModel``). Each verify draws its own true confidences
    ``c = p + spread * (2u - 1) * min(p, 1 - p)`` (mean ``p``, inside [0, 1]), and the
    scheduler sees ``min(1, c * (1 + bias))``: a calibration error that over- (bias > 0)
    or under-states (bias < 0) acceptance. Draft i is accepted when a uniform draw falls
    below its true ``c``; the run stops at the first rejection.

Randomness
    Every draw is a hash of (seed, request, token index, position, stream), not a shared
    stream, so a request's outcomes do not depend on what else shares its batch and
    survive preemption unchanged. Arithmetic only (no libm), so the plain-Python twin in
    ``tests/policies/reference_speculative.py`` matches bit for bit.

Verify-budget policies (``SPECULATIVE_MODES``), each filling ``ell`` for the batch's
decode requests once per step:

* ``off``: no speculation; ``fixed``: ``l_r = k``;
* ``smartspec`` (Liu et al.): one k for the batch maximising expected tokens per second
  ``sum_r l(alpha_r, k) / T(k)``, ``l(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha)``, with
  ``alpha_r`` a moving average of the request's observed acceptance;
* ``dspark`` (DeepSeek, Algorithm 1): prefix extensions (r, j) in order of seen survival
  ``a_rj = prod_{i<=j} c_ri``, added while ``tau * SPS(B)`` rises, stopping at the first
  that does not (the causal early stop), with SPS(B) read between GEMM tile ends (below);
* ``dspark_lagged`` (DSpark section 5.2): the global argmax K of the same curve (the
  table as profiled) computed two steps earlier, then the top K extensions by current
  survival, no early stop.

The engines' own budgets (their flags and source lines: ``policies.engines.vllm`` and
``policies.engines.sglang``):

* ``batch_schedule`` (vLLM ``num_speculative_tokens_per_batch_size``): ``l_r = k`` with k
  looked up from the requests the *previous* step scheduled (the drafts verified now were
  proposed after it); ranges [1, b2), [b2, b3), [b3, ...) verify gamma, k2, k3;
* ``adaptive_verify`` (vLLM DSpark ``enable_adaptive_verification``): the scheduler charges
  every decode its k drafts; the worker keeps the total b maximising
  ``(sampling requests + top-b stale survivals) / (draft(R) + verify(N + b))`` over tables
  profiled at warm-up (``VERIFY_PROFILE_CONTEXT`` KV tokens per request), then admits the
  top b drafts by fresh survival; the rest are dropped as rejected;
* ``sps_table`` (SGLang DSPARK, ``SGLANG_RAGGED_VERIFY_MODE=compact``): the budget b
  maximising ``(R + top-b stale survivals) * SPS(R + b)``, SPS read from the table at its
  floor probe (``sps_probe_floor``; the table servetune writes, ``sps_table_seconds``), then
  the top b drafts by fresh survival;
* ``sps_cap_accept`` (SGLang DSPARK, ``SGLANG_RAGGED_VERIFY_MODE=cap-accept``): the same
  budget and top b, but the target verifies every request's whole block and only the
  accepted run is capped at the planned length: static's compute with fewer tokens kept.

Stale survivals are the confidences of an earlier draft of the same request (an
independent draw of the same profile, at token index t - 1); a request's first verify has
none and counts as sure (1.0 at every position), as both engines seed a new row.

SPS(B) for the early stop. Algorithm 1 stops at the first extension that does not raise
``tau * SPS(B)``, which finds the best budget when SPS decays smoothly (the paper's
premise). Profiled step times do not: they are a staircase in B, flat inside a GEMM tile
and jumping where the next tile opens, so on the raw table the first verify token past a
tile edge costs the whole jump, Theta falls, and the search halts although the tile
behind the edge would pay (on Llama-3.1-8B / H100 the budget fell to about one draft per
request at loads where verifying seven still paid). ``dspark`` therefore reads SPS(B)
between tile ends (``costmodels.steptable.step_seconds_at_tile_ends``): each verify token
pays its share of the tile it opens. That curve equals the table at every tile end and
wherever the table has no tile edges (so Appendix A's example stands as stated), and it
depends on the table and the batch's shape only, never on confidences, so the early stop
remains causal and lossless. ``dspark_lagged`` has no early stop and keeps the raw table,
as DSpark's production scheduler does with its jagged SPS.

Step time with verify tokens: every verify token is one more token through the
token-linear layers and the lm head and one more KV position read by decode attention
(verification is memory-bound like a decode, not a prefill chunk). Drafting costs a
fixed time per drafted position (``draft_seconds_per_position``), added once per step.

Verify tokens use the step's remaining token budget and KV slots: a request first fills
the free slots of the blocks it holds (``slack``), then takes free blocks. Rejected
tokens' KV is dropped after the step (the caller frees blocks past the accepted length).

All kernels are ``@njit(cache=True, nogil=True)`` and run once per step over the batch;
per-request and per-extension helpers are inlined so no arrays are passed per call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from numba import njit

from costmodels.steptable import step_seconds, step_seconds_at_tile_ends
from policies.config import DRAFT_COST_MODES, SPECULATIVE_MODES

MODE_OFF, MODE_FIXED, MODE_SMARTSPEC, MODE_DSPARK, MODE_DSPARK_LAGGED, MODE_BATCH_SCHEDULE, MODE_ADAPTIVE, \
    MODE_SPS_TABLE, MODE_SPS_CAP_ACCEPT = range(9)
DRAFT_FRACTION, DRAFT_MTP = range(2)
assert SPECULATIVE_MODES[MODE_SPS_CAP_ACCEPT] == "sps_cap_accept" and DRAFT_COST_MODES[DRAFT_MTP] == "mtp"

#: A DSpark-like drafter on chat traffic: about 3.9 tokens per verify at gamma = 7.
DEFAULT_PROFILE = (0.85, 0.80, 0.75, 0.70, 0.65, 0.60, 0.55, 0.50)

# random streams of the hash
STREAM_NOISE, STREAM_ACCEPT = 0, 1
# SmartSpec's acceptance estimate: per-request moving counts, shrunk to the run's
# estimate with the weight of PRIOR_TRIALS trials; counts decay by ALPHA_DECAY per verify
ALPHA_DECAY = 0.9
PRIOR_TRIALS = 4.0
# est slots (run-wide acceptance counts)
EST_HITS, EST_TRIALS = 0, 1

_MASK = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S11, _ONE = (np.uint64(s) for s in (30, 27, 31, 11, 1))
_TO_UNIT = 1.0 / 9007199254740992.0  # 2**-53


# ======================================================================================
# randomness and the acceptance model
# ======================================================================================
@njit(cache=True, nogil=True, inline="always")
def _absorb(h, key):
    """One SplitMix64 round over h xor key: a bijection that spreads every input bit."""
    z = (h ^ key) + _GOLDEN
    z = (z ^ (z >> _S30)) * _MUL1
    z = (z ^ (z >> _S27)) * _MUL2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True, inline="always")
def uniform(seed, r, t, i, stream):
    """Uniform in [0, 1) for draft position i of request r's verify at token index t."""
    h = _absorb(np.uint64(0), np.uint64(seed))
    h = _absorb(h, np.uint64(r))
    h = _absorb(h, np.uint64(t))
    h = _absorb(h, (np.uint64(i) << _ONE) | np.uint64(stream))
    return (h >> _S11) * _TO_UNIT


@njit(cache=True, nogil=True, inline="always")
def true_confidence(profiles, row, seed, r, t, i, spread):
    """True conditional acceptance of draft position i (0-based) at token index t."""
    p = profiles[row, i]
    if spread > 0.0:
        u = uniform(seed, r, t, i, STREAM_NOISE)
        p = p + spread * (2.0 * u - 1.0) * min(p, 1.0 - p)
    return p


@njit(cache=True, nogil=True, _nrt=False)
def draft_confidences(reqs, tok, n_req, profiles, rows, seed, spread, bias, gamma, surv):
    """Seen survival ``surv[k, j-1] = prod_{i<=j} seen c`` for batch slot k (request
    ``reqs[k]`` at token index ``tok[k]``), j = 1..gamma; non-increasing along j."""
    for k in range(n_req):
        r = reqs[k]
        row = rows[r]
        a = 1.0
        for i in range(gamma):
            c = true_confidence(profiles, row, seed, r, tok[k], i, spread)
            a *= min(1.0, c * (1.0 + bias))
            surv[k, i] = a


@njit(cache=True, nogil=True, _nrt=False)
def sample_verify(reqs, tok, ell, n_req, profiles, rows, seed, spread, accepted):
    """Draft tokens the target accepts for each slot (the run before the first
    rejection among its ``ell[k]`` drafts); returns their total."""
    total = 0
    for k in range(n_req):
        r = reqs[k]
        row = rows[r]
        run = 0
        for i in range(ell[k]):
            if uniform(seed, r, tok[k], i, STREAM_ACCEPT) >= true_confidence(profiles, row, seed, r, tok[k], i, spread):
                break
            run += 1
        accepted[k] = run
        total += run
    return total


# ======================================================================================
# step time
# ======================================================================================
@njit(cache=True, nogil=True, inline="always")
def verify_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, x, draft_s):
    """Step seconds of the batch shape (b_*) plus x verify tokens and the draft's time."""
    seconds, _ = step_seconds(tables, b_tokens + x, b_logits + x, b_decodes, b_kv + x, b_pairs)
    return seconds + draft_s


@njit(cache=True, nogil=True, inline="always")
def planned_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, x, draft_s):
    """``verify_seconds`` read between GEMM tile ends: the smooth SPS(B) of dspark's early stop."""
    seconds, _ = step_seconds_at_tile_ends(tables, b_tokens + x, b_logits + x, b_decodes, b_kv + x, b_pairs)
    return seconds + draft_s


@njit(cache=True, nogil=True, _nrt=False)
def draft_seconds_per_position(tables, mode, value, n_decode, kv_decode):
    """Seconds to draft one position for n_decode requests: ``fraction`` = value times
    the target's decode step of the same requests (a small draft model); ``mtp`` =
    value milliseconds (a multi-token-prediction head)."""
    if n_decode == 0:
        return 0.0
    if mode == DRAFT_FRACTION:
        seconds, _ = step_seconds(tables, n_decode, n_decode, n_decode, kv_decode, 0)
        return value * seconds
    return value * 1e-3


@njit(cache=True, nogil=True, inline="always")
def drafted_positions(limit, lim, n_req):
    """Positions the drafter runs: the longest verify any request may take, at most limit."""
    most = 0
    for k in range(n_req):
        most = max(most, min(limit, lim[k]))
    return most


# ======================================================================================
# granting verify tokens under the token budget and free KV
# ======================================================================================
@njit(cache=True, nogil=True, inline="always")
def _grant(slack, k, want, free_blocks, block_size):
    """Verify tokens slot k gets of ``want`` (its held slots first, then free blocks);
    updates slack[k]; returns (tokens, blocks taken)."""
    need = want - slack[k]
    taken = 0
    if need > 0:
        taken = min((need + block_size - 1) // block_size, free_blocks)
    got = min(want, slack[k] + taken * block_size)
    slack[k] += taken * block_size - got
    return got, taken


@njit(cache=True, nogil=True, _nrt=False)
def fixed_budgets(k_verify, lim, n_req, token_left, slack, free_blocks, block_size, ell):
    """``ell[k] = min(k_verify, lim[k])`` in batch order while tokens and KV last.
    Returns (verify tokens, blocks taken)."""
    x = 0
    blocks = 0
    for k in range(n_req):
        want = min(k_verify, lim[k], token_left - x)
        got = 0
        if want > 0:
            got, taken = _grant(slack, k, want, free_blocks - blocks, block_size)
            blocks += taken
        ell[k] = got
        x += got
    return x, blocks


@njit(cache=True, nogil=True, inline="always")
def expected_tokens(alpha, k):
    """SmartSpec's l(alpha, k) = 1 + alpha + ... + alpha^k: expected tokens of a k-draft verify."""
    total = 0.0
    term = 1.0
    for _ in range(k + 1):
        total += term
        term *= alpha
    return total


@njit(cache=True, nogil=True, _nrt=False)
def smartspec_k(alpha, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs,
                draft_pp, token_left):
    """The k in 0..gamma (first of ties) maximising expected tokens per second of the
    batch, ``sum_k l(alpha[k], min(k, lim[k])) / (T(B + verify tokens) + k * draft_pp)``,
    among the k whose verify tokens fit the token budget."""
    best_k = 0
    best = n_req / verify_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, 0, 0.0)
    for kk in range(1, gamma + 1):
        x = 0
        tokens = 0.0
        for k in range(n_req):
            m = min(kk, lim[k])
            x += m
            tokens += expected_tokens(alpha[k], m)
        if x > token_left:
            break
        rate = tokens / verify_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, x,
                                       kk * draft_pp)
        if rate > best:
            best = rate
            best_k = kk
    return best_k


@njit(cache=True, nogil=True, _nrt=False)
def acceptance_estimate(hits, trials, est, reqs, n_req, alpha):
    """SmartSpec's alpha per slot: the request's moving acceptance counts shrunk to the
    run's (Laplace-smoothed) rate with the weight of PRIOR_TRIALS trials."""
    run_rate = (est[EST_HITS] + 1.0) / (est[EST_TRIALS] + 2.0)
    for k in range(n_req):
        r = reqs[k]
        alpha[k] = (hits[r] + PRIOR_TRIALS * run_rate) / (trials[r] + PRIOR_TRIALS)


@njit(cache=True, nogil=True, _nrt=False)
def observe_acceptance(hits, trials, est, reqs, ell, accepted, n_req):
    """Fold one step's outcomes into the moving counts: a verify of l drafts tests
    ``accepted`` positions that passed plus, if one failed, that one."""
    for k in range(n_req):
        if ell[k] == 0:
            continue
        r = reqs[k]
        tested = accepted[k] + (1 if accepted[k] < ell[k] else 0)
        hits[r] = ALPHA_DECAY * hits[r] + accepted[k]
        trials[r] = ALPHA_DECAY * trials[r] + tested
        est[EST_HITS] = ALPHA_DECAY * est[EST_HITS] + accepted[k]
        est[EST_TRIALS] = ALPHA_DECAY * est[EST_TRIALS] + tested


# ======================================================================================
# DSpark: extensions in global order of survival
# ======================================================================================
# The order is a k-way merge of the slots' survival rows (each non-increasing): a heap of
# slots keyed by the survival of their next extension, ties to the lower slot. ``pos[k]``
# is the extensions slot k has passed; heap[0] holds the size.
@njit(cache=True, nogil=True, inline="always")
def _first(surv, pos, a, b):
    sa = surv[a, pos[a]]
    sb = surv[b, pos[b]]
    return sa > sb or (sa == sb and a < b)


@njit(cache=True, nogil=True, inline="always")
def _sift_down(heap, surv, pos, i):
    size = heap[0]
    while True:
        child = 2 * i
        if child > size:
            return
        if child < size and _first(surv, pos, heap[child + 1], heap[child]):
            child += 1
        if not _first(surv, pos, heap[child], heap[i]):
            return
        heap[i], heap[child] = heap[child], heap[i]
        i = child


@njit(cache=True, nogil=True, inline="always")
def _merge_start(heap, surv, pos, lim, n_req):
    """Heap of the slots with an extension of positive survival left."""
    size = 0
    for k in range(n_req):
        pos[k] = 0
        if min(lim[k], surv.shape[1]) > 0 and surv[k, 0] > 0.0:
            size += 1
            heap[size] = k
    heap[0] = size
    for i in range(size // 2, 0, -1):
        _sift_down(heap, surv, pos, i)


@njit(cache=True, nogil=True, inline="always")
def _merge_advance(heap, surv, pos, lim):
    """The top slot passed its extension: re-key it, or drop it when it has none left."""
    k = heap[1]
    pos[k] += 1
    if pos[k] >= min(lim[k], surv.shape[1]) or surv[k, pos[k]] <= 0.0:
        heap[1] = heap[heap[0]]
        heap[0] -= 1
    if heap[0] > 0:
        _sift_down(heap, surv, pos, 1)


@njit(cache=True, nogil=True, inline="always")
def _merge_drop(heap, surv, pos):
    """Remove the top slot (it can take no more tokens)."""
    heap[1] = heap[heap[0]]
    heap[0] -= 1
    if heap[0] > 0:
        _sift_down(heap, surv, pos, 1)


@njit(cache=True, nogil=True, _nrt=False)
def dspark_budgets(surv, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs,
                   draft_pp, token_left, slack, free_blocks, block_size, ell, heap):
    """DSpark's Algorithm 1 with the causal early stop, under the token budget and KV.

    Extensions come in order of seen survival; each raises B by one and tau by its
    survival; the first that does not raise ``tau / T(B)`` ends the search, with T read
    between tile ends (``planned_seconds``). An extension of a slot out of KV drops that
    slot; one past the token budget ends the search.
    Returns (verify tokens, blocks taken, drafted positions).
    """
    positions = drafted_positions(gamma, lim, n_req)
    draft_s = positions * draft_pp
    _merge_start(heap, surv, ell, lim, n_req)
    tau = float(n_req)
    best = tau / planned_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, 0, draft_s)
    x = 0
    blocks = 0
    while heap[0] > 0 and x < token_left:
        k = heap[1]
        if slack[k] == 0 and blocks == free_blocks:
            _merge_drop(heap, surv, ell)
            continue
        a = surv[k, ell[k]]
        theta = (tau + a) / planned_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, x + 1, draft_s)
        if not theta > best:
            break
        _, taken = _grant(slack, k, 1, free_blocks - blocks, block_size)
        blocks += taken
        best = theta
        tau += a
        x += 1
        _merge_advance(heap, surv, ell, lim)
    return x, blocks, positions


@njit(cache=True, nogil=True, _nrt=False)
def dspark_global_k(surv, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs,
                    draft_pp, token_left, scratch, heap):
    """dspark_lagged's budget: the number of extensions K (first of ties) maximising
    ``tau / T(B)`` over the whole merge order, no early stop, within the token budget.
    ``scratch`` (i8[n_req]) is overwritten."""
    draft_s = drafted_positions(gamma, lim, n_req) * draft_pp
    _merge_start(heap, surv, scratch, lim, n_req)
    tau = float(n_req)
    best = tau / verify_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, 0, draft_s)
    best_x = 0
    x = 0
    while heap[0] > 0 and x < token_left:
        tau += surv[heap[1], scratch[heap[1]]]
        x += 1
        theta = tau / verify_seconds(tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs, x, draft_s)
        if theta > best:
            best = theta
            best_x = x
        _merge_advance(heap, surv, scratch, lim)
    return best_x


@njit(cache=True, nogil=True, _nrt=False)
def topk_budgets(surv, lim, n_req, gamma, k_total, token_left, slack, free_blocks, block_size, ell, heap):
    """The first ``k_total`` extensions of the merge order that fit the token budget and
    KV (a slot out of KV is skipped). Returns (verify tokens, blocks taken, drafted positions)."""
    _merge_start(heap, surv, ell, lim, n_req)
    limit = min(k_total, token_left)
    x = 0
    blocks = 0
    while heap[0] > 0 and x < limit:
        got, taken = _grant(slack, heap[1], 1, free_blocks - blocks, block_size)
        if got == 0:
            _merge_drop(heap, surv, ell)
            continue
        blocks += taken
        x += 1
        _merge_advance(heap, surv, ell, lim)
    return x, blocks, drafted_positions(gamma, lim, n_req)


# ======================================================================================
# the engines' budgets: vLLM's schedule and adaptive verification, SGLang's SPS table
# ======================================================================================
#: KV tokens per request of vLLM's warm-up timing runs for adaptive verification
#: (VLLM_ADAPTIVE_VERIFICATION_PROFILE_CONTEXT_LEN, vllm/envs.py:1103-1105)
VERIFY_PROFILE_CONTEXT = 8192
#: KV tokens per request of the decode steps the SPS table servetune writes times (the
#: default context of ``servetune cost sps``)
SPS_TABLE_CONTEXT = 1024
#: SGLang drops extensions whose survival falls below this (DSparkScheduleConfig.survival_eps)
SURVIVAL_EPS = 1e-6


@njit(cache=True, nogil=True, _nrt=False)
def batch_schedule_k(gamma, batch_2, k_2, batch_3, k_3, scheduled):
    """vLLM's k for the drafts proposed after a step that scheduled ``scheduled`` requests:
    gamma below batch_2, k_2 from it, k_3 from batch_3 (0 = no such range); none scheduled:
    gamma (vllm/v1/core/sched/scheduler.py:1709-1714); capped at gamma."""
    k = gamma
    if scheduled > 0 and 0 < batch_2 <= scheduled:
        k = k_2
    if scheduled > 0 and 0 < batch_3 <= scheduled:
        k = k_3
    return min(k, gamma)


@njit(cache=True, nogil=True, _nrt=False)
def stale_confidences(reqs, tok, n_req, profiles, rows, seed, spread, bias, gamma, surv):
    """Survival the engines' budgets see: an earlier draft's (token index t - 1), or 1.0 at
    every position for a request verifying its first draft (t <= 1)."""
    for k in range(n_req):
        if tok[k] <= 1:
            surv[k, :gamma] = 1.0
            continue
        r = reqs[k]
        a = 1.0
        for i in range(gamma):
            a *= min(1.0, true_confidence(profiles, rows[r], seed, r, tok[k] - 1, i, spread) * (1.0 + bias))
            surv[k, i] = a


@njit(cache=True, nogil=True, _nrt=False)
def sps_probe_floor(requests, most):
    """The largest request count SGLang's SPS profiler probes at or below ``requests``
    (sglang/benchmark/dspark_sps_profiler.py:557-573, ``build_request_count_sweep``: 1, 2,
    4, 8, 16..56 by 8, 64..112 by 16, 128..224 by 32, 256.. by 64, and ``most``), clamped
    to [1, most]: the table's floor lookup (srt/speculative/dspark_components/dspark_sps.py:38-41)."""
    if requests >= most:
        return most
    if requests < 2:
        return 1
    if requests < 16:
        p = 1
        while p * 2 <= requests:
            p *= 2
        return p
    if requests < 64:
        return requests - requests % 8
    if requests < 128:
        return requests - requests % 16
    if requests < 256:
        return requests - requests % 32
    return requests - requests % 64


@njit(cache=True, nogil=True, _nrt=False)
def sps_table_seconds(tables, requests, gamma, context, draft_mode, draft_value):
    """Seconds of the decode step an SPS probe times: ``requests`` requests of ``context``
    KV tokens verifying gamma + 1 tokens each, after drafting gamma positions."""
    tokens = requests * (gamma + 1)
    seconds, _ = step_seconds(tables, tokens, tokens, requests, requests * context + requests * gamma, 0)
    return seconds + gamma * draft_seconds_per_position(tables, draft_mode, draft_value, requests,
                                                        requests * context)


@njit(cache=True, nogil=True, inline="always")
def _verify_profile_seconds(tables, tokens, gamma):
    """vLLM's warm-up verify time at ``tokens`` target tokens: uniform decodes of gamma + 1
    tokens at VERIFY_PROFILE_CONTEXT (vllm/v1/worker/gpu/spec_decode/adaptive_verification.py:211-277)."""
    requests = max(1, (tokens + gamma) // (gamma + 1))
    seconds, _ = step_seconds(tables, tokens, tokens, requests, requests * VERIFY_PROFILE_CONTEXT + tokens, 0)
    return seconds


@njit(cache=True, nogil=True, inline="always")
def _budget_value(mode, tau, b, n_req, b_tokens, gamma, tables, draft_s, most, context, draft_mode, draft_value):
    """What the engine's budget maximises at b admitted drafts and expected tokens tau."""
    if mode == MODE_ADAPTIVE:
        return tau / (draft_s + _verify_profile_seconds(tables, b_tokens + b, gamma))
    probe = sps_probe_floor((n_req + b) // (gamma + 1), most)
    return tau / sps_table_seconds(tables, probe, gamma, context, draft_mode, draft_value)


@njit(cache=True, nogil=True, _nrt=False)
def engine_budget(mode, surv, lim, n_req, tau0, gamma, tables, b_tokens, draft_s, most, context, draft_mode,
                  draft_value, pos, heap):
    """The total drafts b (first of ties) the engine's budget keeps, over stale survivals
    ``surv`` in global order (``adaptive_verify``: tau0 = sampling requests, b_tokens the
    step's other tokens; the SGLang modes: tau0 = the decode requests)."""
    _merge_start(heap, surv, pos, lim, n_req)
    tau = tau0
    best = _budget_value(mode, tau, 0, n_req, b_tokens, gamma, tables, draft_s, most, context, draft_mode,
                         draft_value)
    best_b = 0
    b = 0
    while heap[0] > 0:
        a = surv[heap[1], pos[heap[1]]]
        if mode != MODE_ADAPTIVE and a < SURVIVAL_EPS:
            break
        tau += a
        b += 1
        value = _budget_value(mode, tau, b, n_req, b_tokens, gamma, tables, draft_s, most, context, draft_mode,
                              draft_value)
        if value > best:
            best = value
            best_b = b
        _merge_advance(heap, surv, pos, lim)
    return best_b


# ======================================================================================
# one call per step
# ======================================================================================
@njit(cache=True, nogil=True, _nrt=False)
def verify_budgets(mode, gamma, k_fixed, n_req, surv, alpha, lim, tables, b_tokens, b_logits, b_decodes, b_kv,
                   b_pairs, draft_pp, token_left, slack, free_blocks, block_size, lag_k, ell, heap, scratch):
    """Fill ``ell[:n_req]`` under ``mode`` for the decode slots of a step (the modes whose
    budget reads no stale confidences; k_fixed: the k of fixed and batch_schedule).

    lim[k]: most drafts slot k may verify (gamma and its remaining output cap); surv:
    seen survival (``draft_confidences``; dspark modes); alpha: acceptance estimate
    (``acceptance_estimate``; smartspec); b_*: the step's shape without verify tokens;
    draft_pp: ``draft_seconds_per_position``; token_left: token budget left; slack[k]:
    free KV slots in the blocks slot k holds past its own token (updated in place);
    free_blocks: blocks verify tokens may take; lag_k: dspark_lagged's K from two
    steps back. Returns (verify tokens, blocks taken, drafted positions, K of this
    step's confidences for dspark_lagged (else 0)).
    """
    if mode == MODE_OFF or n_req == 0:
        ell[:n_req] = 0
        return 0, 0, 0, 0
    if mode == MODE_DSPARK:
        x, blocks, positions = dspark_budgets(surv, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv,
                                              b_pairs, draft_pp, token_left, slack, free_blocks, block_size, ell, heap)
        return x, blocks, positions, 0
    if mode == MODE_DSPARK_LAGGED:
        k_now = dspark_global_k(surv, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs,
                                draft_pp, token_left, scratch, heap)
        x, blocks, positions = topk_budgets(surv, lim, n_req, gamma, lag_k, token_left, slack, free_blocks,
                                            block_size, ell, heap)
        return x, blocks, positions, k_now
    k_verify = k_fixed
    if mode == MODE_SMARTSPEC:
        k_verify = smartspec_k(alpha, lim, n_req, gamma, tables, b_tokens, b_logits, b_decodes, b_kv, b_pairs,
                               draft_pp, token_left)
    x, blocks = fixed_budgets(k_verify, lim, n_req, token_left, slack, free_blocks, block_size, ell)
    return x, blocks, drafted_positions(k_verify, lim, n_req), 0


def sps_probe_counts(most: int) -> list[int]:
    """The request counts SGLang's SPS profiler probes up to ``most`` (``sps_probe_floor``'s grid)."""
    raw = [1, 2, 4, 8, *range(16, 64, 8), *range(64, 128, 16), *range(128, 256, 32), *range(256, most + 1, 64)]
    counts = sorted({v for v in raw if v <= most})
    return counts if counts[-1] == most else [*counts, most]


# ======================================================================================
# Python side: the acceptance profile of a trace
# ======================================================================================
@dataclass(frozen=True)
class AcceptanceModel:
    """How often the drafter is right, per SLO class or tenant, and how honest it is.

    ``default``: conditional acceptance per draft position for requests no profile names;
    ``profiles``: name -> the same, for the SLO classes (``by="slo_class"``) or tenants
    (``by="tenant"``) of the trace; positions past a profile's end are never accepted.
    ``spread`` in [0, 1]: per-verify variation of the true confidences around the
    profile; ``bias`` > -1: the scheduler sees ``min(1, true * (1 + bias))``.

    The profiles are a side array beside the flat config vector: one row per profile,
    ``rows[r]`` naming request r's.
    """

    default: Sequence[float] = DEFAULT_PROFILE
    by: str = "slo_class"
    profiles: Mapping[str, Sequence[float]] = field(default_factory=dict)
    spread: float = 0.0
    bias: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "default", _profile("default", self.default))
        object.__setattr__(self, "profiles", {str(name): _profile(f"profiles[{name!r}]", values)
                                              for name, values in dict(self.profiles).items()})
        if self.by not in ("slo_class", "tenant"):
            raise ValueError(f"AcceptanceModel.by must be 'slo_class' or 'tenant', got {self.by!r}")
        if not 0.0 <= self.spread <= 1.0:
            raise ValueError(f"AcceptanceModel.spread must be in [0, 1], got {self.spread!r}")
        if not (np.isfinite(self.bias) and self.bias > -1.0):
            raise ValueError(f"AcceptanceModel.bias must be a finite number > -1, got {self.bias!r}")

    def arrays(self, trace, gamma: int) -> tuple[np.ndarray, np.ndarray]:
        """(profiles f8[P, gamma], rows i8[n]) for the kernel: row 0 is ``default``."""
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        names = tuple(trace.slo_class_names if self.by == "slo_class" else trace.tenant_names)
        unknown = sorted(set(self.profiles) - set(names))
        if unknown:
            raise ValueError(f"acceptance profile(s) {unknown} name no {self.by} of the trace; "
                             f"its {self.by} names are {list(names)}")
        named = [name for name in names if name in self.profiles]
        table = np.zeros((1 + len(named), gamma))
        for row, values in enumerate([self.default, *(self.profiles[name] for name in named)]):
            m = min(gamma, len(values))
            table[row, :m] = values[:m]
        row_of_code = np.zeros(len(names), dtype=np.int64)
        for row, name in enumerate(named, start=1):
            row_of_code[names.index(name)] = row
        codes = np.asarray(trace.slo_class if self.by == "slo_class" else trace.tenant, dtype=np.int64)
        return table, row_of_code[codes]


def _profile(what: str, values: Sequence[float]) -> tuple[float, ...]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError):
        raise ValueError(f"acceptance profile {what} must be a list of probabilities, got {values!r}") from None
    if not out:
        raise ValueError(f"acceptance profile {what} is empty; give at least one position")
    for i, p in enumerate(out):
        if not 0.0 <= p <= 1.0:  # also rejects NaN
            raise ValueError(f"acceptance profile {what} position {i + 1} must be in [0, 1], got {p!r}")
    return out


def mean_accepted_length(profile: Sequence[float], k: int) -> float:
    """Expected tokens of a k-draft verify with conditional acceptances ``profile``:
    1 + sum_j prod_{i<=j} p_i (the bonus token plus the expected accepted run)."""
    total, survival = 1.0, 1.0
    for p in list(profile)[:k]:
        survival *= p
        total += survival
    return total
