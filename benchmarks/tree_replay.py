"""Time (or profile) full replays in one source tree: the child process of ``engine_speed.py``.

    python benchmarks/tree_replay.py TREE WORKLOADS_JSON [--repeats 5] [--profile-secs S]

``WORKLOADS_JSON`` is a list of {"label", "trace", "format", "caching"}. Per workload: one
warm-up replay, then ``--repeats`` timed ones; prints one JSON line with each workload's
request and step counts, warm-up seconds and replay times. The same file runs for HEAD and
for a baseline commit, so it imports the tree's packages only (TREE first on sys.path, in
place of this folder) and uses only API every baseline has.

With ``--profile-secs`` (one workload) it writes a perf map of the loaded kernels
(``perfprofile``), prints a line, waits for a line on stdin, replays for that long and
prints the number of replays: the handshake of ``perfprofile.sample``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import perfprofile  # beside this file; imports numba only, not the tree

PACKAGES = ("costmodels", "optimizer", "policies", "studies")


def import_tree(root: Path):
    """The tree's (build, engine_context, engine, preset, load_trace, scale_rate), checking each
    package comes from ``root`` (the repo is also pip-installed, editable, from another tree)."""
    sys.path[0] = str(root)
    import costmodels
    import optimizer
    import policies
    import studies
    from costmodels import build
    from policies import engine
    from policies.engines import preset
    from studies.traces import load_trace
    from studies.transforms import scale_rate
    try:
        from optimizer.search.targets import engine_context
    except ImportError:  # before the optimizer's search package
        from optimizer.targets import engine_context
    for package in (costmodels, optimizer, policies, studies):
        if not Path(package.__file__).resolve().is_relative_to(root):
            sys.exit(f"{package.__name__} imported from {package.__file__}, not from {root}")
    return build, engine_context, engine, preset, load_trace, scale_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", type=Path)
    parser.add_argument("workloads", type=json.loads)
    parser.add_argument("--model", default="meta-llama/Llama-3.1-8B")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile-secs", type=float)
    args = parser.parse_args()
    objects = perfprofile.capture_objects() if args.profile_secs else None
    build, engine_context, engine, preset, load_trace, scale_rate = import_tree(args.tree.resolve())

    cost = build(args.model, args.gpu)
    default = preset("vllm-default", engine_context(args.model, args.gpu))
    results = []
    for w in args.workloads:
        trace = load_trace(w["trace"], w["format"])
        if args.rate_scale != 1.0:
            trace = scale_rate(trace, factor=args.rate_scale)
        config = default.replace(enable_prefix_caching=w["caching"])
        t0 = time.perf_counter()
        result = engine.simulate(trace, cost, config)  # loads (or compiles) the kernels
        warmup_s = time.perf_counter() - t0
        if objects is not None:
            symbols = perfprofile.write_perf_map(objects, os.getpid())
            print(json.dumps({"symbols": symbols}), flush=True)
            sys.stdin.readline()
            t0, replays = time.perf_counter(), 0
            while time.perf_counter() - t0 < args.profile_secs:
                engine.simulate(trace, cost, config)
                replays += 1
            print(json.dumps({"symbols": symbols, "replays": replays, "seconds": time.perf_counter() - t0}))
            return
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            engine.simulate(trace, cost, config)
            times.append(time.perf_counter() - t0)
        results.append({"label": w["label"], "requests": trace.n, "steps": result.steps, "warmup_s": warmup_s,
                        "times_s": times})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
