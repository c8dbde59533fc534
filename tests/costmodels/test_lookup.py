"""The bucket-indexed step-time lookup: exact on grid points, monotone, flags what it
extrapolates, and agrees with the plain binary-search interpolation it replaced."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from costmodels import CostModel, build, linear_tables, read_step_csv, step_seconds
from costmodels.steptable import (
    GRIDS,
    StepTables,
    axis_index,
    bucket_key,
    decode_run_base,
    decode_run_step,
    float_bits,
    validate_tables,
)

AGREEMENT_RTOL = 1e-12  # new vs reference lookup: rounding only (precomputed slopes, inverse widths)


@pytest.fixture(scope="module")
def h100():
    return build("meta-llama/Llama-3.1-8B", "h100", calibration=False).tables._replace(overhead_s=0.0, scale=1.0)


@pytest.fixture(scope="module")
def tables(h100, tmp_path_factory):
    csv = tmp_path_factory.mktemp("sps") / "sps.csv"
    csv.write_text("batch_tokens,step_ms\n1,5.0\n100,5.5\n101,5.6\n102,5.8\n1000,9.0\n1001,9.1\n1002,9.3\n")
    return {
        "h100": h100,
        "a100-70b-tp4": build("meta-llama/Llama-3.1-70B", "a100", tp=4, calibration=False).tables,
        "linear": linear_tables(),
        "sps-csv": read_step_csv(csv),
    }


def reference_step_seconds(t, n_tokens, n_logit_seqs, n_decode, kv, pairs):
    """The lookup's contract in plain NumPy, by binary search (the implementation it replaced)."""
    def interp1(axis, values, x):
        if x > axis[-1]:
            slope = (values[-1] - values[-2]) / (axis[-1] - axis[-2])
            return values[-1] + slope * (x - axis[-1]), True
        return float(np.interp(x, axis, values)), False

    if n_tokens <= 0:
        return 0.0, False
    total, out = interp1(t.linear_tokens, t.linear_s, n_tokens)
    if n_logit_seqs > 0:
        part, o = interp1(t.head_seqs, t.head_s, n_logit_seqs)
        total, out = total + part, out or o
    if n_decode > 0:
        b, k, g = t.decode_batch, t.decode_kv, t.decode_s
        i = min(max(np.searchsorted(b, n_decode), 1), len(b) - 1)
        j = min(max(np.searchsorted(k, kv), 1), len(k) - 1)
        u = (max(n_decode, b[0]) - b[i - 1]) / (b[i] - b[i - 1])
        v = (max(kv, k[0]) - k[j - 1]) / (k[j] - k[j - 1])
        top = g[i - 1, j - 1] + v * (g[i - 1, j] - g[i - 1, j - 1])
        bottom = g[i, j - 1] + v * (g[i, j] - g[i, j - 1])
        limit, _ = interp1(b, t.decode_kv_measured, n_decode)
        total += top + u * (bottom - top)
        out = out or n_decode > b[-1] or kv > k[-1] or kv > limit
    if pairs > 0:
        part, o = interp1(t.prefill_pairs, t.prefill_s, pairs)
        total, out = total + part, out or o
    return t.scale * (total + t.overhead_s), out


def only(part, x, kv=0.0):
    """Arguments that exercise one part: the linear part at its first point is the floor."""
    return {"linear": (x, 0, 0, 0.0, 0.0), "head": (1.0, x, 0, 0.0, 0.0), "decode": (1.0, 0, x, kv, 0.0),
            "prefill": (1.0, 0, 0, 0.0, x)}[part]


def test_grid_points_come_back_exactly(h100):
    for x, y in zip(h100.linear_tokens, h100.linear_s, strict=True):
        assert step_seconds(h100, x, 0, 0, 0.0, 0.0)[0] == y
    # without the linear part each other part reads back alone
    t = StepTables.from_grids(**h100.grids() | {"linear_s": np.zeros_like(h100.linear_s)}, overhead_s=0.0, scale=1.0)
    for x, y in zip(t.head_seqs, t.head_s, strict=True):
        assert step_seconds(t, 1.0, x, 0, 0.0, 0.0)[0] == y
    for x, y in zip(t.prefill_pairs, t.prefill_s, strict=True):
        assert step_seconds(t, 1.0, 0, 0, 0.0, x)[0] == y
    for i, b in enumerate(t.decode_batch):
        for j, kv in enumerate(t.decode_kv):
            got = step_seconds(t, 1.0, 0, b, kv, 0.0)[0]
            if i + 1 < len(t.decode_batch) and j + 1 < len(t.decode_kv):
                assert got == t.decode_s[i, j]
            else:  # the far edges are the ends of the last cell: rounding only
                assert got == pytest.approx(t.decode_s[i, j], rel=1e-15, abs=0)


@pytest.mark.parametrize("name", ["h100", "a100-70b-tp4", "linear", "sps-csv"])
def test_agrees_with_binary_search_lookup_on_random_steps(tables, name):
    t = tables[name]
    rng = np.random.default_rng(7)
    top = 1.3 * np.array([t.linear_tokens[-1], t.head_seqs[-1], t.decode_batch[-1], t.decode_kv[-1],
                          t.prefill_pairs[-1]])
    for _ in range(3000):
        # log-uniform over each axis and a little past it, integers as the engine passes
        x = np.floor(np.exp(rng.uniform(-0.5, np.log(np.minimum(top, 1e15)))))
        x[rng.random(5) < 0.1] = 0
        got, out = step_seconds(t, *x)
        want, want_out = reference_step_seconds(t, *x)
        assert got == pytest.approx(want, rel=AGREEMENT_RTOL, abs=0), x
        assert out == want_out, x


@pytest.mark.parametrize("part, axis", [("linear", "linear_tokens"), ("head", "head_seqs"),
                                        ("prefill", "prefill_pairs"), ("decode", "decode_batch"),
                                        ("decode", "decode_kv")])
def test_monotone_across_every_grid_point(h100, part, axis):
    """Sweep each input over every grid point, its neighbouring floats and the midpoints.

    Checked wherever the step is in range (flagged steps are extrapolations the caller
    is told about; a 1-D part stays monotone past its end too).
    """
    points = getattr(h100, axis)
    sweep = np.unique(np.concatenate([points, np.nextafter(points, 0), np.nextafter(points, np.inf),
                                      (points[1:] + points[:-1]) / 2, [0.0, 0.5, points[-1] * 1.5]]))
    for other in (1.0, 7.0, 300.0, 2000.0):
        if axis == "decode_kv":
            steps = [step_seconds(h100, *only("decode", other, kv)) for kv in sweep]
        else:
            steps = [step_seconds(h100, *only(part, x, 64 * other)) for x in sweep]
        seconds = np.array([s for s, _ in steps])
        in_range = ~np.array([out for _, out in steps])
        rises = np.diff(seconds)[in_range[1:] & in_range[:-1]]
        assert np.all(rises >= -1e-15 * seconds.max()), (other, rises.min())
        assert in_range.sum() > len(sweep) / 2
        if part != "decode":
            assert np.all(np.diff(seconds) >= -1e-15 * seconds.max())


@pytest.mark.parametrize("part, axis", [("linear", "linear_tokens"), ("head", "head_seqs"),
                                        ("prefill", "prefill_pairs"), ("decode", "decode_batch")])
def test_flags_exactly_the_values_past_the_last_point(h100, part, axis):
    last = getattr(h100, axis)[-1]
    kv = 1.0  # under every batch row's measured KV
    assert not step_seconds(h100, *only(part, last, kv))[1]
    assert step_seconds(h100, *only(part, np.nextafter(last, np.inf), kv))[1]
    assert not step_seconds(h100, *only(part, 1.0, kv))[1]


def test_flags_decode_kv_past_the_profiled_kv_of_its_batch(h100):
    for b, measured in zip(h100.decode_batch, h100.decode_kv_measured, strict=True):
        assert not step_seconds(h100, 1.0, 0, b, measured, 0.0)[1]
        assert step_seconds(h100, 1.0, 0, b, np.nextafter(measured, np.inf), 0.0)[1]


def test_extrapolation_continues_the_last_segment(h100):
    axis, values = h100.prefill_pairs, h100.prefill_s
    slope = (values[-1] - values[-2]) / (axis[-1] - axis[-2])
    got = step_seconds(h100, *only("prefill", 4 * axis[-1]))[0] - h100.linear_s[0]
    assert got == pytest.approx(values[-1] + slope * 3 * axis[-1], rel=1e-12)


def test_below_the_first_point_holds_the_first_value():
    t = StepTables.from_grids(**linear_tables().grids() | {"linear_tokens": np.array([8.0, 64.0]),
                                                            "linear_s": np.array([0.5, 1.0])},
                              overhead_s=0.0, scale=1.0)
    assert step_seconds(t, 3, 0, 0, 0.0, 0.0) == (0.5, False)


ascending = st.lists(st.floats(0, 1e12).map(lambda v: round(v, 3)), min_size=2, max_size=40, unique=True).map(sorted)


@settings(max_examples=60, deadline=None)
@given(points=ascending, data=st.data())
def test_any_ascending_axis_interpolates_like_numpy(points, data):
    """Dense, fractional, zero-based or wide axes: the index always finds the right segment."""
    axis = np.array(points)
    values = np.cumsum(np.arange(len(axis)) % 3 + 0.5)  # nondecreasing, uneven steps
    t = StepTables.from_grids(**linear_tables().grids() | {"linear_tokens": axis, "linear_s": values},
                              overhead_s=0.0, scale=1.0)
    probes = data.draw(st.lists(st.floats(0, 2e12, allow_nan=False), min_size=1, max_size=20))
    for x in [*points, *probes]:
        if x <= 0:
            continue
        got, out = step_seconds(t, x, 0, 0, 0.0, 0.0)
        want, want_out = reference_step_seconds(t, x, 0, 0, 0.0, 0.0)
        assert got == pytest.approx(want, rel=1e-9), (x, axis)
        assert out == want_out


def test_index_starts_at_most_one_step_before_the_segment_on_profiled_axes(h100):
    for name in ("linear_tokens", "head_seqs", "decode_batch", "decode_kv", "prefill_pairs"):
        axis = getattr(h100, name)
        bits, first, starts = axis_index(axis)
        assert len(starts) <= 512, name  # a few KiB per axis
        for x in np.concatenate([axis, np.nextafter(axis, 0), np.nextafter(axis, np.inf)]):
            x = min(max(x, axis[0]), axis[-1])
            segment = min(np.searchsorted(axis, x, side="right") - 1, len(axis) - 1)
            start = starts[min(max(bucket_key(x, bits) - first, 0), len(starts) - 1)]
            assert 0 <= segment - start <= 1, (name, x)


def test_bucket_key_is_the_float_exponent_and_top_mantissa_bits():
    assert [bucket_key(x, 2) for x in (0.0, 1.0, 1.24, 1.25, 2.0, 3.5)] == \
        [bucket_key(1.0, 2), 1023 * 4, 1023 * 4, 1023 * 4 + 1, 1024 * 4, 1024 * 4 + 3]
    assert float_bits(1.0) == 0x3FF0_0000_0000_0000


def test_grids_round_trip_and_survive_pickling(h100):
    again = StepTables.from_grids(**h100.grids(), overhead_s=0.0, scale=1.0)
    assert np.array_equal(again.data, h100.data) and set(h100.grids()) == set(GRIDS)
    assert h100.decode_s.shape == (len(h100.decode_batch), len(h100.decode_kv))
    copy = pickle.loads(pickle.dumps(h100))
    assert numba.typeof(copy) == numba.typeof(h100)  # workers reuse the compiled kernels
    assert step_seconds(copy, 300, 30, 30, 3e4, 5e5) == step_seconds(h100, 300, 30, 30, 3e4, 5e5)


def test_tampered_tables_are_rejected(h100):
    data = h100.data.copy()
    at = int(data[0])  # the linear block: [n, buckets, bits, first key], n points, n inverse widths, index
    data[at + 4 + 2 * int(data[at])] += 1.0  # a bucket index entry that no longer fits the grid
    with pytest.raises(ValueError, match="does not match its own grids"):
        validate_tables(h100._replace(data=data))
    with pytest.raises(ValueError, match="not a packed table|1-D float64"):
        CostModel.synthetic(1000, tables=h100._replace(data=np.zeros(3)))


@pytest.mark.parametrize("grid, value, message", [
    ("linear_tokens", np.array([0.0, 5.0, 5.0]), "strictly ascending"),
    ("head_seqs", np.array([-1.0, 5.0]), "finite and >= 0"),
    ("prefill_s", np.array([0.0, np.nan]), "prefill_s must be finite"),
    ("decode_s", np.zeros((3, 2)), "decode_s has shape"),
])
def test_bad_grids_name_the_grid(grid, value, message):
    with pytest.raises(ValueError, match=message):
        StepTables.from_grids(**linear_tables().grids() | {grid: value}, overhead_s=0.0, scale=1.0)


def test_odd_inputs_stay_in_bounds(h100):
    assert step_seconds(h100, np.inf, 1, 1, 1.0, 1.0) == (np.inf, True)
    seconds, _ = step_seconds(h100, 100, 1, 1, np.nan, 1.0)  # no out-of-bounds read
    assert np.isnan(seconds) or seconds > 0


def test_python_mode_matches_jit():
    """NUMBA_DISABLE_JIT runs the same lookup in Python (float_bits has a Python body)."""
    script = ("from costmodels import build, step_seconds\n"
              "t = build('meta-llama/Llama-3.1-8B', 'h100').tables\n"
              "print([(float(s), bool(o)) for s, o in (step_seconds(t, n, n, n // 2, 900 * n, n * 3000.0)\n"
              "                                        for n in (1, 17, 33, 250, 4097, 70000))])")
    root = str(Path(__file__).resolve().parents[2])
    runs = [subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, check=True,
                           env={**os.environ, "NUMBA_DISABLE_JIT": flag}).stdout for flag in ("1", "0")]
    assert runs[0] == runs[1] and "True" in runs[0]


@pytest.mark.parametrize("name", ["h100", "a100-70b-tp4", "linear", "sps-csv"])
def test_decode_run_lookups_equal_step_seconds_bit_for_bit(tables, name):
    """The engine's fast-forward times a stretch of pure-decode steps from one
    ``decode_run_base`` and a ``decode_run_step`` per step: exactly ``step_seconds``."""
    t = tables[name]._replace(overhead_s=0.003, scale=0.9)
    rng = np.random.default_rng(7)
    for n in (1, 2, 7, 64, 300, 1024, 5000):
        base = decode_run_base(t, n)
        for kv in np.concatenate([rng.integers(n, 2_000_000, 20), [n, 10**7]]):
            assert decode_run_step(t, base, kv) == step_seconds(t, n, n, n, kv, 0)
