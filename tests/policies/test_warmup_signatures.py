"""`servetune warmup` compiles exactly the kernel signatures a real run uses (issue 15).

A kernel compiled for other argument types than a study passes (a writable array where
``load_trace`` gives a read-only one, say) makes the first real replay compile it again:
minutes on a cold cache. So: warm up, note every jitted function's signatures, run what
a study runs (a trace read from a file, a real cost model, ``simulate``,
``simulate_many`` and the fleet on two replicas) and what ``validate`` runs (the closed
loop of a measured vLLM and TRT-LLM run), and require that nothing gained one.

Issue 51: the same for fleets of any size after the warm-up ``tune`` runs, numba.typed's
own list methods counted; and a fresh process (a ``simulate --replicas N`` after
``servetune warmup``) loads every kernel of a fleet run from the disk cache and compiles
nothing (``typed.List`` built from Python compiled its methods in every process, ~2 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
from numba.core.dispatcher import Dispatcher

import costmodels
from costmodels.jitcache import JIT_PACKAGES
from optimizer.fidelity import closedloop, replayfit
from optimizer.search.targets import context_of
from policies import engine, fleet
from policies.config import PolicyConfig
from policies.failures import FailureSchedule
from studies.traces import Trace, load_trace, write_trace

#: The dispatchers simulate, simulate_many and simulate_fleet(_many) call from Python.
MAIN_KERNELS = {
    "policies.engine.simulate_kernel": engine.simulate_kernel,
    "policies.fleet.fleet_kernel": fleet.fleet_kernel,
    "optimizer.fidelity.closedloop._drive": closedloop._drive,
}


def _dispatchers() -> dict[str, Dispatcher]:
    """Every jitted function of the loaded jitted packages (and the closed loop's), by
    module and name."""
    found = {"optimizer.fidelity.closedloop._drive": closedloop._drive}
    for name, module in list(sys.modules.items()):
        # numba.typed: a typed.List built or indexed from Python compiles its methods there
        if module is None or (name.split(".")[0] not in JIT_PACKAGES and not name.startswith("numba.typed")):
            continue
        for value in vars(module).values():
            if isinstance(value, Dispatcher):
                found[f"{value.py_func.__module__}.{value.py_func.__qualname__}"] = value
    return found


def _signatures() -> dict[str, set]:
    return {name: set(d.signatures) for name, d in _dispatchers().items()}


def _file_trace(tmp_path) -> Trace:
    rng = np.random.default_rng(3)
    n = 40
    prompt = rng.integers(16, 1500, n)
    blocks = np.minimum(rng.integers(0, 3, n), -(-prompt // 512))  # at most one id per 512 prompt tokens
    offsets = np.zeros(n + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(blocks)
    trace = Trace.from_columns(np.sort(rng.uniform(0.0, 4.0, n)), prompt, rng.integers(1, 80, n),
                               max_tokens=np.full(n, 128), block_offsets=offsets,
                               block_hashes=rng.integers(0, 6, int(offsets[-1])))
    return load_trace(write_trace(trace, tmp_path / "trace.csv"))


def test_a_real_run_compiles_nothing_after_warmup(tmp_path):
    engine.warmup()
    fleet.warmup()
    closedloop.warmup()
    warm = _signatures()
    for name, kernel in MAIN_KERNELS.items():
        assert kernel.signatures, f"warm-up left {name} uncompiled"

    trace = _file_trace(tmp_path)
    assert not trace.arrival_s.flags.writeable  # as every loaded trace
    cost = costmodels.build("meta-llama/Llama-3.1-8B", "h100")
    config = PolicyConfig()
    engine.simulate(trace, cost, config)
    engine.simulate_many(trace, cost, [config, config.replace(enable_prefix_caching=True, max_num_seqs=32)])
    routed = config.replace(router="least_kv")
    fleet.simulate_fleet(trace, cost, routed, replicas=2)
    fleet.simulate_fleet_many(trace, cost, [routed, routed.replace(migration=True)], replicas=2)
    for framework in ("vllm", "trtllm"):  # as validate replays a measured run
        measured = costmodels.build("meta-llama/Llama-3.1-8B", "h100", framework=framework)
        ctx = context_of(measured, "h100", context_len=0)
        closedloop.run_benchmark(measured, replayfit.server_config(framework, ctx), 3, 64, 8,
                                 max_seq_len=closedloop.server_max_seq_len(framework, "meta-llama/Llama-3.1-8B"))

    after = _signatures()
    gained = {name: sigs - warm.get(name, set()) for name, sigs in after.items()}
    gained = {name: sigs for name, sigs in gained.items() if sigs}
    main = {name: sigs for name, sigs in gained.items() if name in MAIN_KERNELS}
    assert not main, "a real run compiled kernel signatures warm-up did not:\n" + "\n".join(
        _explain(name, sig, warm[name]) for name, sigs in main.items() for sig in sigs)
    assert not gained, f"a real run compiled jitted functions warm-up did not: {sorted(gained)}"


def _explain(name: str, new: tuple, old: set) -> str:
    """Which arguments of a new signature differ from each warm one, and how."""
    lines = [f"{name}: a new signature"]
    for sig in old:
        for i, (was, now) in enumerate(zip(sig, new, strict=True)):
            if was != now:
                lines.append(f"  argument {i}, warm-up: {str(was)[:300]}\n  argument {i}, real:    {str(now)[:300]}")
    return "\n".join(lines)


def _fleet_runs(trace, cost) -> None:
    """The fleets ``simulate --replicas N`` and a study's trials and GPU sizing run: sizes
    2, 3 and 8 (one CostModel or one per replica), attention-DP ranks in lockstep, failures."""
    config = PolicyConfig(router="least_kv")
    for n in (2, 3, 8):
        fleet.simulate_fleet(trace, cost, config, replicas=n)
    fleet.simulate_fleet_many(trace, [cost] * 3, [config, config.replace(enable_prefix_caching=True)])
    down = FailureSchedule.from_rows([(1, 0.5, 1.5)])
    fleet.simulate_fleet(trace, cost, config, replicas=2, failures=down)
    fleet.simulate_fleet(trace, cost, config, replicas=8, lockstep=2, failures=down.per_rank(2))


def test_fleets_of_any_size_compile_nothing_after_the_warmup_tune_runs(tmp_path):
    engine.warmup(speculative=False)  # as `tune` warms up for a study without a drafter
    fleet.warmup(speculative=False)
    warm = _signatures()
    _fleet_runs(_file_trace(tmp_path), costmodels.build("meta-llama/Llama-3.1-8B", "h100"))
    after = _signatures()
    gained = {name: sigs - warm.get(name, set()) for name, sigs in after.items()}
    gained = {name: sigs for name, sigs in gained.items() if sigs}
    assert not gained, "fleet runs compiled what the warm-up did not:\n" + "\n".join(
        _explain(name, sig, warm.get(name, set())) for name, sigs in gained.items() for sig in sigs)


_FRESH_PROCESS = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from numba.core.dispatcher import Dispatcher
    import costmodels
    from studies.traces import load_trace
    from tests.policies.test_warmup_signatures import _dispatchers, _fleet_runs

    def compiled():
        return {{name: sum(d.stats.cache_misses.values()) for name, d in _dispatchers().items()}}

    trace, cost = load_trace({trace!r}), costmodels.build("meta-llama/Llama-3.1-8B", "h100")
    before = compiled()
    _fleet_runs(trace, cost)
    print(json.dumps({{name: n - before.get(name, 0) for name, n in compiled().items() if n > before.get(name, 0)}}))
""")


def test_a_fresh_process_loads_every_fleet_kernel_from_the_cache(tmp_path):
    """After `servetune warmup` (here: the warm-ups, which fill the disk cache), a new
    process's fleet runs compile nothing: every kernel they call loads from the cache."""
    engine.warmup()
    fleet.warmup()
    _file_trace(tmp_path)
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS.format(root=root, trace=str(tmp_path / "trace.csv"))],
                          capture_output=True, text=True, timeout=600, check=True, cwd=root)
    assert json.loads(done.stdout.splitlines()[-1]) == {}, "compiled in a fresh process, not loaded from the cache"
