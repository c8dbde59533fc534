"""The run folder's replay files: the study's traffic, the scripts that send it, and what
that run was simulated to give.

- ``trace.jsonl``: the traffic as a timed replay sends it (``studies.replay``), in the
  Mooncake layout ``vllm bench serve --dataset-name timed_trace`` (vLLM 0.33) and AIPerf
  0.13's ``mooncake_trace`` read: timestamps in ms from the first request, exact prompt
  and output lengths, one id per prompt block (``trace-sglang.jsonl``: SGLang's layout).
- ``bench-<engine>.sh``: waits for the server's ``/health``, then replays the file
  against it, saving per-request detail; it starts no server. ``CLIENT=aiperf`` writes
  ``<result>/profile_export.jsonl`` instead (compare reads either). One replay per SLO class
  whose bounds differ, each of the whole traffic: a client's goodput counts every
  request against one set of bounds, so each class gets its own figure, printed beside
  the simulated one computed the same way.
- ``bench.json``: the manifest ``servetune compare`` and ``servetune calibrate`` read:
  engine, config file, trace, deployment, the result file of each class and its
  simulated figures.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from optimizer.bench.results import RequestTimes
from studies.formats import mooncake
from studies.replay import write_sglang_mooncake
from studies.slo import SLO_KEYS, SLOClass, SLOSet
from studies.traces import Trace

MANIFEST = "bench.json"
TRACE = "trace.jsonl"
SGLANG_TRACE = "trace-sglang.jsonl"
FORMAT = "servetune-bench/1"
#: AIPerf's names for vLLM's goodput keys (its inter_token_latency is vLLM's TPOT)
AIPERF_METRICS = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "e2el": "request_latency"}


@dataclass(frozen=True)
class ClassBench:
    """One replay: an SLO class's bounds, its result file and the simulated figures."""

    name: str
    bounds: dict[str, float]
    result: str
    simulated: dict[str, float]


def tool_figures(times: RequestTimes, bounds: Mapping[str, float]) -> dict[str, float]:
    """Goodput as a benchmark client computes it: every request against one set of bounds,
    per second of the run's duration; SLO attainment over requests sent; p99 TTFT/TPOT."""
    good = times.ok.copy()
    for key, bound in bounds.items():
        good &= getattr(times, f"{key}_ms") <= bound
    ok = times.ok
    return {"request_goodput": float(good.sum() / times.duration_s) if times.duration_s > 0 else float("nan"),
            "slo_attainment": float(good.mean()) if times.n else float("nan"),
            "p99_ttft_ms": float(np.percentile(times.ttft_ms[ok], 99)) if ok.any() else float("nan"),
            "p99_tpot_ms": float(np.percentile(times.tpot_ms[ok], 99)) if ok.any() else float("nan")}


def class_benches(trace: Trace, slos: SLOSet, simulated: RequestTimes) -> list[ClassBench]:
    """One replay per distinct set of bounds among the classes the trace's requests use."""
    used: dict[tuple, SLOClass] = {}
    present = np.unique(trace.slo_class)
    for code in present:
        cls = slos.lookup(trace.slo_class_names[code])
        used.setdefault(cls.bounds_ms, cls)
    single = len(used) == 1
    out = []
    for cls in used.values():
        bounds = {k: float(getattr(cls, f"{k}_ms")) for k in SLO_KEYS if getattr(cls, f"{k}_ms") is not None}
        result = "bench-result.json" if single else f"bench-result-{_safe(cls.name)}.json"
        out.append(ClassBench(cls.name, bounds, result, tool_figures(simulated, bounds)))
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def write_bench(directory: str | Path, *, engine: str, config_file: str, server: str, deployment: Mapping[str, Any],
                trace: Trace, slos: SLOSet, simulated: RequestTimes, study: str,
                study_figures: Mapping[str, float] | None = None,
                fleet_knobs: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write ``trace.jsonl`` (and SGLang's layout), ``bench-<engine>.sh`` and ``bench.json``.

    ``trace`` is the replayed trace (``studies.replay.as_replayed``) and ``simulated`` the
    simulation of ``config_file`` on it; ``study_figures`` the study's own figures of the
    file (clients that do not send exact lengths), stated beside them; ``fleet_knobs`` the
    router and pools the file's replicas ran behind (no engine file holds them).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {TRACE: mooncake.write(trace, directory / TRACE)}
    if engine == "sglang":
        paths[SGLANG_TRACE] = write_sglang_mooncake(trace, directory / SGLANG_TRACE)
    benches = class_benches(trace, slos, simulated)
    script = f"bench-{engine}.sh"
    paths[script] = directory / script
    paths[script].write_text(_script(engine, config_file, server, deployment, trace, benches, study_figures))
    paths[script].chmod(0o755)
    manifest = {"format": FORMAT, "study": study, "engine": engine, "config": config_file, "trace": TRACE,
                "block_tokens": trace.block_tokens, "requests": trace.n, "deployment": dict(deployment),
                "fleet_knobs": dict(fleet_knobs or {}),
                "classes": [{"name": b.name, "bounds_ms": b.bounds, "result": b.result, "simulated": b.simulated}
                            for b in benches]}
    paths[MANIFEST] = directory / MANIFEST
    paths[MANIFEST].write_text(json.dumps(manifest, indent=2) + "\n")
    return paths


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """``bench.json`` of a run folder; BenchResultError naming what is missing."""
    from optimizer.bench.results import BenchResultError

    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BenchResultError(f"{directory} has no {MANIFEST}: not a run folder written by servetune tune "
                               "(or written before bench replays existed; rerun `servetune export`)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchResultError(f"{path} is unreadable ({exc})") from None
    if data.get("format") != FORMAT:
        raise BenchResultError(f"{path}: format {data.get('format')!r}; expected {FORMAT!r}")
    return data


def _script(engine: str, config_file: str, server: str, deployment: Mapping[str, Any], trace: Trace,
            benches: list[ClassBench], study_figures: Mapping[str, float] | None) -> str:
    model = shlex.quote(str(deployment["model"]))
    n = trace.n
    lines = [
        "#!/usr/bin/env bash",
        f"# Replay this study's traffic ({TRACE}: {n} requests, their arrival times, prompt and output lengths and",
        "# shared prefixes) against a running server. This script starts nothing; start the server first:",
        f"#   {server}   ({deployment['replicas']} replica(s) x TP {deployment['tp']} on {deployment['gpu']})",
        f"# then read the result back:   servetune compare {'<this folder>'} <result file>",
        "# Simulated figures of that file on this traffic as the replay sends it (each request's max_tokens is its",
        "# output length, outputs run to it, no priorities or deadlines), computed as the client computes them:",
    ]
    for b in benches:
        s = b.simulated
        bounds = " ".join(f"{k}:{v:g}" for k, v in b.bounds.items()) or "none"
        lines.append(f"#   class {b.name} ({bounds}) -> {b.result}: goodput {s['request_goodput']:.4g} req/s, "
                     f"SLO attainment {s['slo_attainment']:.4g}, p99 TTFT {s['p99_ttft_ms']:.4g} ms, "
                     f"p99 TPOT {s['p99_tpot_ms']:.4g} ms")
    if len(benches) > 1:
        lines.append("# The SLO classes differ, so the whole traffic is replayed once per class (a client counts every "
                     "request against one set of bounds); CLASSES=\"name ...\" runs some. `servetune compare` scores "
                     "each class on its own requests from any of the results.")
    if study_figures:
        lines.append("# The study's own figures of the file (clients that do not send exact lengths): "
                     + ", ".join(f"{k} {v:.4g}" for k, v in study_figures.items()))
    if engine == "sglang":
        lines.append(f"# SGLang's replay builds each prompt from its ids ({SGLANG_TRACE}: 128 'hi' tokens per id, "
                     "chat template applied), so prompt lengths land near, not on, the trace's; compare re-simulates "
                     "with the lengths SGLang reports.")
    lines += [
        "set -euo pipefail",
        'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
        'HOST="${HOST:-127.0.0.1}"', 'PORT="${PORT:-8000}"', 'RESULT_DIR="${RESULT_DIR:-$HERE}"',
        f'CLIENT="${{CLIENT:-{"sglang" if engine == "sglang" else "vllm"}}}"',
        f'CLASSES="${{CLASSES:-{" ".join(b.name for b in benches)}}}"',
        "# ready without a test request: one would put request 0's prompt in the prefix cache",
        'until curl -sf "http://$HOST:$PORT/health" >/dev/null; do echo "waiting for $HOST:$PORT"; sleep 5; done',
        "replay() {  # RESULT_FILE GOODPUT_BOUNDS...",
        '  local result="$1"; shift',
        '  case "$CLIENT" in',
        "    vllm)",
        f"      vllm bench serve --backend openai --endpoint /v1/completions --host \"$HOST\" --port \"$PORT\" --model {model} \\",
        f"        --dataset-name timed_trace --dataset-path \"$HERE/{TRACE}\" --timed-trace-chunk-hash-size "
        f"{trace.block_tokens} \\",
        f"        --timed-trace-sec-multiplier 0.001 --num-prompts {n} --ignore-eos --ready-check-timeout-sec 0 \\",
        '        ${1:+--goodput "$@"} --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 \\',
        '        --save-result --save-detailed --result-dir "$RESULT_DIR" --result-filename "$result" ;;',
        "    sglang)",
        f"      python -m sglang.bench_serving --backend sglang --host \"$HOST\" --port \"$PORT\" --model {model} \\",
        f"        --dataset-name mooncake --dataset-path \"$HERE/{SGLANG_TRACE}\" --mooncake-num-rounds 1 "
        "--mooncake-slowdown-factor 1 \\",
        f"        --num-prompts {n} --warmup-requests 1 --flush-cache ${{1:+--goodput \"$@\"}} \\",
        '        --output-file "$RESULT_DIR/$result" --output-details ;;',
        "    aiperf)  # --random-seed: records then name their trace row (session_NNNNNN)",
        f"      aiperf profile --model {model} --url \"http://$HOST:$PORT\" --endpoint-type completions --streaming \\",
        f"        --input-file \"$HERE/{TRACE}\" --custom-dataset-type mooncake_trace --fixed-schedule "
        f"--isl-block-size {trace.block_tokens} --random-seed 0 \\",
        '        --extra-inputs ignore_eos:true ${AIPERF_GOODPUT:+--goodput "$AIPERF_GOODPUT"} '
        '--artifact-dir "$RESULT_DIR/${result%.json}" ;;',
        '    *) echo "CLIENT must be vllm, sglang or aiperf, got $CLIENT" >&2; exit 2 ;;',
        "  esac",
        "}",
        'for class in $CLASSES; do',
        '  case "$class" in',
    ]
    for b in benches:
        bounds = " ".join(f"{k}:{v:g}" for k, v in b.bounds.items())
        aiperf = " ".join(f"{AIPERF_METRICS[k]}:{v:g}" for k, v in b.bounds.items())
        lines.append(f"    {shlex.quote(b.name)}) AIPERF_GOODPUT={shlex.quote(aiperf)} replay {b.result} {bounds} ;;")
    lines += ['    *) echo "unknown class $class; this study has: ' + " ".join(b.name for b in benches) + '" >&2; exit 2 ;;',
              "  esac", "done"]
    return "\n".join(lines) + "\n"
