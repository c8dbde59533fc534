"""Plain-Python twin of ``policies.speculative``, for the reference simulator and tests.

The same rules written plainly: Python integers masked to 64 bits for the hash, lists,
and a full sort of every prefix extension instead of the kernel's k-way heap merge. Only
the cost model's lookups (``step_seconds`` and, for dspark's early stop,
``step_seconds_at_tile_ends``) are shared, so agreement checks the rules, not a shared
helper.
"""

from __future__ import annotations

from costmodels.steptable import step_seconds, step_seconds_at_tile_ends
from policies.speculative import (
    ALPHA_DECAY,
    MODE_ADAPTIVE,
    MODE_DSPARK,
    MODE_DSPARK_LAGGED,
    MODE_OFF,
    MODE_SMARTSPEC,
    PRIOR_TRIALS,
    STREAM_ACCEPT,
    STREAM_NOISE,
    SURVIVAL_EPS,
    VERIFY_PROFILE_CONTEXT,
    sps_probe_counts,
)

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _absorb(h: int, key: int) -> int:
    z = ((h ^ key) + GOLDEN) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def uniform(seed: int, r: int, t: int, i: int, stream: int) -> float:
    h = 0
    for key in (int(seed) & MASK, int(r) & MASK, int(t) & MASK, ((int(i) << 1) | int(stream)) & MASK):
        h = _absorb(h, key)
    return (h >> 11) * 2.0**-53


def true_confidence(profile_row, seed, r, t, i, spread) -> float:
    p = float(profile_row[i])
    if spread > 0.0:
        u = uniform(seed, r, t, i, STREAM_NOISE)
        p = p + spread * (2.0 * u - 1.0) * min(p, 1.0 - p)
    return p


def survival(profile_row, seed, r, t, gamma, spread, bias) -> list[float]:
    """Seen survival a_j, j = 1..gamma, for one verify."""
    out, a = [], 1.0
    for i in range(gamma):
        a *= min(1.0, true_confidence(profile_row, seed, r, t, i, spread) * (1.0 + bias))
        out.append(a)
    return out


def accepted_drafts(profile_row, seed, r, t, ell, spread) -> int:
    run = 0
    for i in range(ell):
        if uniform(seed, r, t, i, STREAM_ACCEPT) >= true_confidence(profile_row, seed, r, t, i, spread):
            break
        run += 1
    return run


def step_time(tables, shape, x, draft_s) -> float:
    b_tokens, b_logits, b_decodes, b_kv, b_pairs = shape
    seconds, _ = step_seconds(tables, b_tokens + x, b_logits + x, b_decodes, b_kv + x, b_pairs)
    return seconds + draft_s


def planned_time(tables, shape, x, draft_s) -> float:
    """Step time read between GEMM tile ends: what dspark's early stop weighs."""
    b_tokens, b_logits, b_decodes, b_kv, b_pairs = shape
    seconds, _ = step_seconds_at_tile_ends(tables, b_tokens + x, b_logits + x, b_decodes, b_kv + x, b_pairs)
    return seconds + draft_s


def drafted(limit, lim) -> int:
    return max([min(limit, m) for m in lim], default=0)


class KV:
    """Free KV for verify tokens: each slot's spare held slots, then shared free blocks."""

    def __init__(self, slack, free_blocks, block_size):
        self.slack = [int(s) for s in slack]
        self.free = int(free_blocks)
        self.bs = block_size
        self.taken = 0

    def can_take_one(self, k) -> bool:
        return self.slack[k] > 0 or self.free > 0

    def take(self, k, want) -> int:
        got = 0
        while got < want and self.can_take_one(k):
            if self.slack[k] == 0:
                self.free -= 1
                self.taken += 1
                self.slack[k] = self.bs
            self.slack[k] -= 1
            got += 1
        return got


def extensions(surv, lim):
    """Every extension (k, j) with positive survival, by survival descending (ties: slot,
    then position): one plain sort."""
    items = [(-surv[k][j], k, j) for k in range(len(lim)) for j in range(min(lim[k], len(surv[k])))
             if surv[k][j] > 0.0]
    return [(k, -neg) for neg, k, _ in sorted(items)]


def fixed(k_verify, lim, token_left, kv):
    ell, x = [], 0
    for k, m in enumerate(lim):
        got = kv.take(k, min(k_verify, m, token_left - x))
        ell.append(got)
        x += got
    return ell, x


def l_expected(alpha, k) -> float:
    total, term = 0.0, 1.0
    for _ in range(k + 1):
        total += term
        term *= alpha
    return total


def smartspec_k(alpha, lim, gamma, tables, shape, draft_pp, token_left) -> int:
    best_k, best = 0, len(lim) / step_time(tables, shape, 0, 0.0)
    for kk in range(1, gamma + 1):
        x = sum(min(kk, m) for m in lim)
        tokens = 0.0
        for a, m in zip(alpha, lim, strict=True):
            tokens += l_expected(a, min(kk, m))
        if x > token_left:
            break
        rate = tokens / step_time(tables, shape, x, kk * draft_pp)
        if rate > best:
            best, best_k = rate, kk
    return best_k


def dspark(surv, lim, gamma, tables, shape, draft_pp, token_left, kv):
    positions = drafted(gamma, lim)
    draft_s = positions * draft_pp
    ell = [0] * len(lim)
    tau = float(len(lim))
    best = tau / planned_time(tables, shape, 0, draft_s)
    x, dropped = 0, set()
    for k, a in extensions(surv, lim):
        if x >= token_left:
            break
        if k in dropped:
            continue
        if not kv.can_take_one(k):
            dropped.add(k)
            continue
        theta = (tau + a) / planned_time(tables, shape, x + 1, draft_s)
        if not theta > best:
            break  # the causal early stop
        kv.take(k, 1)
        best, tau, x = theta, tau + a, x + 1
        ell[k] += 1
    return ell, x, positions


def global_k(surv, lim, gamma, tables, shape, draft_pp, token_left) -> int:
    draft_s = drafted(gamma, lim) * draft_pp
    tau = float(len(lim))
    best, best_x = tau / step_time(tables, shape, 0, draft_s), 0
    for x, (_, a) in enumerate(extensions(surv, lim)[:max(token_left, 0)], start=1):
        tau += a
        theta = tau / step_time(tables, shape, x, draft_s)
        if theta > best:
            best, best_x = theta, x
    return best_x


def topk(surv, lim, k_total, token_left, kv):
    ell, x, dropped = [0] * len(lim), 0, set()
    for k, _ in extensions(surv, lim):
        if x >= min(k_total, token_left):
            break
        if k in dropped:
            continue
        if kv.take(k, 1) == 0:
            dropped.add(k)
            continue
        ell[k] += 1
        x += 1
    return ell, x


def verify_budgets(mode, gamma, k_fixed, surv, alpha, lim, tables, shape, draft_pp, token_left, slack, free_blocks,
                   block_size, lag_k):
    """(ell, verify tokens, blocks taken, drafted positions, K now, slack after)."""
    kv = KV(slack, free_blocks, block_size)
    lim = [int(m) for m in lim]
    k_now, positions = 0, 0
    if mode == MODE_OFF or not lim:
        ell, x = [0] * len(lim), 0
    elif mode == MODE_DSPARK:
        ell, x, positions = dspark(surv, lim, gamma, tables, shape, draft_pp, token_left, kv)
    elif mode == MODE_DSPARK_LAGGED:
        k_now = global_k(surv, lim, gamma, tables, shape, draft_pp, token_left)
        ell, x = topk(surv, lim, lag_k, token_left, kv)
        positions = drafted(gamma, lim)
    else:
        k_verify = k_fixed
        if mode == MODE_SMARTSPEC:
            k_verify = smartspec_k(alpha, lim, gamma, tables, shape, draft_pp, token_left)
        ell, x = fixed(k_verify, lim, token_left, kv)
        positions = drafted(k_verify, lim)
    return ell, x, kv.taken, positions, k_now, kv.slack


class AcceptanceCounts:
    """SmartSpec's moving acceptance counts, per request and for the run."""

    def __init__(self):
        self.hits: dict[int, float] = {}
        self.trials: dict[int, float] = {}
        self.run_hits = 0.0
        self.run_trials = 0.0

    def alpha(self, r) -> float:
        run_rate = (self.run_hits + 1.0) / (self.run_trials + 2.0)
        return (self.hits.get(r, 0.0) + PRIOR_TRIALS * run_rate) / (self.trials.get(r, 0.0) + PRIOR_TRIALS)

    def observe(self, r, ell, accepted) -> None:
        if ell == 0:
            return
        tested = accepted + (1 if accepted < ell else 0)
        self.hits[r] = ALPHA_DECAY * self.hits.get(r, 0.0) + accepted
        self.trials[r] = ALPHA_DECAY * self.trials.get(r, 0.0) + tested
        self.run_hits = ALPHA_DECAY * self.run_hits + accepted
        self.run_trials = ALPHA_DECAY * self.run_trials + tested


# -- the engines' budgets ----------------------------------------------------------------
def schedule_k(gamma, batch_2, k_2, batch_3, k_3, scheduled) -> int:
    """vLLM's k after a step of ``scheduled`` requests: the last range starting at or below it."""
    k = gamma
    if scheduled > 0:
        for start, value in ((batch_2, k_2), (batch_3, k_3)):
            if 0 < start <= scheduled:
                k = value
    return min(k, gamma)


def stale_survival(profile_row, seed, r, t, gamma, spread, bias) -> list[float]:
    """An earlier draft's survival (token index t - 1); sure for a first verify."""
    return [1.0] * gamma if t <= 1 else survival(profile_row, seed, r, t - 1, gamma, spread, bias)


def draft_per_position(tables, mode, value, n, kv) -> float:
    if n == 0:
        return 0.0
    return value * step_seconds(tables, n, n, n, kv, 0)[0] if mode == "fraction" else value * 1e-3


def sps_probe_time(tables, requests, gamma, context, draft_mode, draft_value) -> float:
    tokens = requests * (gamma + 1)
    seconds = step_seconds(tables, tokens, tokens, requests, requests * context + requests * gamma, 0)[0]
    return seconds + gamma * draft_per_position(tables, draft_mode, draft_value, requests, requests * context)


def engine_budget(mode, surv, lim, tau0, gamma, tables, b_tokens, draft_s, most, context, draft_mode,
                  draft_value) -> int:
    """The total drafts the engine keeps: the first argmax over the global survival order."""
    n = len(lim)

    def value(tau, b):
        if mode == MODE_ADAPTIVE:
            tokens = b_tokens + b
            requests = max(1, (tokens + gamma) // (gamma + 1))
            verify = step_seconds(tables, tokens, tokens, requests, requests * VERIFY_PROFILE_CONTEXT + tokens, 0)[0]
            return tau / (draft_s + verify)
        q = (n + b) // (gamma + 1)
        probe = max([p for p in sps_probe_counts(most) if p <= q], default=1)
        return tau / sps_probe_time(tables, probe, gamma, context, draft_mode, draft_value)

    tau, best_b = float(tau0), 0
    best = value(tau, 0)
    for b, (_, a) in enumerate(extensions(surv, lim), start=1):
        if mode != MODE_ADAPTIVE and a < SURVIVAL_EPS:
            break
        tau += a
        v = value(tau, b)
        if v > best:
            best, best_b = v, b
    return best_b
