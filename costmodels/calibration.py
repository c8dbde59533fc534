"""Calibrate the per-step overhead and a scale factor against measured serving runs.

A run (``costmodels.runs``) is one closed-loop benchmark: ``batch_size`` clients each
send ``isl`` prompt tokens and read ``osl`` output tokens; the measured mean TTFT and TPOT
are compared with the cost model's steady state:

- TPOT: one decode step for ``batch_size`` sequences at the mean context ``isl + osl/2``,
  plus the prompts that other clients start meanwhile (``batch_size`` prefills per
  ``osl`` steps, batched into decode steps as vLLM/TRT-LLM do);
- TTFT: the step that prefills the prompt next to the ``batch_size - 1`` running decodes.

Both are ``scale * (table parts + overhead)``, so the fit (scipy ``least_squares`` on
relative TPOT errors) has two parameters per (GPU, framework, model, GEMM dtype) across
TP degrees; a pooled fit per (GPU, framework, dtype) serves other models. The result is a
JSON file that ``costmodels.build(..., calibration=PATH)`` applies. The same file format
ships for the measured combinations in ``data/calibration.json``.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import polars as pl
from scipy.optimize import least_squares

from costmodels.architecture import load_model
from costmodels.compose import with_comm_scale
from costmodels.costmodel import CostModel, CostModelError, read_json_file
from costmodels.runs import SETUP, kv_dtype_of, layout_label, with_layout
from costmodels.steptable import StepTables, step_seconds

BUNDLED = Path(__file__).resolve().parent / "data" / "calibration.json"
FORMAT = "servetune-calibration/1"
#: The terms an entry corrects the tables with. A replay-fitted entry lists in
#: ``pinned_terms`` those its fit left on a limit of their search range: their values are
#: the limit's, and ``apply_calibration`` says so in the cost model's source.
FITTED_TERMS = ("overhead_s", "scale", "prefill_scale", "decode_scale", "prefill_step_s", "comm_scale")


def fitted_layouts(layouts) -> list[list[int]]:
    """An entry's ``layouts``: the distinct [tp, moe_ep_size, attention_dp_size] it was fitted on."""
    return [list(lay) for lay in sorted({tuple(int(v) for v in lay) for lay in layouts})]


def parallel_path(moe_ep_size: int, attention_dp_size: int) -> str:
    """The execution path a layout runs, which an entry's corrections belong to: "tp" (plain
    tensor parallelism), "ep" (experts spread by expert parallelism: all-to-all dispatch and
    combine around grouped GEMMs instead of an all-reduce after the MoE), "dp" (attention
    data parallelism: each group schedules its own batch, gathered around the experts) or
    "ep+dp". Each runs other kernels and collectives with their own fixed costs, so an
    entry fitted on one path is no evidence about another."""
    return "+".join(p for p, on in (("ep", moe_ep_size > 1), ("dp", attention_dp_size > 1)) if on) or "tp"


def with_key_columns(runs: pl.DataFrame) -> pl.DataFrame:
    """``runs`` (``with_layout``) with what an entry's key (``entry_key``) reads off a run:
    ``_gpu``, the GPU's canonical name, and ``_path``, its ``parallel_path``."""
    from costmodels.gpus import load_gpu

    return with_layout(runs).with_columns(
        pl.col("gpu").map_elements(lambda g: load_gpu(g).name, return_dtype=pl.Utf8).alias("_gpu"),
        pl.struct("moe_ep_size", "attention_dp_size").map_elements(
            lambda r: parallel_path(r["moe_ep_size"], r["attention_dp_size"]), return_dtype=pl.Utf8).alias("_path"))


def entry_path(entry: dict) -> str:
    """The path (``parallel_path``) an entry was fitted on: entries without the field were
    fitted on plain TP."""
    return entry.get("path", "tp")


def entry_key(entry: dict) -> tuple[str, str, str, str, str]:
    """What one entry is fitted for: (gpu, framework, model or "*", gemm_dtype, path)."""
    return entry["gpu"], entry["framework"], entry["model"], entry["gemm_dtype"], entry_path(entry)


def _raw(t: StepTables) -> StepTables:
    return t._replace(overhead_s=0.0, scale=1.0, prefill_scale=1.0, decode_scale=1.0)


def tpot_parts(tables: StepTables, batch: np.ndarray, isl: np.ndarray, osl: np.ndarray) -> np.ndarray:
    """Table seconds per run, before overhead and scale."""
    t = _raw(tables)
    out = np.empty(len(batch))
    for i, (b, s, o) in enumerate(zip(batch, isl, osl, strict=True)):
        decode, _ = step_seconds(t, b, b, b, b * (s + o / 2.0), 0.0)
        prompt, _ = step_seconds(t, s, 0, 0, 0.0, s * (s + 1) / 2.0)
        out[i] = decode + b / o * prompt
    return out


def ttft_parts(tables: StepTables, batch: np.ndarray, isl: np.ndarray, osl: np.ndarray) -> np.ndarray:
    """Table seconds per run for TTFT: one mixed step with the prompt and the running decodes."""
    t = _raw(tables)
    out = np.empty(len(batch))
    for i, (b, s, o) in enumerate(zip(batch, isl, osl, strict=True)):
        running = b - 1
        out[i], _ = step_seconds(t, s + running, b, running, running * (s + o / 2.0), s * (s + 1) / 2.0)
    return out


def predict(table_s: np.ndarray, overhead_s: float, scale: float) -> np.ndarray:
    """Each part holds one step's overhead: ``scale * (table seconds + overhead)``."""
    return scale * (table_s + overhead_s)


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured) * 100.0)


def fit(table_s: np.ndarray, measured_s: np.ndarray, overhead0: float) -> tuple[float, float]:
    """Least-squares (overhead_s >= 0, scale > 0) on relative error."""
    def residual(p: np.ndarray) -> np.ndarray:
        return predict(table_s, p[0], p[1]) / measured_s - 1.0

    result = least_squares(residual, x0=[overhead0, 1.0], bounds=([0.0, 0.05], [0.5, 20.0]))
    return float(result.x[0]), float(result.x[1])


def calibrate(runs: pl.DataFrame, builder=None) -> list[dict]:
    """Fit entries per (gpu, framework, model, gemm_dtype, parallel path) and pooled per
    (gpu, framework, gemm_dtype, parallel path)."""
    from costmodels.build import build
    from costmodels.gpus import load_gpu

    builder = builder or build
    runs = with_layout(runs)
    rows = []  # per run: keys, tpot parts, ttft parts, measured
    for (model, gpu, fw, dtype, tp, ep, dp), group in runs.group_by(["model", "gpu", "framework", "gemm_dtype", *SETUP],
                                                                     maintain_order=True):
        try:
            cost = builder(model, gpu, tp=int(tp), framework=fw, gemm_dtype=dtype, kv_dtype=kv_dtype_of(dtype),
                           calibration=False, moe_ep_size=int(ep), attention_dp_size=int(dp))
        except CostModelError as exc:
            label = layout_label({"tp": tp, "moe_ep_size": ep, "attention_dp_size": dp})
            raise CostModelError(f"runs for {model} on {gpu} {label} {fw}/{dtype}: {exc}") from exc
        b, s, o = (group[c].to_numpy().astype(np.float64) for c in ("batch_size", "isl", "osl"))
        rows.append(dict(model=model, gpu=load_gpu(gpu).name, framework=fw, gemm_dtype=dtype, tp=int(tp),
                         layout=[int(tp), int(ep), int(dp)], path=parallel_path(int(ep), int(dp)),
                         step_source=step_source(cost),
                         tpot=tpot_parts(cost.tables, b, s, o), ttft=ttft_parts(cost.tables, b, s, o),
                         tpot_ms=group["tpot_ms"].to_numpy(), ttft_ms=group["ttft_ms"].to_numpy(),
                         overhead0=cost.tables.overhead_s, cost=cost))
    entries = []
    for pooled in (False, True):
        keys = ("gpu", "framework", "gemm_dtype", "path", "step_source") if pooled else (
            "gpu", "framework", "model", "gemm_dtype", "path", "step_source")
        for key in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
            sel = [r for r in rows if tuple(r[k] for k in keys) == key]
            entries.append(_fit_entry(dict(zip(keys, key, strict=True)) | ({"model": "*"} if pooled else {}), sel))
    return entries


def _fit_entry(key: dict, sel: list[dict]) -> dict:
    tpot, ttft, tpot_ms, ttft_ms = (np.concatenate([r[k] for r in sel]) for k in ("tpot", "ttft", "tpot_ms", "ttft_ms"))
    tpot_s, ttft_s = tpot_ms / 1e3, ttft_ms / 1e3
    overhead0 = sel[0]["overhead0"]
    overhead, scale = fit(tpot, tpot_s, overhead0)
    return key | fitted_routing(r["cost"] for r in sel) | {
        "models": sorted({r["model"] for r in sel}),
        "tp": sorted({r["tp"] for r in sel}), "layouts": fitted_layouts(r["layout"] for r in sel),
        "n_runs": int(len(tpot_s)), "fit": "formula",
        "overhead_s": overhead, "scale": scale,
        "tpot_mape_before": mape(predict(tpot, overhead0, 1.0), tpot_s),
        "tpot_mape_after": mape(predict(tpot, overhead, scale), tpot_s),
        "ttft_mape_before": mape(predict(ttft, overhead0, 1.0), ttft_s),
        "ttft_mape_after": mape(predict(ttft, overhead, scale), ttft_s),
    }


def save_calibration(entries: list[dict], path: str | Path, tier_errors: dict | None = None) -> None:
    """Write ``entries`` and, when given, the measured error per fallback tier
    (``load_tier_errors``) as a calibration file."""
    data = {"format": FORMAT, "entries": entries} | ({"tier_errors": tier_errors} if tier_errors else {})
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_tier_errors(path: str | Path) -> dict:
    """The calibration file's measured error per tier: ``{"method", "command", "tiers": {tier:
    {"ttft_mape", "tpot_mape", "runs", "setups"}}}``, where a tier is a ``MATCHES`` level,
    "none" or "roofline", and its error is that of held-out runs which the fallback chain
    gave that tier (``benchmarks/fidelity_unseen.py``); ``{}`` when the file states none."""
    data = read_json_file(Path(path), "calibration file")
    tiers = (data.get("tier_errors") if isinstance(data, dict) else None) or {}
    for tier, figure in (tiers.get("tiers") or {}).items():
        if not all(isinstance(figure.get(k), int | float) and figure[k] >= 0 for k in ("ttft_mape", "tpot_mape")):
            raise CostModelError(f"calibration file {path}: tier_errors for {tier!r} need ttft_mape and tpot_mape >= 0")
    return tiers


def load_calibration(path: str | Path) -> list[dict]:
    path = Path(path)
    data = read_json_file(path, "calibration file")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CostModelError(f"calibration file {path}: expected format {FORMAT!r}")
    for i, e in enumerate(data["entries"]):
        if not (e.get("overhead_s", -1) >= 0 and e.get("scale", 0) > 0 and e.get("prefill_step_s", 0.0) >= 0
                and e.get("prefill_scale", 1.0) > 0 and e.get("decode_scale", 1.0) > 0
                and e.get("comm_scale", 1.0) > 0):
            raise CostModelError(f"calibration file {path}: entry {i} needs overhead_s >= 0, prefill_step_s >= 0 "
                                 f"and scales > 0")
        missing = [k for k in ("model", "gpu", "framework", "gemm_dtype") if k not in e]
        if missing:
            raise CostModelError(f"calibration file {path}: entry {i} lacks {missing}")
        pinned = e.get("pinned_terms", [])
        if not isinstance(pinned, list) or not set(pinned) <= set(FITTED_TERMS):
            raise CostModelError(f"calibration file {path}: entry {i} pinned_terms must list terms of "
                                 f"{list(FITTED_TERMS)}, got {pinned!r}")
        paths = {parallel_path(ep, dp) for _, ep, dp in e.get("layouts", [])} - {entry_path(e)}
        if paths:
            raise CostModelError(f"calibration file {path}: entry {i} is for the {entry_path(e)!r} path but was "
                                 f"fitted on layouts of {sorted(paths)}; refit it (one entry per parallel path)")
    return data["entries"]


#: How an entry was chosen for a cost model, most specific first (the fallback chain).
MATCHES = ("setup", "model", "family", "pooled", "other_gpu", "other_path")
#: Fewest held-out runs a tier's measured error (``load_tier_errors``) needs to stand for the tier.
MIN_TIER_RUNS = 10
#: No entry must beat a tier's lent entries by this share of their summed error for the chain
#: to skip the tier: a closer call is noise (the dev rows' other_gpu tier, 41.4 against 41.2,
#: flipped when decided without the setup it served), and the chain stays as it is.
SKIP_MARGIN = 0.10


def losing_tiers(tier_errors: dict) -> set[str]:
    """The tiers whose lent entries did worse on held-out runs than no entry at all did on
    the same runs (summed TTFT and TPOT MAPE, by more than ``SKIP_MARGIN``; at least
    ``MIN_TIER_RUNS`` runs;
    ``benchmarks/fidelity_unseen.py``): "no entry" is a candidate at every step of the chain,
    and the chain skips a tier the evidence puts behind it (``match_entry(skip=...)``)."""
    out = set()
    for tier, f in (tier_errors.get("tiers") or {}).items():
        none = (f.get("none_ttft_mape"), f.get("none_tpot_mape"))
        if f.get("runs", 0) >= MIN_TIER_RUNS and all(isinstance(v, int | float) for v in none) \
                and sum(none) < (1 - SKIP_MARGIN) * (f["ttft_mape"] + f["tpot_mape"]):
            out.add(tier)
    return out


def step_source(cost: CostModel) -> str:
    """What a cost model's step time comes from (``profiled``, ``roofline``, ``measured``):
    an entry's overhead and scales correct that source, and only it."""
    return cost.source.split(":", 1)[0]


def fitted_routing(costs) -> dict:
    """``{"moe_distribution": d}`` for an entry fitted on cost models whose MoE layers were
    timed at routing skew ``d``, ``{}`` when none has MoE layers: such an entry corrects
    step times read at that skew, and only those (``match_entry``)."""
    skews = {c.moe_distribution for c in costs} - {None}
    if len(skews) > 1:
        raise CostModelError(f"one entry cannot be fitted on MoE step times read at several routing skews: "
                             f"{sorted(skews)}")
    return {"moe_distribution": skews.pop()} if skews else {}


def entry_family(entry: dict) -> str:
    """The model family (HF ``model_type``) an entry was fitted on; "" for a pooled entry
    or a model servetune does not know."""
    if entry.get("family") or entry["model"] == "*":
        return entry.get("family", "")
    try:
        return load_model(entry["model"]).family
    except CostModelError:
        return ""


def entry_models(entry: dict, entries: list[dict]) -> list[str]:
    """The models an entry was fitted on. A pooled entry written before entries named them
    pooled the model entries of its file with the same GPU, framework, dtype, path and step
    source (``calibrate``, ``calibrate_replay``)."""
    if entry.get("models"):
        return list(entry["models"])
    if entry["model"] != "*":
        return [entry["model"]]
    key = ("gpu", "framework", "gemm_dtype", "path", "step_source")
    return sorted({e["model"] for e in entries if e["model"] != "*"
                   and all(e.get(k) == entry.get(k) for k in key)})


def entry_kinds(entry: dict, entries: list[dict]) -> set[str]:
    """The architecture classes (``Architecture.kind``) of the models an entry was fitted on;
    "unknown" for a model servetune does not know, or a pool that names none."""
    kinds = set()
    for model in entry_models(entry, entries):
        try:
            kinds.add(load_model(model).kind)
        except CostModelError:
            kinds.add("unknown")
    return kinds or {"unknown"}


def match_entry(entries: list[dict], *, model: str, family: str, gpu: str, framework: str, gemm_dtype: str,
                tp: int, kv_dtype: str, source: str = "profiled", layout: tuple[int, int] = (1, 1),
                moe_distribution: str | None = None, kind: str = "",
                skip: set[str] | frozenset[str] = frozenset()) -> tuple[dict | None, str]:
    """The entry for a setup and how it matched (``MATCHES``), within the framework and GEMM
    dtype: the same model on this GPU at this TP, layout (``layout``: EP size, attention-DP
    size; an entry fitted on other layouts of the TP, or one without ``layouts``, which was
    fitted on plain TP, is no ``setup`` match of another) and KV dtype (``setup``), at any
    TP or layout of its parallel path (``model``), another model of its family (``family``),
    the pooled fit of the GPU (``pooled``), the same chain fitted on another GPU
    (``other_gpu``: the scales of one GPU's tables applied to another's, the decode-step
    overhead left at the framework's default, ``apply_calibration``; the GPU nearest in memory
    bandwidth first, ``_nearest_gpu_first``).
    Every tier keeps to the setup's parallel path (``parallel_path``): EP and attention DP
    run other kernels and collectives with other fixed costs, so only when no entry of the
    path exists anywhere does an entry of another path stand in, and only the same model's
    (``other_path``, this GPU first): held out, DeepSeek-V3 TP8 on DeepSeek-R1's EP entries
    was far worse than on none (TTFT 64.8% / TPOT 89.0% against 44.9% / 12.1%), while the
    R1 setups on each other's entries mostly beat none (``benchmarks/fallback_chain.py``).
    (None, "none") when nothing matches.
    Only entries fitted on the same ``source`` of step times count (entries without the
    field were fitted on profiled tables), and for an MoE model (``moe_distribution``, its
    routing skew) only entries fitted at that skew or on models without MoE layers. With
    ``kind`` (the model's ``Architecture.kind``), only entries fitted on models of that
    class alone: a dense model's step times are not corrected by a DeepSeek fit (MoE + MLA
    kernels, other fixed costs), nor the other way round. The tiers in ``skip``
    (``losing_tiers``) lend nothing: the chain walks on past them."""
    usable = [e for e in entries if e["framework"] == framework and e["gemm_dtype"] == gemm_dtype
              and e.get("step_source", "profiled") == source
              and (moe_distribution is None or e.get("moe_distribution") in (moe_distribution, None))
              and (not kind or e["model"] == model or entry_kinds(e, entries) == {kind})]
    path = parallel_path(*layout)
    same = [e for e in usable if entry_path(e) == path]
    for e in same:
        fitted = e.get("layouts", [[t, 1, 1] for t in e.get("tp", [])])
        if e["gpu"] == gpu and e["model"] == model and [tp, *layout] in fitted \
                and e.get("kv_dtype", e["gemm_dtype"]) == kv_dtype:
            return e, "setup"
    tiers = (lambda e: e["model"] == model,
             lambda e: bool(family) and e["model"] not in ("*", model) and entry_family(e) == family,
             lambda e: e["model"] == "*")
    for how, test in zip(("model", "family", "pooled"), tiers, strict=True):
        found = next((e for e in same if e["gpu"] == gpu and test(e)), None)
        if found is not None and how not in skip:
            return found, how
    other = _nearest_gpu_first([e for e in usable if entry_path(e) != path], gpu)
    for pool, how, tests in ((_nearest_gpu_first(same, gpu), "other_gpu", tiers), (other, "other_path", tiers[:1])):
        # same: this GPU's entries failed the tiers above
        for test in tests if how not in skip else ():
            found = next((e for e in pool if test(e)), None)
            if found is not None:
                return found, how
    return None, "none"


def _nearest_gpu_first(entries: list[dict], gpu: str) -> list[dict]:
    """``entries``, this GPU's first, then the others by how far their GPU's HBM bandwidth is
    from this one's (decode steps, most of a serving run, follow it), ties in file order: a
    fallback from another GPU is taken from the nearest, whatever the file's order."""
    from costmodels.gpus import load_gpu

    def bandwidth(name: str) -> float | None:
        try:
            return load_gpu(name).hbm_bytes_per_s
        except CostModelError:  # a GPU servetune does not know: no distance to rank it by
            return None

    here = bandwidth(gpu)

    def distance(e: dict) -> float:
        there = bandwidth(e["gpu"])
        return 0.0 if here is None else math.inf if there is None else abs(there - here)

    return sorted(entries, key=lambda e: (e["gpu"] != gpu, distance(e)))


def apply_calibration(cost: CostModel, model: str, gpu: str, framework: str, gemm_dtype: str,
                      calibration: str | Path | bool | None, kv_dtype: str | None = None,
                      family: str = "", layout: tuple[int, int] = (1, 1), kind: str = "") -> CostModel:
    """``cost`` with a calibrated overhead and scales, and ``cost.calibration`` saying
    which entry (file, match level, its fitted values and stated error) it used, with the
    file's measured error per tier (``load_tier_errors``). An entry
    of another model lends its terms but not its ``measured_server`` (None): the replay
    fits choose the server's unrecorded settings per model, from that model's runs.
    ``layout``: the model's (EP size, attention-DP size), and ``kind`` its architecture
    class, for ``match_entry``.

    ``calibration``: a file (an entry must match), None (the bundled file, if it has a
    match; otherwise the model stays uncalibrated and ``source`` says so) or False (never).
    """
    if calibration is False:
        return replace(cost, calibration={"file": None, "match": "off"})
    path = BUNDLED if calibration is None else Path(calibration)
    if calibration is None and not path.is_file():
        return replace(cost, source=cost.source + "; uncalibrated", calibration={"file": None, "match": "none"})
    kv_dtype = kv_dtype or gemm_dtype
    entries, tier_errors = load_calibration(path), load_tier_errors(path)
    entry, how = match_entry(entries, model=model, family=family, gpu=gpu, framework=framework,
                             gemm_dtype=gemm_dtype, tp=cost.tp, kv_dtype=kv_dtype, source=step_source(cost), layout=layout,
                             moe_distribution=cost.moe_distribution, kind=kind, skip=losing_tiers(tier_errors))
    if entry is None:
        if calibration is not None:
            raise CostModelError(f"calibration file {path} has no entry for {model} on {gpu} with "
                                 f"{framework}/{gemm_dtype}")
        return replace(cost, source=cost.source + "; uncalibrated",
                       calibration={"file": None, "match": "none", "tier_errors": tier_errors})
    scales = {k: float(entry.get(k, 1.0)) for k in ("prefill_scale", "decode_scale")}
    prefill_step_s, comm_scale = float(entry.get("prefill_step_s", 0.0)), float(entry.get("comm_scale", 1.0))
    # the decode-step overhead is the measured host's (its engine loop and CPU), not the GPU
    # tables': an entry of another GPU, fitted on another machine, lends its scales but not it
    overhead_s = float(cost.tables.overhead_s) if how == "other_gpu" else float(entry["overhead_s"])
    tables = with_comm_scale(cost.tables, cost.comm_s, comm_scale)._replace(
        overhead_s=overhead_s, scale=entry["scale"], prefill_step_s=prefill_step_s, **scales)
    label = "default" if calibration is None else path.name
    split = "" if scales == {"prefill_scale": 1.0, "decode_scale": 1.0} else (
        f", prefill x{scales['prefill_scale']:.3f}, decode x{scales['decode_scale']:.3f}")
    split += f", prompt steps +{prefill_step_s * 1e3:.1f} ms" if prefill_step_s else ""
    split += f", communication x{comm_scale:.3f}" if comm_scale != 1.0 else ""
    pinned = list(entry.get("pinned_terms") or [])
    split += f"; {', '.join(pinned)} held at the fit's range limit, not placed by the runs" if pinned else ""
    models = entry_models(entry, entries)
    used = {"file": label, "match": how, "model": entry["model"], "models": models, "gpu": entry["gpu"],
            "tp": entry.get("tp"),
            "measured_server": dict(entry.get("measured_server") or {}) if entry["model"] == model else None,
            "overhead_s": overhead_s, "scale": entry["scale"], **scales, "prefill_step_s": prefill_step_s,
            "comm_scale": comm_scale,
            "pinned_terms": pinned, "tier_errors": tier_errors,
            "error": entry.get("error") or {"in_sample_tpot_mape": entry.get("tpot_mape_after"),
                                            "in_sample_ttft_mape": entry.get("ttft_mape_after"),
                                            "out_of_sample": None}}
    return replace(cost, tables=tables, calibration=used, source=cost.source + f"; calibrated:{label} {how}{_fitted_on(entry, how, models)} "
                   f"(overhead {overhead_s * 1e3:.2f} ms{' (the default: not lent)' if how == 'other_gpu' else ''}, "
                   f"scale {entry['scale']:.3f}{split})")


def _fitted_on(entry: dict, how: str, models: list[str]) -> str:
    """Where a fallback entry was fitted, for the source label; a pool says what it holds."""
    if entry["model"] == "*":
        names = ", ".join(m.split("/")[-1] for m in models) or "none named"
        held = f"{len(models)} model{'s' if len(models) != 1 else ''}: {names}"
        fitted = held if how == "pooled" else f"pool of {held}"
    else:
        fitted = entry["model"]
    if how == "other_path":
        return f" ({fitted} on {entry['gpu']}, {entry_path(entry)} path)"
    if how == "other_gpu":
        return f" ({fitted} on {entry['gpu']})"
    return f" ({fitted})" if how in ("family", "pooled") else ""
