"""Cost of one step-time lookup in ns, against numpy.interp measured in the same run.

    python benchmarks/steptime_lookup.py
"""

import time

import numpy as np
from numba import njit

from costmodels import build, step_seconds

N = 1_000_000


@njit(cache=True, nogil=True)
def _many_lookups(t, tokens, seqs, kv, pairs):
    total = 0.0
    flagged = 0
    for i in range(tokens.shape[0]):
        s, out = step_seconds(t, tokens[i], seqs[i], seqs[i], kv[i], pairs[i])
        total += s
        flagged += out
    return total, flagged


def main() -> None:
    t = build("meta-llama/Llama-3.1-8B", "h100").tables
    rng = np.random.default_rng(0)
    seqs = rng.integers(1, 256, N).astype(np.float64)
    tokens = seqs + rng.integers(0, 2048, N)
    kv = seqs * rng.uniform(100, 2000, N)
    pairs = rng.uniform(0, 2e6, N)
    _many_lookups(t, tokens[:10], seqs[:10], kv[:10], pairs[:10])  # compile
    start = time.perf_counter()
    _, flagged = _many_lookups(t, tokens, seqs, kv, pairs)
    jit_ns = (time.perf_counter() - start) / N * 1e9
    start = time.perf_counter()
    np.interp(tokens, t.linear_tokens, t.linear_s)
    interp_ns = (time.perf_counter() - start) / N * 1e9
    start = time.perf_counter()
    for i in range(10_000):
        step_seconds(t, tokens[i], seqs[i], seqs[i], kv[i], pairs[i])
    python_ns = (time.perf_counter() - start) / 10_000 * 1e9
    print(f"step_seconds inside a jitted loop: {jit_ns:8.1f} ns/lookup (4 parts, {flagged} of {N} flagged)")
    print(f"numpy.interp, 1 part, vectorised:  {interp_ns:8.1f} ns/lookup")
    print(f"step_seconds called from Python:   {python_ns:8.1f} ns/lookup (dispatch overhead)")
    print(f"ratio jitted / numpy.interp: {jit_ns / interp_ns:.2f}")


if __name__ == "__main__":
    main()
