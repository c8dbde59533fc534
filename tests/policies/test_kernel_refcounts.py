"""The engine's kernels compile without Numba's reference counting (``_nrt=False``, see the
``policies.engine`` docstring). That is sound only while three rules hold, checked here:

- every kernel of the engine's modules states ``_nrt`` (a callee that does not inherits its
  first caller's setting, so the same function could compile either way);
- no kernel compiled without counting returns an array (its caller would release a
  reference it never took);
- a replay allocates and frees the same number of Numba arrays (a kernel without counting
  that kept an array from a counted callee would leak it).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_MODULES = (
    *sorted((ROOT / "policies" / "engine").glob("*.py")),
    *(ROOT / "policies" / f"{name}.py" for name in
      ("prefix_cache", "queues", "fairness", "speculative", "adapters", "waitqueue")),
    ROOT / "costmodels" / "steptable.py",
)


def _njit_options(decorator: ast.expr) -> set[str] | None:
    """The keywords of an ``@njit(...)`` decorator, or None for any other decorator."""
    if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "njit":
        return {k.arg for k in decorator.keywords}
    return None


def test_every_kernel_of_the_engine_states_whether_it_counts_references():
    unstated, kernels = [], 0
    for path in ENGINE_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                options = _njit_options(decorator)
                if options is None or "inline" in options:
                    continue  # inlined kernels compile as part of their caller
                kernels += 1
                if "_nrt" not in options:
                    unstated.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert kernels > 100
    assert unstated == []


_COLD_REPLAY = """
import gc, json, sys
sys.path.insert(0, {root!r})
from numba import types
from numba.core.registry import CPUDispatcher
from numba.core.runtime import rtsys
from policies import engine
from policies.config import PolicyConfig
from policies.fleet import simulate_fleet
from tests.policies.conftest import cost_model, make_trace, poisson_trace

base = poisson_trace(400, rate=60.0, seed=5)
hashes = [[1, 2, 3][: 1 + i % 3] for i in range(len(base.arrival_s))]
trace = make_trace(base.arrival_s, base.prompt_tokens, base.output_tokens, hashes=hashes, block_tokens=64)
cost = cost_model(kv_tokens=3000, host_tokens=2000)
configs = [PolicyConfig(enable_prefix_caching=True, async_scheduling=True),
           PolicyConfig(scheduling_policy="priority", preemption_mode="swap"),
           PolicyConfig(scheduling_policy="dfs_weight", enable_prefix_caching=True),  # dfs_rekey allocates
           PolicyConfig(scheduling_policy="vtc", max_num_batched_tokens=256)]

def replay():
    for config in configs:
        engine.simulate(trace, cost, config)
    simulate_fleet(trace, cost, configs[0], replicas=2)
    gc.collect()

def holds_array(ty):
    return isinstance(ty, types.Array) or (isinstance(ty, types.BaseTuple) and any(map(holds_array, ty.types)))

replay()  # compiles every kernel into an empty cache, so each one records its signatures
uncounted, returning = 0, []
for name, module in list(sys.modules.items()):
    if module is None or not name.startswith(("policies.", "costmodels.")):
        continue
    for kernel in vars(module).values():
        if isinstance(kernel, CPUDispatcher) and kernel.targetoptions.get("_nrt") is False:
            for signature in kernel.signatures:
                uncounted += 1
                if holds_array(kernel.overloads[signature].signature.return_type):
                    returning.append(name + "." + kernel.py_func.__name__)
before = rtsys.get_allocation_stats()
replay()
replay()
after = rtsys.get_allocation_stats()
print(json.dumps({{"uncounted": uncounted, "returning": sorted(set(returning)),
                   "alloc": after.alloc - before.alloc, "free": after.free - before.free,
                   "mi_alloc": after.mi_alloc - before.mi_alloc, "mi_free": after.mi_free - before.mi_free}}))
"""


@pytest.fixture(scope="module")
def cold_replay(tmp_path_factory) -> dict:
    """Replays of every scheduling path compiled into an empty cache (a minute or two), with
    Numba's allocation counters on."""
    env = {**os.environ, "NUMBA_NRT_STATS": "1", "NUMBA_CACHE_DIR": str(tmp_path_factory.mktemp("numba"))}
    done = subprocess.run([sys.executable, "-c", _COLD_REPLAY.format(root=str(ROOT))], env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_kernel_without_reference_counts_returns_an_array(cold_replay):
    assert cold_replay["uncounted"] > 100  # the replays compiled the step loop's kernels
    assert cold_replay["returning"] == []


def test_replays_free_every_array_they_allocate(cold_replay):
    assert cold_replay["alloc"] > 0  # the replays allocated through Numba: the counters are live
    assert cold_replay["alloc"] == cold_replay["free"]
    assert cold_replay["mi_alloc"] == cold_replay["mi_free"]
