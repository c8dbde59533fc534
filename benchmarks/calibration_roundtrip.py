"""Round trip of `servetune calibrate --from-bench`: how well known step-time factors come back.

A "server" is the cost model of Llama-3.1-8B on H100 (vLLM op tables, uncalibrated) with
known factors: per-step overhead 6.1 ms, prefill x1.25, decode x0.88. Each traffic shape
(300 requests, prompts 200-3000 tokens, outputs 20-200) is written as a vLLM run folder
by the code `servetune tune` uses, "measured" by replaying it through that server, and
written as a `vllm bench serve --save-detailed` result. Printed per shape:

- the factors `calibrate` recovers from that one run, and their error;
- per-request TTFT/TPOT MAPE of the uncalibrated model and of the fitted one (in sample);
- leave one run out over the shapes: fitted on the other shapes, scored on this one.

The shapes differ in what they reveal: light load keeps decode batches small, where a
decode step costs ``decode_scale * T(B) + overhead`` with T nearly flat, so overhead and
decode scale trade off; a burst spans batch sizes; saturation buries step costs under
queueing, which amplifies every small error.

    python benchmarks/calibration_roundtrip.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import optuna  # noqa: E402

from costmodels import build  # noqa: E402
from optimizer.bench.fit import MeasuredRun, calibrate_from_bench, fit, mape  # noqa: E402
from optimizer.bench.results import RequestTimes, read_result, write_vllm_result  # noqa: E402
from optimizer.bench.run import BenchRun  # noqa: E402
from optimizer.outputs.replay import file_replay, write_bench_replay  # noqa: E402
from optimizer.search.evaluate import Evaluator  # noqa: E402
from optimizer.search.spec import load_spec  # noqa: E402
from optimizer.search.study import create_or_resume  # noqa: E402
from studies.formats import native  # noqa: E402
from studies.traces import Trace  # noqa: E402

MODEL, GPU, N = "meta-llama/Llama-3.1-8B", "h100", 300
TRUTH = {"overhead_s": 0.0061, "prefill_scale": 1.25, "decode_scale": 0.88}
SHAPES = {  # mean gap between arrivals (s), per quarter of the requests
    "light (4 req/s)": (0.25, 0.25, 0.25, 0.25),
    "burst (2.5 -> 33 -> 2.5 req/s)": (0.4, 0.03, 0.03, 0.4),
    "saturated (25 req/s)": (0.04, 0.04, 0.04, 0.04),
}


def shape_trace(gaps: tuple[float, ...], seed: int = 5) -> Trace:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(200, 3000, N)
    blocks = -(-prompts // 512)
    hashes = np.concatenate([np.r_[0, rng.integers(1000 * i + 1, 1000 * i + 900, b - 1)]
                             for i, b in enumerate(blocks)])
    arrival = 10 + np.cumsum(rng.exponential(np.repeat(gaps, N // len(gaps))))
    return Trace.from_columns(arrival, prompts, rng.integers(20, 200, N), block_offsets=np.r_[0, np.cumsum(blocks)],
                              block_hashes=hashes)


def run_folder(directory: Path, trace: Trace) -> Path:
    path = native.write(trace, directory / "trace.parquet")
    spec = load_spec(trace=path, model=MODEL, gpu=GPU, slo="ttft:2000,tpot:100", engine="vllm",
                     run_dir=directory / "run", trials=1)
    create_or_resume(spec)
    evaluator = Evaluator(spec)
    replay = file_replay(spec, evaluator.target, evaluator.baselines()["vllm-default"], spec.fleet)
    (spec.run_dir / replay.name).write_text(replay.text)
    write_bench_replay(spec.run_dir, spec, evaluator, replay, spec.fleet, {})
    return spec.run_dir


def measured_run(name: str, directory: Path, trace: Trace, server) -> MeasuredRun:
    run = BenchRun.open(run_folder(directory, trace))
    sim = RequestTimes.simulated(run.simulate(run.trace, server), run.trace)
    path = write_vllm_result(sim, directory / "bench-result.json")
    return MeasuredRun(name, run, read_result(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    base = build(MODEL, GPU, calibration=False)
    server = replace(base, tables=base.tables._replace(scale=1.0, **TRUTH))
    key = {"model": base.name.split("@")[0], "gpu": "h100_sxm", "framework": "vllm", "gemm_dtype": "bf16",
           "kv_dtype": "bf16", "tp": 1}
    lines = ["# Calibration round trip (`python benchmarks/calibration_roundtrip.py`)", "",
             f"Server: {base.name} with overhead {TRUTH['overhead_s'] * 1e3:.1f} ms, prefill x{TRUTH['prefill_scale']},"
             f" decode x{TRUTH['decode_scale']}; {N} requests per shape; MAPE of per-request figures.", "",
             "| shape | max decode batch | overhead (err) | prefill (err) | decode (err) | TTFT / TPOT MAPE uncalibrated "
             "| in sample | leave one shape out |", "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i, (name, gaps) in enumerate(SHAPES.items()):
            directory = Path(tmp) / f"shape{i}"
            directory.mkdir()
            runs.append(measured_run(name, directory, shape_trace(gaps), server))
        for i, r in enumerate(runs):
            start = time.perf_counter()
            entry = calibrate_from_bench([r], base, dict(key))
            others = fit(runs[:i] + runs[i + 1:], base)
            held = mape([r], replace(base, tables=others.tables(base.tables)))
            batch = int(r.run.simulate(r.traffic, server).series_running.max())
            errors = {k: entry[k] / v - 1 for k, v in TRUTH.items()}
            before, inside = entry["error"]["before"], entry["error"]["in_sample"]
            row = (f"| {r.name} | {batch} | {entry['overhead_s'] * 1e3:.3f} ms ({errors['overhead_s']:+.1%}) "
                   f"| {entry['prefill_scale']:.4f} ({errors['prefill_scale']:+.1%}) "
                   f"| {entry['decode_scale']:.4f} ({errors['decode_scale']:+.1%}) "
                   f"| {before['ttft_mape']:.1f}% / {before['tpot_mape']:.1f}% "
                   f"| {inside['ttft_mape']:.1f}% / {inside['tpot_mape']:.1f}% "
                   f"| {held['ttft_mape']:.1f}% / {held['tpot_mape']:.1f}% |")
            lines.append(row)
            print(row, f"({time.perf_counter() - start:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration_roundtrip.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'calibration_roundtrip.md'}")


if __name__ == "__main__":
    main()
