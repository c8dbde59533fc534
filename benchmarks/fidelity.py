"""Fidelity: the engine against measured closed-loop H100 runs (mean TTFT and TPOT per run).

Replays every row of ``silicon_dense_h100.csv`` (or ``--runs``, any CSV in that format)
through the engine as the benchmark client that produced it drove the server
(``optimizer.fidelity.closedloop.BenchClient``: AIPerf's start-up burst, awaited warm-up, profiled
request count; a run from another client, such as the breadth file's InferenceX rows, is
replayed as that one: ``closedloop.client_for``), with each framework's scheduler: the
path of ``servetune validate``.
The cost model is calibrated by replay (``optimizer.fidelity.replayfit.calibrate_replay``: overhead,
prefill and decode scales and the measured server's token budget, fitted so the closed
loop reproduces the runs). Two figures per (model, framework, TP) group and overall:

- **in sample**: the calibration fitted on every row, these rows included;
- **leave one group out** (LOGO): for each group, the calibration is fitted on every
  *other* group's rows and the group is scored with it, so its rows never reach the fit
  that scores them; the entry it gets is the one ``apply_calibration`` chooses
  (``costmodels.calibration.match_entry``: the same model at other TPs, else its family,
  else the pooled fit of its GPU, framework and dtype), which is what a user of a setup
  nobody measured gets. This is the figure to quote.

As the baselines measured in the same run, it also scores (in sample and LOGO, overall)
the previous harness (lockstep clients, ``closedloop.LOCKSTEP``) and the AIPerf harness,
both with the steady-state formula calibration ``costmodels.calibrate`` fits.

Writes ``fidelity.md``, ``fidelity.json`` (the figures), ``fidelity.csv`` (per-run
predictions, in sample and LOGO), ``fidelity_scatter.png`` (LOGO) and
``fidelity_calibration.json`` (the replay calibration of every row, each entry with its
in-sample and LOGO error) to ``--out``; ``--install`` also writes those entries into the
bundled calibration ``costmodels/data/calibration.json`` (replacing entries of the same
keys), which is how it was made.

The **breadth** runs (``silicon_breadth_dev.csv``: Qwen3-235B-A22B-FP8 on H100,
DeepSeek-V3/R1 on H200, Llama-3.1-70B on B200, all TRT-LLM, with expert and attention data
parallelism) are scored the same way on their own (``breadth``): replay calibration fitted
on breadth rows only, in sample and leaving one setup (model, GPU, framework, dtype,
layout) out, each run replayed on the cost model of one attention-DP group of its layout;
the figures per model x GPU x framework and per setup go to ``fidelity_breadth.md``,
``.json`` and ``.csv``, the entries (with their leave-one-setup-out error) to
``fidelity_breadth_calibration.json`` and, with ``--install``, into the bundled file.
Rows servetune cannot score (64-GPU instances) and runs the file lists twice under two model
names (scored once) are listed with the reason.

Last, the **harsher protocols** of ``benchmarks/fidelity_unseen.py`` (leave a whole
framework/dtype/GPU out, leave a whole model out) score both files together on the entries
just fitted, beside LOGO, with the error per fallback tier that ``tune`` reads (installed
with ``--install``). ``--part`` runs one of dense, breadth or unseen (the other parts' files
are left as they are; unseen reads them).

    python benchmarks/fidelity.py [--runs FILE.csv] [--breadth-runs FILE.csv] [--part both|dense|breadth|unseen]
                                  [--quick] [--jobs 2] [--install] [--client-ingress-ms MS] [--client-jitter-ms MS]
                                  [--ttft-weight W] [--residual-scale S] [--moe-distribution SKEW] [--comm-scale]

``--client-ingress-ms`` / ``--client-jitter-ms`` fit and replay with a variant of the
client (``BenchClient.ingress_s``, ``jitter_s``) to test what the harness explains;
``--ttft-weight`` / ``--residual-scale`` change the replay fit's loss
(``replayfit.TTFT_WEIGHT``, ``RESIDUAL_SCALE``); ``--moe-distribution`` times the MoE
layers at another routing skew (``costmodels.moeops.DEFAULT_DISTRIBUTION`` by default);
``--comm-scale`` lets each TRT-LLM fit scale the collectives apart from the decode scale
(``replayfit.COMM_SCALE_FRAMEWORKS``). The bundled figures use the defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels import build, calibrate, load_calibration, load_runs, save_calibration  # noqa: E402
from costmodels.architecture import load_model  # noqa: E402
from costmodels.calibration import (  # noqa: E402
    BUNDLED,
    entry_key,
    entry_path,
    fitted_layouts,
    load_tier_errors,
    match_entry,
    with_key_columns,
)
from costmodels.costmodel import CostModelError  # noqa: E402
from costmodels.distil import aic_root, shared_dir  # noqa: E402
from costmodels.gpus import load_gpu  # noqa: E402
from costmodels.moeops import DEFAULT_DISTRIBUTION, DISTRIBUTIONS  # noqa: E402
from costmodels.runs import SETUP, kv_dtype_of, layout_label, with_layout  # noqa: E402
from optimizer.cli.validate import format_report, predict_runs, scatter_figure, server_label  # noqa: E402
from optimizer.fidelity.closedloop import LOCKSTEP, BenchClient  # noqa: E402
from optimizer.fidelity.replayfit import RESIDUAL_SCALE, TTFT_WEIGHT, calibrate_replay  # noqa: E402

#: A leave-one-out group: one measured setup (the GPU and dtype go with the model here).
LOGO_KEYS = ["model", "gpu", "framework", "gemm_dtype", "tp"]


#: A run's point and what it measured, equal in no two runs of a server (floats to the last digit)
RUN_POINT = ["isl", "osl", "batch_size", "ttft_ms", "tpot_ms"]


def logo_splits(runs: pl.DataFrame, keys=LOGO_KEYS):
    """(key, held-out rows, training rows) per group: the training rows are every other
    group's, so no row of a group reaches the fit that scores it, nor does the same
    measurement filed under another name (``refiled_runs``)."""
    runs = runs.with_row_index("_split")
    for key, held in runs.group_by(keys, maintain_order=True):
        train = runs.join(held.select("_split"), on="_split", how="anti").join(
            held.select(RUN_POINT), on=RUN_POINT, how="anti")
        yield key, held.drop("_split"), train.drop("_split")


def fallback_key(held: pl.DataFrame, train: pl.DataFrame) -> tuple | None:
    """The key (``entry_key``) of the calibration entry ``apply_calibration`` would give the
    held-out setup from entries fitted on the training rows (one per model and parallel
    path across its layouts, one pooled per GPU, framework, dtype and path, as
    ``calibrate_replay`` fits them), walking the same chain (``chain_entry``); None when no
    training entry matches."""
    train = with_key_columns(train).drop("gpu").rename({"_gpu": "gpu", "_path": "path"})
    candidates = []
    for cols in (["gpu", "framework", "model", "gemm_dtype", "path"], ["gpu", "framework", "gemm_dtype", "path"]):
        for key, group in train.group_by(cols, maintain_order=True):
            e = dict(zip(cols, key, strict=True))
            candidates.append({"model": "*", **e, "kv_dtype": kv_dtype_of(e["gemm_dtype"]), "models": sorted(set(group["model"])),
                               "layouts": fitted_layouts(group.select(list(SETUP)).iter_rows())})
    entry = chain_entry(with_layout(held).row(0, named=True), candidates)
    return None if entry is None else entry_key(entry)


def chain_entry(run: dict, entries: list[dict]) -> dict | None:
    """The entry of ``entries`` that ``apply_calibration``'s fallback chain
    (``costmodels.calibration.match_entry``) gives the setup of ``run`` (a runs row); None
    when none matches."""
    arch = load_model(run["model"])
    entry, _ = match_entry(entries, model=run["model"], family=arch.family, kind=arch.kind,
                           gpu=load_gpu(run["gpu"]).name, framework=run["framework"], gemm_dtype=run["gemm_dtype"],
                           tp=run["tp"], kv_dtype=kv_dtype_of(run["gemm_dtype"]),
                           layout=(run["moe_ep_size"], run["attention_dp_size"]))
    return entry


def formula_fitter(train: pl.DataFrame, keys=None) -> list[dict]:
    return calibrate(train)


def replay_fitter(train: pl.DataFrame, keys=None, bench: BenchClient | None = None,
                  moe_distribution: str = DEFAULT_DISTRIBUTION, **fit) -> list[dict]:
    """``calibrate_replay`` with the fit's options (``fit_options``), MoE layers timed at
    ``moe_distribution``."""
    builder = functools.partial(build, moe_distribution=moe_distribution)
    return calibrate_replay(train, keys=keys, bench=bench, builder=builder, **fit)


def _fold(args):
    """One fit (a LOGO fold, or a slice of the in-sample fit): entries for ``keys``."""
    fitter, train, keys = args
    return fitter(train, keys)


def predict_with(held: pl.DataFrame, entries: list[dict] | None, bench: BenchClient, tmp: Path, tag: str,
                 moe_distribution: str):
    if not entries:  # no entry can match: the uncalibrated model, as a user would get it
        return predict_runs(held, calibration=False, bench=bench, moe_distribution=moe_distribution)
    path = tmp / f"{tag}.json"
    save_calibration(entries, path)
    return predict_runs(held, calibration=path, bench=bench, moe_distribution=moe_distribution)


def evaluate(runs: pl.DataFrame, fitter, bench: BenchClient, pool=None, keys=LOGO_KEYS,
             moe_distribution: str = DEFAULT_DISTRIBUTION):
    """(in-sample predictions, LOGO predictions, the in-sample entries) for one fitter,
    leaving out one ``keys`` group at a time; MoE layers timed at ``moe_distribution``, as
    the fitter times them."""
    splits = list(logo_splits(runs, keys))
    fold_keys = [fallback_key(held, train) for _, held, train in splits]
    tasks = [(fitter, part, None) for _, part in runs.group_by(["gpu", "framework", "gemm_dtype"], maintain_order=True)]
    n_slices = len(tasks)
    tasks += [(fitter, train, None if k is None else [k]) for (_, _, train), k in zip(splits, fold_keys, strict=True)]
    results = list(pool.map(_fold, tasks)) if pool is not None else [_fold(t) for t in tasks]
    entries = [e for part in results[:n_slices] for e in part]
    folds = results[n_slices:]
    with tempfile.TemporaryDirectory() as tmp:
        insample = predict_with(runs, entries, bench, Path(tmp), "all", moe_distribution)
        parts = []
        for i, ((_, held, _), k, fold) in enumerate(zip(splits, fold_keys, folds, strict=True)):
            mine = [e for e in fold if k is not None and entry_key(e) == k]
            parts.append(predict_with(held, mine, bench, Path(tmp), f"fold{i}", moe_distribution))
        logo = pl.concat(parts, how="vertical_relaxed").sort("row")
    return insample, logo, entries


def pinned_lines(entries: list[dict]) -> list[str]:
    """The in-sample entries whose fit left terms on a limit of their range
    (``replayfit.pinned_terms``): those terms are the limit's, not the runs'."""
    pinned = [e for e in entries if e.get("pinned_terms")]
    return ["fitted terms held at a limit of their range (not placed by the runs; the entry's other terms "
            "absorb what they could not):",
            *(f"  {e['model']} {e['gpu']} {e['framework']}/{e['gemm_dtype']} {entry_path(e)}: "
              f"{', '.join(e['pinned_terms'])}" for e in pinned)] + ([] if pinned else ["  none"])


def _ape(pred: str, measured: str) -> pl.Expr:
    return (pl.col(pred) - pl.col(measured)).abs() / pl.col(measured) * 100.0


def overall(pred: pl.DataFrame) -> tuple[float, float]:
    ok = pred.filter(pl.col("error").is_null())
    return ok.select(_ape("pred_ttft_ms", "ttft_ms").mean()).item(), ok.select(_ape("pred_tpot_ms", "tpot_ms").mean()).item()


#: The dense groups' table rows: one per (model, framework, TP).
GROUP_KEYS = ["model", "framework", "gemm_dtype", "tp"]


def group_table(insample: pl.DataFrame, logo: pl.DataFrame, keys=GROUP_KEYS) -> pl.DataFrame:
    """MAPE per ``keys`` group and overall (keys "all", or 0 for a number): in sample and
    LOGO side by side, with the signed TPOT bias (median replayed / measured - 1, in %),
    which MAPE hides: a bias that moves with TP is a term the fit lacks."""

    def agg(df, tag):
        ok = df.filter(pl.col("error").is_null())
        cols = [pl.len().alias("runs"), _ape("pred_ttft_ms", "ttft_ms").mean().alias(f"ttft_{tag}"),
                _ape("pred_tpot_ms", "tpot_ms").mean().alias(f"tpot_{tag}"),
                ((pl.col("pred_tpot_ms") / pl.col("tpot_ms")).median() * 100.0 - 100.0).alias(f"tpot_bias_{tag}")]
        per = ok.group_by(keys, maintain_order=True).agg(cols)
        allrow = ok.select(cols).with_columns(pl.lit("all" if per.schema[k] == pl.Utf8 else 0).cast(per.schema[k])
                                              .alias(k) for k in keys)
        return pl.concat([per, allrow.select(per.columns)])

    a, b = agg(insample, "in"), agg(logo, "logo")
    extra = logo.group_by(keys, maintain_order=True).agg(pl.col("calibration_match").first().alias("logo_match"),
                                                         server_label().first().alias("logo_server"))
    return a.join(b.drop("runs"), on=keys, how="left", maintain_order="left").join(extra, on=keys, how="left",
                                                                                     maintain_order="left")


def format_groups(table: pl.DataFrame) -> str:
    """``group_table`` as text: its key columns (those before ``runs``), then the figures."""
    keys = table.columns[:table.columns.index("runs")]
    cells = [[str(r[k]) if r["model"] != "all" or k == "model" else "" for k in keys]
             for r in table.iter_rows(named=True)]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    lines = ["  ".join(f"{k:{w}}" for k, w in zip(keys, widths, strict=True)) + f" {'runs':>4}  {'TTFT in':>7} "
             f"{'LOGO':>6}  {'TPOT in':>7} {'LOGO':>6} {'bias':>6}  LOGO entry (server)"]
    for r, c in zip(table.iter_rows(named=True), cells, strict=True):
        how = "" if r["model"] == "all" else f"{r['logo_match']} {r['logo_server']}"
        lines.append("  ".join(f"{v:{w}}" for v, w in zip(c, widths, strict=True)) + f" {r['runs']:4d}  "
                     f"{r['ttft_in']:6.1f}% {r['ttft_logo']:5.1f}%  {r['tpot_in']:6.1f}% {r['tpot_logo']:5.1f}% "
                     f"{r['tpot_bias_logo']:+5.1f}%  {how}")
    return "\n".join(lines)


#: A breadth setup (a leave-one-out group and a table row): the layout names its TP, EP and attention DP.
BREADTH_KEYS = ["model", "gpu", "framework", "gemm_dtype", "layout"]
#: The breadth summary rows the issue states its targets on: one per model x GPU x framework.
BREADTH_SUMMARY = ["model", "gpu", "framework"]
BREADTH_TARGETS = {"tpot": 10.0, "ttft": 20.0}  # LOGO MAPE, issue 17


#: A run's setup and measurement: two rows equal in all of these are one run filed twice.
MEASUREMENT = ["gpu", "framework", "gemm_dtype", "tp", "moe_ep_size", "attention_dp_size", *RUN_POINT]


def refiled_runs(runs: pl.DataFrame) -> dict[int, str]:
    """{row: reason} for good rows that repeat an earlier row number for number (``MEASUREMENT``)
    under another model name (the breadth file lists DeepSeek-V3's TP8 runs again as
    DeepSeek-R1's): one run scored twice would weigh twice in every MAPE, so it is scored
    once, at its first row."""
    copies = runs.filter(pl.col("error").is_null()).group_by(MEASUREMENT, maintain_order=True).agg("row", "model")
    reasons = {}
    for r in copies.filter(pl.col("row").list.len() > 1).iter_rows(named=True):
        for row in r["row"][1:]:
            reasons[row] = f"{r['model'][0]}'s run again, number for number: scored once, as {r['model'][0]}'s"
    return reasons


def split_scorable(runs: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(rows servetune can score, the others with their ``reason``) of ``load_runs(...,
    bad_rows="mark")`` rows: a row is not scorable when it is bad (its ``error``), repeats an
    earlier run under another name (``refiled_runs``) or its setup has no cost model
    (``build`` says why: a 64-GPU instance, an FP4 GEMM)."""
    from costmodels import build

    reasons = refiled_runs(runs)
    runs = runs.with_columns(pl.col("error").alias("reason"))
    for key, group in runs.filter(pl.col("reason").is_null(), ~pl.col("row").is_in(list(reasons))).group_by(
            ["model", "gpu", "framework", "gemm_dtype", "tp", "moe_ep_size", "attention_dp_size"], maintain_order=True):
        model, gpu, fw, dtype, tp, ep, dp = key
        try:
            build(model, gpu, tp=tp, framework=fw, gemm_dtype=dtype, kv_dtype=kv_dtype_of(dtype), calibration=False,
                  moe_ep_size=ep, attention_dp_size=dp)
        except CostModelError as exc:
            reasons |= dict.fromkeys(group["row"].to_list(), f"no cost model: {exc}")
    runs = runs.with_columns(pl.col("reason").fill_null(pl.col("row").replace_strict(reasons, default=None,
                                                                                    return_dtype=pl.Utf8)))
    return runs.filter(pl.col("reason").is_null()).drop("reason", "error"), runs.filter(pl.col("reason").is_not_null())


#: two setups count as one server measured twice when their TPOTs agree this closely
#: (median over the shared (ISL, OSL, concurrency) points; TPOT is the steadier metric)
REPEAT_TPOT_TOL = 0.01
REPEAT_MIN_POINTS = 5


def repeats(runs: pl.DataFrame) -> list[dict]:
    """Setups of one model, GPU, framework and dtype, labelled with different layouts, whose
    runs repeat each other (median TPOT difference within ``REPEAT_TPOT_TOL`` over at
    least ``REPEAT_MIN_POINTS`` shared points): how far apart the same measurement lands twice,
    the noise floor no model of the server can get under. Differences are symmetric,
    ``|a - b| / ((a + b) / 2)``."""
    server = ["model", "gpu", "framework", "gemm_dtype"]
    point = ["isl", "osl", "batch_size"]
    out = []
    for _, same in runs.group_by(server, maintain_order=True):
        labels = same["layout"].unique(maintain_order=True).to_list()
        for i, a in enumerate(labels):
            for b in labels[i + 1:]:
                pair = same.filter(pl.col("layout") == a).join(same.filter(pl.col("layout") == b), on=point,
                                                               suffix="_b")
                if pair.height < REPEAT_MIN_POINTS:
                    continue
                diff = {m: ((pl.col(m) - pl.col(f"{m}_b")).abs() / ((pl.col(m) + pl.col(f"{m}_b")) / 2))
                        for m in ("ttft_ms", "tpot_ms")}
                d = pair.select(**diff)
                if d["tpot_ms"].median() > REPEAT_TPOT_TOL:
                    continue
                out.append({**{k: pair[k][0] for k in server}, "layouts": [a, b], "points": pair.height,
                            "ttft_diff_mean": 100 * d["ttft_ms"].mean(), "ttft_diff_max": 100 * d["ttft_ms"].max(),
                            "tpot_diff_mean": 100 * d["tpot_ms"].mean()})
    return out


def breadth(path: Path, bench: BenchClient, pool, fit: dict, quick: bool,
            command: str, mtp_acceptance: float | None = None) -> tuple[str, dict, pl.DataFrame]:
    """The breadth runs (MoE, MLA, B200, parallel layouts) scored as the dense ones are:
    replay calibration, in sample and leaving one setup (``BREADTH_KEYS``) out. Returns the
    report text, its figures and the per-run predictions; rows servetune cannot score are
    listed with their reasons, none dropped unsaid. ``mtp_acceptance``: every MTP run's
    acceptance per draft position, as if measured (None: ``optimizer.fidelity.inferencex.MTP_ACCEPTANCE``)."""
    runs = load_runs(path, bad_rows="mark").with_row_index("row")
    if mtp_acceptance is not None:
        runs = runs.with_columns(pl.lit(mtp_acceptance, dtype=pl.Float64).alias("mtp_acceptance"))
    runs = runs.with_columns(pl.struct("tp", "moe_ep_size", "attention_dp_size").map_elements(
        lambda r: layout_label(r) if r["tp"] is not None else "?", return_dtype=pl.Utf8).alias("layout"))
    scored, skipped = split_scorable(runs)
    if quick:
        scored = scored.gather_every(4)
    t0 = time.perf_counter()
    insample, logo, entries = evaluate(scored, functools.partial(replay_fitter, bench=bench, **fit),
                                       bench, pool, keys=BREADTH_KEYS,
                                       moe_distribution=fit["moe_distribution"])
    state_errors(entries, logo, "leave one setup (model, GPU, framework, dtype, layout) out", command)
    setups, summary = group_table(insample, logo, BREADTH_KEYS), group_table(insample, logo, BREADTH_SUMMARY)
    total = summary.row(-1, named=True)
    failed = logo.filter(pl.col("error").is_not_null())
    lines = [f"{runs.height} runs from {path.name}: {scored.height} scored, {skipped.height} not scorable; replay "
             f"calibration (in sample and {setups.height - 1} leave-one-setup-out folds) in "
             f"{time.perf_counter() - t0:.0f} s", "",
             "per model x GPU x framework (LOGO: fit without the setup, score on it):", format_groups(summary), "",
             "per setup (layout: tp GPUs per instance, ep expert-parallel, dp attention data-parallel groups):",
             format_groups(setups), "",
             f"breadth out of sample (LOGO), the figure to quote: TTFT MAPE {total['ttft_logo']:.1f}% (target "
             f"{BREADTH_TARGETS['ttft']:.0f}%), TPOT MAPE {total['tpot_logo']:.1f}% (target "
             f"{BREADTH_TARGETS['tpot']:.0f}%); in sample {total['ttft_in']:.1f}% / {total['tpot_in']:.1f}%", "",
             f"scored rows the engine could not replay out of sample ({failed.height}):"]
    lines += [f"  {r['error']}" for r in failed.iter_rows(named=True)] or ["  none"]
    twice = repeats(runs)
    lines += ["", "the same server measured twice (setups whose TPOT agrees within "
              f"{100 * REPEAT_TPOT_TOL:.0f}% at the median shared point; the TTFT noise floor):"]
    lines += [f"  {r['model']} {r['gpu']} {r['gemm_dtype']} {' = '.join(r['layouts'])}: {r['points']} points, TTFT "
              f"apart by {r['ttft_diff_mean']:.1f}% on average (at most {r['ttft_diff_max']:.0f}%), TPOT by "
              f"{r['tpot_diff_mean']:.1f}%" for r in twice] or ["  none"]
    osl, osl_split = osl_sensitivity(insample, logo, BREADTH_KEYS)
    lines += ["", *format_osl(osl, osl_split, BREADTH_KEYS)]
    lines += ["", *pinned_lines(entries)]
    lines += ["", "not scorable (rows, reason):"]
    for r in skipped.group_by(["model", "gpu", "gemm_dtype", "layout", "reason"], maintain_order=True).len().iter_rows(
            named=True):
        lines.append(f"  {r['len']:3d}  {r['model']} {r['gpu']} {r['gemm_dtype']} {r['layout']}: {r['reason']}")
    figures = {"runs_file": path.name, "runs": runs.height, "scored": scored.height,
               "models": sorted(runs["model"].drop_nulls().unique().to_list()),
               "not_scorable": skipped.select("row", "model", "layout", "reason").to_dicts(),
               "measured_twice": twice,
               "ttft_osl_sensitivity": {"setups": osl.to_dicts(), **osl_split},
               "groups": [r for r in summary.iter_rows(named=True) if r["model"] != "all"],
               "setups": [r for r in setups.iter_rows(named=True) if r["model"] != "all"],
               "leave_one_group_out": {"ttft_mape": total["ttft_logo"], "tpot_mape": total["tpot_logo"]},
               "in_sample": {"ttft_mape": total["ttft_in"], "tpot_mape": total["tpot_in"]},
               "targets": {f"{k}_logo_mape_max": v for k, v in BREADTH_TARGETS.items()} | {
                   "met": {k: total[f"{k}_logo"] <= v for k, v in BREADTH_TARGETS.items()}},
               "calibration": entries}
    out = insample.join(logo.select("row", pl.col("pred_ttft_ms").alias("logo_ttft_ms"),
                                    pl.col("pred_tpot_ms").alias("logo_tpot_ms"),
                                    pl.col("calibration_match").alias("logo_match"), pl.col("error").alias("logo_error")),
                        on="row", how="left").sort("row")
    return "\n".join(lines), figures, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=None, help="runs CSV (default: ../shared silicon_dense_h100.csv)")
    parser.add_argument("--quick", action="store_true", help="every 4th row")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes for the fits")
    parser.add_argument("--ttft-weight", type=float, default=TTFT_WEIGHT, help="TTFT residual weight in the replay fit")
    parser.add_argument("--residual-scale", type=float, default=RESIDUAL_SCALE,
                        help="soft-L1 scale of the replay fit's log-ratio residuals (replayfit.RESIDUAL_SCALE)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--install", action="store_true",
                        help="also write the fitted entries, with their stated errors, as the bundled calibration "
                             "(costmodels/data/calibration.json)")
    parser.add_argument("--breadth-runs", type=Path, default=None,
                        help="breadth runs CSV (default: ../shared silicon_breadth_dev.csv)")
    parser.add_argument("--part", choices=("both", "dense", "breadth", "unseen"), default="both",
                        help="score the dense runs, the breadth runs, the harsher protocols on both parts' results, "
                             "or all three (each writes its own files)")
    parser.add_argument("--client-ingress-ms", type=float, default=0.0,
                        help="BenchClient.ingress_s in ms, for fit and replay (a harness variant; default 0)")
    parser.add_argument("--client-jitter-ms", type=float, default=0.0,
                        help="BenchClient.jitter_s in ms, for fit and replay (a harness variant; default 0)")
    parser.add_argument("--mtp-acceptance", type=float, default=None,
                        help="breadth: the MTP runs' acceptance per draft position instead of "
                             "inferencex.MTP_ACCEPTANCE (a sensitivity: the runs record none)")
    parser.add_argument("--moe-distribution", choices=tuple(DISTRIBUTIONS), default=DEFAULT_DISTRIBUTION,
                        help="MoE routing skew of the fused-MoE table, for fit and replay (costmodels.moeops)")
    parser.add_argument("--comm-scale", action="store_true",
                        help="TRT-LLM fits also scale the collectives against their tables (replayfit."
                             "COMM_SCALE_FRAMEWORKS; a variant: off in the bundled figures)")
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")  # polars thread pools do not survive a fork
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=ctx) if args.jobs > 1 else _Serial() as pool:
        if args.part in ("both", "dense"):
            run_dense(args, pool)
        if args.part in ("both", "breadth"):
            run_breadth(args, pool)
    if args.part in ("both", "unseen"):  # the harsher protocols, on the entries both parts just fitted
        import fidelity_unseen

        fidelity_unseen.main(["--results", str(args.out)] + (["--install"] if args.install else []))


def fit_options(args) -> dict:
    """The replay fit's options (``replay_fitter``) from the command line."""
    return {"ttft_weight": args.ttft_weight, "residual_scale": args.residual_scale,
            "moe_distribution": args.moe_distribution, "comm_scale": args.comm_scale}


def bench_client(args) -> BenchClient:
    """The AIPerf client, with the ``--client-*`` variant if one is given."""
    return BenchClient(ingress_s=args.client_ingress_ms * 1e-3, jitter_s=args.client_jitter_ms * 1e-3)


def command_line(args, part: str) -> str:
    """The command that reproduces ``part``'s figures, with the options that change them."""
    extra = [f" --part {part}"] if part == "breadth" else []
    extra += [" --quick"] if args.quick else []
    extra += [f" --client-{k}-ms {v:g}" for k, v in (("ingress", args.client_ingress_ms),
                                                    ("jitter", args.client_jitter_ms)) if v]
    extra += [f" --{k} {v:g}" for k, v, default in (("ttft-weight", args.ttft_weight, TTFT_WEIGHT),
                                                   ("residual-scale", args.residual_scale, RESIDUAL_SCALE))
              if v != default]
    extra += [f" --moe-distribution {args.moe_distribution}"] if args.moe_distribution != DEFAULT_DISTRIBUTION else []
    extra += [f" --mtp-acceptance {args.mtp_acceptance:g}"] if part == "breadth" and args.mtp_acceptance else []
    extra += [" --comm-scale"] if args.comm_scale else []
    return "python benchmarks/fidelity.py" + "".join(extra)


def state_errors(entries: list[dict], logo: pl.DataFrame, method: str, command: str) -> None:
    """Each entry's stated out-of-sample error: the LOGO MAPE over the held-out runs it
    stands for (its GPU, framework, dtype and parallel path; its model unless pooled)."""
    logo = with_key_columns(logo)
    for e in entries:
        gpu, framework, model, dtype, path = entry_key(e)
        mine = logo.filter((pl.col("_gpu") == gpu) & (pl.col("framework") == framework)
                           & (pl.col("gemm_dtype") == dtype) & (pl.col("_path") == path)
                           & ((pl.col("model") == model) if model != "*" else pl.lit(True)))
        t, p = overall(mine) if mine.height else (None, None)
        e["error"]["out_of_sample"] = {"method": method, "ttft_mape": t, "tpot_mape": p, "runs": mine.height,
                                       "command": command}


def install(entries: list[dict], models: set[str]) -> None:
    """Write ``entries`` into the bundled calibration, replacing the entries of the same keys
    (``entry_key``) and every entry of ``models`` (the models the runs file names: an entry
    this fit no longer makes, such as one of a model whose runs all repeat another's, would
    keep a stale stated error) and keeping the rest: the dense and the breadth parts install
    apart. A replaced entry keeps its place: ``match_entry`` takes the first of equal
    candidates on other GPUs, so an install must not reorder what it does not change."""
    new = {entry_key(e): e for e in entries}
    old = load_calibration(BUNDLED) if BUNDLED.is_file() else []
    kept = [new.pop(entry_key(e)) if entry_key(e) in new else e for e in old
            if entry_key(e) in new or e["model"] not in models]
    save_calibration(kept + list(new.values()), BUNDLED, tier_errors=load_tier_errors(BUNDLED))


def run_breadth(args, pool) -> None:
    """``breadth`` on the breadth runs; writes ``fidelity_breadth.{md,json,csv}`` to ``--out``."""
    path = args.breadth_runs or aic_root(shared_dir()) / "systems" / "silicon_breadth_dev.csv"
    if not path.is_file():
        sys.exit(f"breadth runs not found at {path}; set SERVETUNE_SHARED or pass --breadth-runs")
    command = command_line(args, "breadth")
    text, figures, out = breadth(path, bench_client(args), pool, fit_options(args), args.quick, command,
                                 args.mtp_acceptance)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity_breadth.md").write_text(f"# Fidelity: breadth runs\n\nCommand: `{command}`\n\n```\n{text}\n```\n")
    (args.out / "fidelity_breadth.json").write_text(json.dumps({"command": command, **figures}, indent=1) + "\n")
    out.write_csv(args.out / "fidelity_breadth.csv")
    save_calibration(figures["calibration"], args.out / "fidelity_breadth_calibration.json")
    if args.install:
        install(figures["calibration"], set(figures["models"]))


#: Concurrency up to which these closed loops hold no queue: a request's TTFT is its prefill
#: and the few decode steps it shares, whatever the other requests' output length.
LIGHT_LOAD = 16
#: A setup's measured TTFT depends on the output length when its median ratio (longest over
#: shortest OSL, same ISL and concurrency) leaves [1 / band, band].
OSL_BAND = 1.25


def osl_sensitivity(pred: pl.DataFrame, logo: pl.DataFrame, keys) -> tuple[pl.DataFrame, dict]:
    """How a setup's TTFT moves with the output length at light load (concurrency up to
    ``LIGHT_LOAD``), measured and replayed (``pred``, the in-sample predictions): per ``keys``
    setup, the median over its (ISL, concurrency) points of TTFT at the longest OSL over
    TTFT at the shortest. ``flagged`` marks setups whose measured ratio leaves the
    ``OSL_BAND`` while the replay's stays in it: there the measurement moves with something
    the scheduler does not see (no queue forms, so output length cannot delay a first
    token), and no step-time calibration can follow it. Returns the table and the LOGO
    TTFT MAPE (``logo``) over the rows of setups flagged and not, so a reader sees how much
    of the error they carry; the headline figure keeps every row."""
    # a group keeps its rows' order, so sorted by OSL its last row over its first is the ratio
    light = pred.filter(pl.col("error").is_null(), pl.col("batch_size") <= LIGHT_LOAD).sort("osl")
    point = light.group_by([*keys, "isl", "batch_size"]).agg(
        pl.len().alias("osls"),
        *((pl.col(c).last() / pl.col(c).first()).alias(name) for c, name in (("ttft_ms", "measured"),
                                                                              ("pred_ttft_ms", "replayed"))),
    ).filter(pl.col("osls") > 1)
    table = point.group_by(keys, maintain_order=True).agg(
        pl.len().alias("points"), pl.col("measured").median(), pl.col("replayed").median(),
    ).with_columns(flagged=~_in_band("measured") & _in_band("replayed")).sort(keys)
    scored = logo.filter(pl.col("error").is_null()).join(table.select(*keys, "flagged"), on=keys, how="left")
    scored = scored.with_columns(pl.col("flagged").fill_null(False))
    split = {}
    for flag, name in ((True, "flagged"), (False, "not_flagged")):
        part = scored.filter(pl.col("flagged") == flag)
        split[name] = {"runs": part.height,
                       "logo_ttft_mape": part.select(_ape("pred_ttft_ms", "ttft_ms").mean()).item() if part.height else None}
    return table, split


def _in_band(column: str) -> pl.Expr:
    return pl.col(column).is_between(1 / OSL_BAND, OSL_BAND)


def format_osl(table: pl.DataFrame, split: dict, keys) -> list[str]:
    """``osl_sensitivity`` as report lines."""
    lines = [f"TTFT against output length at light load (concurrency <= {LIGHT_LOAD}; median over (ISL, "
             f"concurrency) points of TTFT at the longest OSL / at the shortest; flagged: measured outside "
             f"[{1 / OSL_BAND:.2f}, {OSL_BAND:.2f}], replayed inside):"]
    for r in table.iter_rows(named=True):
        setup = " ".join(str(r[k]) for k in keys)
        lines.append(f"  {setup}: {r['points']} points, measured x{r['measured']:.2f}, replayed x{r['replayed']:.2f}"
                     f"{'  FLAGGED' if r['flagged'] else ''}")
    for name, label in (("flagged", "flagged setups"), ("not_flagged", "the other setups")):
        s = split[name]
        mape = "-" if s["logo_ttft_mape"] is None else f"{s['logo_ttft_mape']:.1f}%"
        lines.append(f"  LOGO TTFT MAPE over {label}: {mape} ({s['runs']} runs)")
    return lines


def run_dense(args, pool) -> None:
    """The dense runs scored against the baselines; writes ``fidelity.*`` to ``--out``."""
    path = args.runs or aic_root(shared_dir()) / "systems" / "silicon_dense_h100.csv"
    if not path.is_file():
        sys.exit(f"measured runs not found at {path}; set SERVETUNE_SHARED or pass --runs")
    runs = load_runs(path)
    if args.quick:
        runs = runs.gather_every(4)
    runs = runs.with_row_index("row")  # joins the in-sample and LOGO predictions of a run
    aiperf = bench_client(args)
    t0 = time.perf_counter()
    base_lock = evaluate(runs, formula_fitter, LOCKSTEP, pool)
    base_aiperf = evaluate(runs, formula_fitter, aiperf, pool)
    t1 = time.perf_counter()
    insample, logo, entries = evaluate(runs, functools.partial(replay_fitter, bench=aiperf, **fit_options(args)),
                                       aiperf, pool, moe_distribution=args.moe_distribution)
    t2 = time.perf_counter()
    table = group_table(insample, logo)
    total = table.row(-1, named=True)
    osl, osl_split = osl_sensitivity(insample, logo, GROUP_KEYS)
    summary = {
        "lockstep harness, formula calibration (before)": (overall(base_lock[0]), overall(base_lock[1])),
        "AIPerf harness, formula calibration": (overall(base_aiperf[0]), overall(base_aiperf[1])),
        "AIPerf harness, replay calibration (now)": (overall(insample), overall(logo)),
    }
    command = command_line(args, "dense")
    lines = [f"{len(runs)} runs from {path.name}; baselines in {t1 - t0:.0f} s, replay calibration (in sample and "
             f"{len(list(logo_splits(runs)))} leave-one-group-out folds) in {t2 - t1:.0f} s", "",
             "harness and calibration                              TTFT in   LOGO   TPOT in   LOGO"]
    for name, ((ti, pi), (tl, pl_)) in summary.items():
        lines.append(f"{name:52} {ti:6.1f}% {tl:5.1f}%  {pi:6.1f}% {pl_:5.1f}%")
    lines += ["", "per (model, framework, TP) group, AIPerf harness and replay calibration "
              "(LOGO: fit without the group, score on it):", format_groups(table), "",
              f"out of sample (LOGO), the figure to quote: TTFT MAPE {total['ttft_logo']:.1f}%, TPOT MAPE "
              f"{total['tpot_logo']:.1f}% (in sample {total['ttft_in']:.1f}% / {total['tpot_in']:.1f}%)", "",
              *format_osl(osl, osl_split, GROUP_KEYS), "", "fitted entries (in sample):"]
    for e in entries:
        lines.append(f"  {e['model']:24} {e['framework']}/{e['gemm_dtype']} tp{e['tp']}: overhead "
                     f"{e['overhead_s'] * 1e3:.2f} ms, prefill x{e['prefill_scale']:.3f}, decode x{e['decode_scale']:.3f}, "
                     f"prompt steps +{e.get('prefill_step_s', 0.0) * 1e3:.1f} ms, communication "
                     f"x{e.get('comm_scale', 1.0):.3f}, server {json.dumps(e['measured_server'])}")
    lines += ["", *pinned_lines(entries)]
    lines += ["", "--- leave one group out, per (model, framework) ---", format_report(logo, worst=8)]
    text = "\n".join(lines)
    print(text)
    state_errors(entries, logo, "leave one (model, framework, TP) group out", command)
    args.out.mkdir(parents=True, exist_ok=True)
    save_calibration(entries, args.out / "fidelity_calibration.json")
    if args.install:
        install(entries, set(runs["model"].to_list()))
    (args.out / "fidelity.md").write_text(f"# Fidelity\n\nCommand: `{command}`\n\n```\n{text}\n```\n")
    (args.out / "fidelity.json").write_text(json.dumps({
        "command": command, "runs_file": path.name, "runs": len(runs),
        "summary": {name: {"in_sample": {"ttft_mape": a[0], "tpot_mape": a[1]},
                           "leave_one_group_out": {"ttft_mape": b[0], "tpot_mape": b[1]}}
                    for name, (a, b) in summary.items()},
        "groups": [r for r in table.iter_rows(named=True) if r["model"] != "all"],
        "ttft_osl_sensitivity": {"setups": osl.to_dicts(), **osl_split},
        "targets": {"tpot_logo_mape_max": 7.0, "ttft_logo_mape_max": 25.0,
                    "met": {"tpot": total["tpot_logo"] <= 7.0, "ttft": total["ttft_logo"] <= 25.0}},
    }, indent=1) + "\n")
    out = insample.join(logo.select("row", pl.col("pred_ttft_ms").alias("logo_ttft_ms"),
                                    pl.col("pred_tpot_ms").alias("logo_tpot_ms"),
                                    pl.col("calibration_match").alias("logo_match"), pl.col("error").alias("logo_error")),
                        on="row", how="left").sort("row")
    out.write_csv(args.out / "fidelity.csv")
    scatter_figure(logo).savefig(args.out / "fidelity_scatter.png", dpi=110)
    print(f"\noverall: in sample TTFT {total['ttft_in']:.1f}% / TPOT {total['tpot_in']:.1f}%; leave one group out "
          f"TTFT {total['ttft_logo']:.1f}% / TPOT {total['tpot_logo']:.1f}%; wrote {args.out / 'fidelity.md'}, "
          "fidelity.json, fidelity.csv, fidelity_scatter.png, fidelity_calibration.json")


class _Serial:
    """A stand-in pool running tasks in this process (``--jobs 1``)."""

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
