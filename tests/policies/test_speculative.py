"""Speculative decoding building blocks: the acceptance model, the sampler, the verify-budget
policies (against brute force, the DSpark paper's example and SmartSpec's closed form),
and the jitted kernels against their plain-Python twins."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from costmodels.steptable import StepTables, linear_tables, step_seconds, step_seconds_at_tile_ends
from policies import speculative as sp

from . import reference_speculative as ref
from .conftest import make_trace

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ======================================================================================
# builders
# ======================================================================================
def sps_tables(seconds_by_tokens) -> StepTables:
    """Step time = seconds_by_tokens[B - 1] at B batched tokens, nothing else costs: an
    SPS(B) table as the DSpark paper states its examples."""
    b = np.arange(1, len(seconds_by_tokens) + 1, dtype=float)
    flat = np.array([0.0, 1e12])
    return StepTables.from_grids(
        linear_tokens=b, linear_s=np.asarray(seconds_by_tokens, dtype=float), head_seqs=flat, head_s=np.zeros(2),
        decode_batch=flat, decode_kv=flat, decode_s=np.zeros((2, 2)), decode_kv_measured=np.full(2, 1e12),
        prefill_pairs=flat, prefill_s=np.zeros(2), overhead_s=0.0, scale=1.0)


def jagged_tables() -> StepTables:
    """Step-wise in tokens like profiled GEMM tiles (flat inside a tile, a jump at each):
    the jagged SPS(B) of DSpark section 5.2, where Theta is not unimodal."""
    tokens = np.array([0.0, 16, 17, 32, 33, 64, 65, 128, 129, 4096])
    seconds = np.array([5.0, 5.0, 7.0, 7.0, 14.0, 14.0, 16.0, 16.0, 20.0, 80.0]) * 1e-3
    flat = np.array([0.0, 1e12])
    return StepTables.from_grids(
        linear_tokens=tokens, linear_s=seconds, head_seqs=flat, head_s=flat * 1e-18,
        decode_batch=flat, decode_kv=flat, decode_s=np.outer(np.ones(2), flat) * 2e-9,
        decode_kv_measured=np.full(2, 1e12), prefill_pairs=flat, prefill_s=np.zeros(2), overhead_s=0.0, scale=1.0)


TABLES = {"linear": linear_tables(per_token_s=2e-4, per_seq_s=1e-5, overhead_s=0.006), "jagged": jagged_tables()}


class Batch:
    """Buffers for one step's decode slots, as the engine would hold them."""

    def __init__(self, surv, lim, slack, alpha=None):
        self.surv = np.ascontiguousarray(surv, dtype=float)
        self.n, self.gamma = self.surv.shape
        self.lim = np.asarray(lim, dtype=np.int64)
        self.slack = np.asarray(slack, dtype=np.int64).copy()
        self.alpha = np.full(self.n, 0.5) if alpha is None else np.asarray(alpha, dtype=float)
        self.ell = np.zeros(self.n, dtype=np.int64)
        self.heap = np.zeros(self.n + 1, dtype=np.int64)
        self.scratch = np.zeros(self.n, dtype=np.int64)

    def budgets(self, mode, tables, shape, draft_pp=0.0, token_left=1 << 20, free_blocks=1 << 20, block_size=16,
                lag_k=0):
        return sp.verify_budgets(mode, self.gamma, self.gamma, self.n, self.surv, self.alpha, self.lim, tables,
                                 *shape, draft_pp, token_left, self.slack, free_blocks, block_size, lag_k, self.ell, self.heap,
                                 self.scratch)


def decode_shape(n, kv_per_request=512):
    """(tokens, logit seqs, decodes, KV read, prefill pairs) of n plain decodes."""
    return (n, n, n, n * kv_per_request, 0)


def survival_rows(conditionals):
    return np.cumprod(np.asarray(conditionals, dtype=float), axis=1)


def theta(surv, ell, tables, shape, draft_s, step_time=ref.planned_time):
    """tau * SPS(B) of verify budgets ell; SPS read as dspark's early stop reads it."""
    tau = len(ell) + sum(float(surv[k, :m].sum()) for k, m in enumerate(ell))
    return tau / step_time(tables, shape, int(sum(ell)), draft_s)


def brute_force_best(surv, lim, token_left, tables, shape, draft_s):
    feasible = [ell for ell in itertools.product(*(range(m + 1) for m in lim)) if sum(ell) <= token_left]
    return max(theta(surv, ell, tables, shape, draft_s) for ell in feasible)


# ======================================================================================
# DSpark
# ======================================================================================
CONDITIONAL = st.sampled_from([0.0, 0.2, 0.45, 0.6, 0.8, 0.9, 0.97, 1.0])


@st.composite
def small_batches(draw, max_r=3, max_gamma=3):
    r = draw(st.integers(1, max_r))
    gamma = draw(st.integers(1, max_gamma))
    conditional = [[draw(CONDITIONAL) for _ in range(gamma)] for _ in range(r)]
    lim = [draw(st.integers(0, gamma)) for _ in range(r)]
    return survival_rows(conditional), lim


@FAST
@given(batch=small_batches(), per_token=st.sampled_from([1e-4, 1e-3, 5e-3]),
       overhead=st.sampled_from([1e-3, 5e-3, 2e-2]), token_left=st.integers(0, 9),
       draft_pp=st.sampled_from([0.0, 1e-3]), context=st.integers(0, 4000))
def test_dspark_equals_brute_force_when_theta_is_unimodal(batch, per_token, overhead, token_left, draft_pp, context):
    # a linear step time makes tau*(B) * SPS(B) unimodal: the early stop is then optimal
    surv, lim = batch
    tables = linear_tables(per_token_s=per_token, per_seq_s=per_token / 4, overhead_s=overhead)
    shape = decode_shape(len(lim), context)
    b = Batch(surv, lim, slack=[1 << 20] * len(lim))
    x, blocks, positions, _ = b.budgets(sp.MODE_DSPARK, tables, shape, draft_pp, token_left)
    draft_s = positions * draft_pp
    assert positions == max(lim) and blocks == 0 and x == b.ell.sum() <= token_left

    best = brute_force_best(surv, lim, token_left, tables, shape, draft_s)
    assert theta(surv, b.ell, tables, shape, draft_s) == pytest.approx(best, rel=1e-12)
    # and the lagged variant's global argmax finds the same number of extensions
    assert sp.dspark_global_k(surv, b.lim, b.n, b.gamma, tables, *shape, draft_pp, token_left, b.scratch,
                              b.heap) == x


@FAST
@given(batch=small_batches(), prefill=st.integers(0, 40), token_left=st.integers(0, 9))
def test_dspark_equals_brute_force_on_a_tiled_table_read_between_tile_ends(batch, prefill, token_left):
    # on a staircase table the early stop weighs SPS between tile ends; where tau * SPS
    # read so is unimodal, the stop is again the best of every feasible budget vector
    surv, lim = batch
    tables = jagged_tables()
    shape = (len(lim) + prefill, len(lim), len(lim), 512 * len(lim), 0)
    positive = sorted((a for k, m in enumerate(lim) for a in surv[k, :m] if a > 0), reverse=True)
    curve = [(len(lim) + sum(positive[:x])) / ref.planned_time(tables, shape, x, 0.0)
             for x in range(min(token_left, len(positive)) + 1)]
    peak = int(np.argmax(curve))
    assume(all(a < b for a, b in itertools.pairwise(curve[:peak + 1]))
           and all(a >= b for a, b in itertools.pairwise(curve[peak:])))
    b = Batch(surv, lim, slack=[1 << 20] * len(lim))
    x, *_ = b.budgets(sp.MODE_DSPARK, tables, shape, 0.0, token_left)
    assert x == peak
    assert theta(surv, b.ell, tables, shape, 0.0) == pytest.approx(
        brute_force_best(surv, lim, token_left, tables, shape, 0.0), rel=1e-12)


def test_tile_end_reading_joins_tile_ends_and_keeps_tables_without_tiles():
    tables = jagged_tables()
    ends, ends_s = [0, 16, 32, 64, 128, 4096], [5e-3, 5e-3, 7e-3, 14e-3, 16e-3, 80e-3]
    for tokens in [*range(1, 200), 1000, 4096]:
        raw, _ = step_seconds(tables, tokens, 0, 0, 0, 0)
        read, _ = step_seconds_at_tile_ends(tables, tokens, 0, 0, 0, 0)
        assert read == pytest.approx(np.interp(tokens, ends, ends_s), rel=1e-12)
        assert read <= raw + 1e-15  # never dearer than the staircase ...
        if tokens in ends:
            assert read == raw  # ... and the staircase itself at every tile end
    # past the last point both extrapolate the same way; tables without tile edges are unchanged
    assert step_seconds_at_tile_ends(tables, 5000, 0, 0, 0, 0) == step_seconds(tables, 5000, 0, 0, 0, 0)
    for t, shape in ((sps_tables([1.0, 2.0, 1 / 0.45]), (2, 2, 0, 0, 0)),
                     (TABLES["linear"], (300, 40, 40, 40 * 900, 5e4))):
        assert step_seconds_at_tile_ends(t, *shape) == step_seconds(t, *shape)


def test_tile_end_reading_smooths_the_profiled_staircase():
    from costmodels.build import build

    tables = build("llama-3.1-8b", "h100_sxm").tables
    tokens = np.arange(1, 8193)  # 64 decodes over 64k KV tokens, and prefill tokens besides
    raw = np.array([step_seconds(tables, b, 64, 64, 65536, 0)[0] for b in tokens])
    read = np.array([step_seconds_at_tile_ends(tables, b, 64, 64, 65536, 0)[0] for b in tokens])
    assert np.all(read <= raw + 1e-15) and np.all(np.diff(read) >= 0)
    # the jumps where a GEMM tile opens (0.2-1 ms at 65, 257, 1025 tokens) are spread over their tiles
    assert np.diff(raw).max() > 4e-4 and np.diff(read).max() < 0.25 * np.diff(raw).max()
    edges = np.flatnonzero(np.diff(raw) > 1e-4)  # the last token of each tile
    assert len(edges) > 10 and np.array_equal(read[edges], raw[edges])


def test_appendix_a_early_stop_declines_the_first_extension():
    # a1 = 0.8, SPS(1, 2, 3) = (1.0, 0.5, 0.45): verifying the first draft gives
    # Theta = 1.8 * 0.5 = 0.9 < 1.0, so DSpark stops at once and verifies nothing, even when
    # a second draft would have paid (a2 = 0.6: 2.4 * 0.45 = 1.08) -- a2 depends on the
    # token sampled at position 1, so looking past a non-improving step is not causal.
    tables = sps_tables([1.0, 1 / 0.5, 1 / 0.45])
    for a2 in (0.6, 0.4):
        b = Batch([[0.8, a2]], lim=[2], slack=[8])
        assert b.budgets(sp.MODE_DSPARK, tables, (1, 0, 0, 0, 0))[0] == 0
        assert b.ell.tolist() == [0]
    # the production variant without the early stop takes the global argmax instead
    b = Batch([[0.8, 0.6]], lim=[2], slack=[8])
    assert sp.dspark_global_k(b.surv, b.lim, 1, 2, tables, 1, 0, 0, 0, 0, 0.0, 9, b.scratch, b.heap) == 2
    b = Batch([[0.8, 0.4]], lim=[2], slack=[8])
    assert sp.dspark_global_k(b.surv, b.lim, 1, 2, tables, 1, 0, 0, 0, 0, 0.0, 9, b.scratch, b.heap) == 0


def test_top_k_takes_the_highest_survivals_across_requests_in_prefix_order():
    surv = survival_rows([[0.9, 0.9, 0.2], [0.5, 0.9, 0.9], [0.95, 0.1, 0.9]])
    b = Batch(surv, lim=[3, 3, 3], slack=[16] * 3)
    x, *_ = b.budgets(sp.MODE_DSPARK_LAGGED, TABLES["linear"], decode_shape(3), lag_k=3)
    assert x == 3 and b.ell.tolist() == [2, 0, 1]  # 0.95 of request 2; 0.9, 0.81 of request 0
    # equal survivals go to the earlier slot in the batch
    b = Batch(survival_rows([[0.7, 0.5], [0.7, 0.5], [0.7, 0.9]]), lim=[2, 2, 2], slack=[16] * 3)
    b.budgets(sp.MODE_DSPARK_LAGGED, TABLES["linear"], decode_shape(3), lag_k=2)
    assert b.ell.tolist() == [1, 1, 0]


def test_a_tile_edge_does_not_stop_dspark_and_the_lagged_k_is_the_raw_argmax():
    # the batch's prefill chunks fill a 16-token tile, so the first verify token crosses
    # into the next tile (5 -> 7 ms): on the raw staircase it lowers Theta and an early
    # stop there would verify nothing, although the whole next tile pays. dspark reads
    # SPS between tile ends and verifies all 32 drafts; the lagged K is the global argmax
    # over the raw table, which fills exactly the next tile (16 tokens).
    tables = jagged_tables()
    surv = survival_rows([[0.98] * 8] * 4)
    shape = (16, 4, 4, 4 * 512, 0)  # prefill chunks already fill the first tile
    assert theta(surv, [1, 0, 0, 0], tables, shape, 0.0, ref.step_time) < theta(surv, [0] * 4, tables, shape, 0.0,
                                                                                  ref.step_time)
    b = Batch(surv, lim=[8] * 4, slack=[64] * 4)
    x_dspark, *_ = b.budgets(sp.MODE_DSPARK, tables, shape)
    assert x_dspark == 32 and b.ell.tolist() == [8, 8, 8, 8]
    k = sp.dspark_global_k(b.surv, b.lim, 4, 8, tables, *shape, 0.0, 1 << 20, b.scratch, b.heap)
    assert k == 16
    x, _, _, k_now = b.budgets(sp.MODE_DSPARK_LAGGED, tables, shape, lag_k=k)
    assert x == 16 and k_now == 16 and b.ell.tolist() == [4, 4, 4, 4]


def test_verify_budget_shrinks_as_the_batch_grows_on_a_profiled_gpu():
    # DSpark Fig 8's shape on the bundled H100 tables for Llama-3.1-8B: the whole block
    # at low concurrency, fewer drafts as the batch grows. The 64 -> 65 token tile edge
    # does not stop the search (on the raw table the early stop verified one draft per
    # request at 64). Decode attention, paid per sequence, dominates these steps even at
    # 512 sequences, so verifying stays cheap there and the budget bottoms out near two;
    # the engine's shape test drives a compute-bound model to 0-1.
    from costmodels.build import build

    tables = build("llama-3.1-8b", "h100_sxm").tables
    profile = np.array([sp.DEFAULT_PROFILE[:7]])
    mean_budget = {}
    for n in (1, 4, 16, 64, 256, 512):
        surv = np.zeros((n, 7))
        sp.draft_confidences(np.arange(n), np.zeros(n, dtype=np.int64), n, profile, np.zeros(n, dtype=np.int64),
                             3, 0.3, 0.0, 7, surv)
        b = Batch(surv, lim=[7] * n, slack=[1 << 20] * n)
        x, *_ = b.budgets(sp.MODE_DSPARK, tables, decode_shape(n, 1024), 0.0, 8192)
        mean_budget[n] = x / n
    assert [mean_budget[n] for n in (1, 4, 16)] == [7, 7, 7]
    assert mean_budget[64] >= 4.5 and mean_budget[512] <= 2.5
    assert all(a >= b for a, b in itertools.pairwise(mean_budget.values()))


# ======================================================================================
# token budget and KV
# ======================================================================================
@st.composite
def batches(draw):
    r = draw(st.integers(0, 7))
    gamma = draw(st.integers(1, 6))
    conditional = [[draw(CONDITIONAL) for _ in range(gamma)] for _ in range(r)]
    surv = survival_rows(conditional) if r else np.zeros((0, gamma))
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    return dict(
        surv=surv, gamma=gamma,
        lim=[draw(st.integers(0, gamma)) for _ in range(r)],
        slack=[draw(st.integers(0, block_size - 1)) for _ in range(r)],
        alpha=[draw(st.sampled_from([0.0, 0.3, 0.7, 0.95, 1.0])) for _ in range(r)],
        block_size=block_size,
        free_blocks=draw(st.integers(0, 6)),
        token_left=draw(st.integers(0, 40)),
        shape=(r + draw(st.integers(0, 150)), r, r, r * draw(st.integers(0, 3000)), draw(st.integers(0, 10**5))),
        draft_pp=draw(st.sampled_from([0.0, 2e-4, 3e-3])),
        lag_k=draw(st.integers(0, 30)),
        tables=draw(st.sampled_from(sorted(TABLES))),
    )


@FAST
@given(case=batches(), mode=st.sampled_from(range(sp.MODE_ADAPTIVE)))  # the modes verify_budgets plans
def test_budgets_match_the_python_twin_and_respect_every_limit(case, mode):
    tables = TABLES[case["tables"]]
    b = Batch(case["surv"], case["lim"], case["slack"], case["alpha"])
    got = b.budgets(mode, tables, case["shape"], case["draft_pp"], case["token_left"], case["free_blocks"],
                    case["block_size"], case["lag_k"])
    ell, x, blocks, positions, k_now, slack = ref.verify_budgets(
        mode, case["gamma"], case["gamma"], [list(row) for row in case["surv"]], case["alpha"], case["lim"], tables, case["shape"],
        case["draft_pp"], case["token_left"], case["slack"], case["free_blocks"], case["block_size"], case["lag_k"])
    assert (b.ell[:b.n].tolist(), b.slack.tolist()) == (ell, slack)
    assert tuple(got) == (x, blocks, positions, k_now)

    # limits: per request, token budget, KV (own spare slots first, then whole blocks)
    slack0 = np.asarray(case["slack"], dtype=np.int64)
    assert np.all(b.ell <= b.lim) and x == b.ell.sum() <= case["token_left"]
    need = np.maximum(b.ell - slack0, 0)
    assert blocks == int(((need + case["block_size"] - 1) // case["block_size"]).sum()) <= case["free_blocks"]
    if mode == sp.MODE_OFF:
        assert x == positions == 0
    if mode == sp.MODE_DSPARK_LAGGED:
        assert x <= case["lag_k"]


def test_fixed_k_fills_requests_in_batch_order_until_kv_runs_out():
    b = Batch(np.ones((3, 4)), lim=[4, 2, 4], slack=[1, 0, 3])
    x, blocks, positions, _ = b.budgets(sp.MODE_FIXED, TABLES["linear"], decode_shape(3), free_blocks=1,
                                        block_size=2)
    # request 0: 1 spare slot + the only free block (2 slots) = 3 of 4; request 1: no spare,
    # no block left; request 2: its 3 spare slots
    assert b.ell.tolist() == [3, 0, 3] and (x, blocks, positions) == (6, 1, 4)
    b = Batch(np.ones((3, 4)), lim=[4, 2, 4], slack=[16] * 3)
    assert b.budgets(sp.MODE_FIXED, TABLES["linear"], decode_shape(3), token_left=7)[0] == 7
    assert b.ell.tolist() == [4, 2, 1]


# ======================================================================================
# SmartSpec
# ======================================================================================
@pytest.mark.parametrize("n", [1, 8, 64, 256])
@pytest.mark.parametrize("alpha", [0.5, 0.8, 0.95])
def test_smartspec_picks_the_analytic_best_k(n, alpha):
    per_token, overhead, gamma = 1e-4, 0.01, 8
    tables = linear_tables(per_token_s=per_token, per_seq_s=0.0, per_kv_token_s=0.0, overhead_s=overhead)

    def goodput(k):  # n * l(alpha, k) / T(n + k n)
        return n * (1 - alpha ** (k + 1)) / (1 - alpha) / (overhead + per_token * n * (1 + k))

    k = sp.smartspec_k(np.full(n, alpha), np.full(n, gamma), n, gamma, tables, *decode_shape(n, 0), 0.0, 1 << 20)
    assert k == max(range(gamma + 1), key=goodput)


def test_smartspec_k_falls_with_load_and_draft_cost():
    tables = linear_tables(per_token_s=1e-4, per_seq_s=0.0, per_kv_token_s=0.0, overhead_s=0.01)

    def k(n, draft_pp=0.0):
        return sp.smartspec_k(np.full(n, 0.8), np.full(n, 8), n, 8, tables, *decode_shape(n, 0), draft_pp, 1 << 20)

    by_load = [k(n) for n in (1, 16, 64, 256, 1024)]
    assert by_load[0] == 8 and by_load[-1] <= 1 and by_load == sorted(by_load, reverse=True)
    by_draft = [k(16, d) for d in (0.0, 1e-3, 4e-3, 2e-2)]
    assert by_draft[0] > by_draft[-1] and by_draft == sorted(by_draft, reverse=True)


def test_acceptance_estimate_tracks_observed_acceptance_like_the_twin():
    rng = np.random.default_rng(5)
    n = 4
    hits, trials, est = np.zeros(n), np.zeros(n), np.zeros(2)
    alpha = np.zeros(n)
    counts = ref.AcceptanceCounts()
    reqs = np.arange(n)
    late = []
    for _ in range(200):
        ell = rng.integers(0, 5, n)
        # request k accepts each position with probability 0.2 * (k + 1)
        accepted = np.array([int(np.argmin(np.append(rng.random(m) < 0.2 * (k + 1), False))) for k, m in
                             enumerate(ell)])
        sp.observe_acceptance(hits, trials, est, reqs, ell, accepted, n)
        for r in range(n):
            counts.observe(r, int(ell[r]), int(accepted[r]))
        sp.acceptance_estimate(hits, trials, est, reqs, n, alpha)
        assert alpha.tolist() == [counts.alpha(r) for r in range(n)]
        if _ >= 100:
            late.append(alpha.copy())
    mean = np.mean(late, axis=0)  # the requests accept at 0.2, 0.4, 0.6, 0.8
    assert mean[0] < mean[1] < mean[2] < mean[3]
    assert mean[0] < 0.35 and mean[3] > 0.65


# ======================================================================================
# acceptance model and sampler
# ======================================================================================
@FAST
@given(seed=st.integers(-(2**63), 2**63 - 1), r=st.integers(0, 2**40), t=st.integers(0, 2**31),
       i=st.integers(0, 63), stream=st.integers(0, 1))
def test_uniform_matches_the_twin_bit_for_bit(seed, r, t, i, stream):
    u = sp.uniform(seed, r, t, i, stream)
    assert u == ref.uniform(seed, r, t, i, stream) and 0.0 <= u < 1.0


@FAST
@given(n=st.integers(1, 6), gamma=st.integers(1, 6), seed=st.integers(0, 2**32), spread=st.sampled_from([0.0, 0.3, 1.0]),
       bias=st.sampled_from([-0.5, 0.0, 0.2]), data=st.data())
def test_confidences_and_outcomes_match_the_twin(n, gamma, seed, spread, bias, data):
    profiles = np.array([[data.draw(CONDITIONAL) for _ in range(gamma)] for _ in range(2)])
    rows = np.array([data.draw(st.integers(0, 1)) for _ in range(n)], dtype=np.int64)
    reqs = np.array(data.draw(st.permutations(range(n))), dtype=np.int64)
    tok = np.array([data.draw(st.integers(0, 10**6)) for _ in range(n)], dtype=np.int64)
    ell = np.array([data.draw(st.integers(0, gamma)) for _ in range(n)], dtype=np.int64)
    surv = np.zeros((n, gamma))
    accepted = np.zeros(n, dtype=np.int64)
    sp.draft_confidences(reqs, tok, n, profiles, rows, seed, spread, bias, gamma, surv)
    total = sp.sample_verify(reqs, tok, ell, n, profiles, rows, seed, spread, accepted)
    for k, r in enumerate(reqs):
        row = profiles[rows[r]]
        assert surv[k].tolist() == ref.survival(row, seed, r, tok[k], gamma, spread, bias)
        assert accepted[k] == ref.accepted_drafts(row, seed, r, tok[k], ell[k], spread)
    assert total == accepted.sum() and np.all(accepted <= ell)


def test_outcomes_do_not_depend_on_the_batch():
    profiles = np.array([[0.9, 0.7, 0.5, 0.3]])
    rows = np.zeros(10, dtype=np.int64)
    alone = np.zeros(1, dtype=np.int64)
    sp.sample_verify(np.array([7]), np.array([42]), np.array([4]), 1, profiles, rows, 11, 0.5, alone)
    crowd = np.zeros(5, dtype=np.int64)
    sp.sample_verify(np.array([3, 1, 7, 9, 0]), np.array([5, 42, 42, 2, 42]), np.full(5, 4), 5, profiles, rows, 11,
                     0.5, crowd)
    assert crowd[2] == alone[0]


@pytest.mark.parametrize("spread", [0.0, 0.6])
@pytest.mark.parametrize("bias", [0.0, 0.3])
def test_sampled_tokens_per_verify_match_tau_in_the_long_run(spread, bias):
    # 1 bonus + accepted run averages tau = 1 + sum_j prod_{i<=j} p_i, whatever the
    # scheduler is told (bias) and however confidences vary per verify (spread, mean p)
    profile = [0.85, 0.6, 0.4]
    n = 40000
    profiles = np.array([profile])
    reqs = np.arange(n, dtype=np.int64)
    tok = np.arange(n, dtype=np.int64) % 97
    accepted = np.zeros(n, dtype=np.int64)
    sp.sample_verify(reqs, tok, np.full(n, 3), n, profiles, np.zeros(n, dtype=np.int64), 2024, spread, accepted)
    tau = sp.mean_accepted_length(profile, 3)
    assert tau == pytest.approx(1 + 0.85 + 0.85 * 0.6 + 0.85 * 0.6 * 0.4)
    assert np.mean(1 + accepted) == pytest.approx(tau, abs=5 * np.std(accepted) / math.sqrt(n))
    for j, a_j in enumerate(np.cumprod(profile), start=1):  # every prefix survives at its rate
        assert np.mean(accepted >= j) == pytest.approx(a_j, abs=5 * math.sqrt(a_j * (1 - a_j) / n))
    surv = np.zeros((n, 3))
    sp.draft_confidences(reqs, tok, n, profiles, np.zeros(n, dtype=np.int64), 2024, spread, bias, 3, surv)
    seen_first = np.minimum(1.0, 0.85 * (1 + bias))
    assert surv[:, 0].mean() == pytest.approx(seen_first, abs=0.01)


def test_draft_cost_per_position():
    tables = TABLES["linear"]
    decode, _ = step_seconds(tables, 8, 8, 8, 8 * 900, 0)
    assert sp.draft_seconds_per_position(tables, sp.DRAFT_FRACTION, 0.1, 8, 8 * 900) == pytest.approx(0.1 * decode)
    assert sp.draft_seconds_per_position(tables, sp.DRAFT_MTP, 0.8, 8, 8 * 900) == pytest.approx(0.8e-3)
    assert sp.draft_seconds_per_position(tables, sp.DRAFT_MTP, 0.8, 0, 0) == 0.0


# ======================================================================================
# the acceptance profile of a trace
# ======================================================================================
def classed_trace():
    trace = make_trace([0.0, 0.1, 0.2, 0.3], [10] * 4, [5] * 4)
    return replace(trace, slo_class=np.array([0, 1, 2, 1]), slo_class_names=("chat", "code", "batch"),
                   tenant=np.array([1, 1, 0, 0]), tenant_names=("a", "b"))


def test_acceptance_model_maps_classes_and_tenants_to_profile_rows():
    trace = classed_trace()
    model = sp.AcceptanceModel(default=[0.5, 0.4], profiles={"code": [0.95, 0.9, 0.85, 0.8]})
    table, rows = model.arrays(trace, 3)
    assert table.tolist() == [[0.5, 0.4, 0.0], [0.95, 0.9, 0.85]]  # past a profile's end: never accepted
    assert rows.tolist() == [0, 1, 0, 1]
    table, rows = sp.AcceptanceModel(by="tenant", profiles={"a": [0.3], "b": [0.6]}).arrays(trace, 2)
    assert table.tolist() == [[0.85, 0.8], [0.3, 0.0], [0.6, 0.0]] and rows.tolist() == [2, 2, 1, 1]


@pytest.mark.parametrize("kwargs, message", [
    (dict(default=[0.9, 1.2]), "default position 2 must be in"),
    (dict(profiles={"chat": [0.9, float("nan")]}), "profiles['chat'] position 2"),
    (dict(default=[]), "default is empty"),
    (dict(profiles={"chat": "high"}), "profiles['chat'] must be a list"),
    (dict(by="model"), "by must be 'slo_class' or 'tenant'"),
    (dict(spread=1.5), "spread must be in"),
    (dict(bias=-1.0), "bias must be a finite number > -1"),
])
def test_acceptance_model_rejects_bad_profiles(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        sp.AcceptanceModel(**kwargs)


def test_acceptance_model_names_unknown_classes():
    with pytest.raises(ValueError, match=r"\['poetry'\] name no slo_class of the trace.*'chat', 'code', 'batch'"):
        sp.AcceptanceModel(profiles={"poetry": [0.5]}).arrays(classed_trace(), 4)
