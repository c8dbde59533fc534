"""Fidelity on setups nobody measured: hold out a whole framework/dtype/GPU, or a whole model.

``benchmarks/fidelity.py`` scores each setup with the calibration fitted on every *other*
setup (leave one group out, LOGO): the held-out setup still finds its own model's entry
at another TP. A user's setup is often further away: another framework or GPU, or a model
nobody measured. This scores two harsher protocols on the same dev rows (the dense and the
breadth files together, so a fallback may cross files as the bundled calibration does):

- **leave (framework, dtype, GPU) out**: every row of one combination is held out and
  scored with the entries fitted on the other combinations' rows;
- **leave model out**: every row of one model is held out and scored with the entries
  fitted on the other models' rows (a pooled entry that held the model is refitted
  without it).

Each held-out setup gets what ``apply_calibration``'s fallback chain picks from what
remains (``costmodels.calibration.match_entry``: family, pooled, another GPU, another
path, else none), so the chain's fallbacks are what gets scored. Per tier (the match, or
"roofline") it prints TTFT and TPOT MAPE under each protocol, LOGO's included, and the table
``tune`` reads for its error band (``optimizer.robust.modelerror``): per tier, the runs
scored at that tier under any protocol, each run once. ``--install`` writes that table into
the bundled calibration (``tier_errors``), keeping its entries.

Beside them, a diagnostic: the harsher protocols again with each held-out setup replayed on
the measured server its own rows fitted (``own_server``), the step terms still as the chain
gives them. The runs files do not record the servers' launch settings (token budget,
running-request cap, prefill threshold); this says how much of the harsher error they carry.
It is not a protocol: those servers were fitted on the held-out rows.

Reads ``fidelity.csv``, ``fidelity_breadth.csv`` and their ``*_calibration.json`` (the
in-sample entries of ``fidelity.py --part dense`` and ``--part breadth``, fitted on each
file's every row) from ``--results``; the entries a fold keeps were fitted on rows of other
combinations or models only, so no held-out row reaches the entry that scores it. Writes
``fidelity_unseen.{md,json,csv}`` there.

    python benchmarks/fidelity_unseen.py [--results DIR] [--install]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity import BREADTH_KEYS, LOGO_KEYS, chain_entry, overall, replay_fitter  # noqa: E402

from costmodels import load_calibration, load_runs, save_calibration  # noqa: E402
from costmodels.calibration import (  # noqa: E402
    BUNDLED,
    MATCHES,
    MIN_TIER_RUNS,
    SKIP_MARGIN,
    entry_key,
    entry_models,
    load_tier_errors,
    losing_tiers,
    with_key_columns,
)
from costmodels.distil import aic_root, shared_dir  # noqa: E402
from costmodels.gpus import load_gpu  # noqa: E402
from optimizer.cli.validate import predict_runs  # noqa: E402
from optimizer.fidelity.closedloop import BenchClient  # noqa: E402
from optimizer.robust.modelerror import error_tier  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
#: The columns of a scored run that ``predict_runs`` reads.
RUN_COLUMNS = ["model", "gpu", "framework", "framework_version", "tp", "gemm_dtype", "kv_dtype", "batch_size", "isl",
               "osl", "ttft_ms", "tpot_ms", "client", "moe_ep_size", "attention_dp_size"]
#: The columns that identify a scored row in its runs file.
IDENTITY = ["model", "framework", "tp", "batch_size", "isl", "osl", "ttft_ms"]
#: (name, the columns one fold holds out)
PROTOCOLS = (("leave (framework, dtype, GPU) out", ["framework", "gemm_dtype", "gpu"]),
             ("leave model out", ["model"]))
LOGO = "leave one setup out (LOGO)"
#: Targets on the harsher protocols (issue 45): MAPE, %.
TARGETS = {"dense": {"ttft": 25.0, "tpot": 10.0}, "breadth": {"ttft": 30.0, "tpot": 15.0}}
#: Tiers in the order the chain walks them.
TIER_ORDER = (*MATCHES, "none", "roofline")


def load_part(results: Path, part: str) -> tuple[pl.DataFrame, list[dict]]:
    """(scored runs with their LOGO prediction and tier, in-sample entries) of one part."""
    stem = {"dense": "fidelity", "breadth": "fidelity_breadth"}[part]
    csv, calib = results / f"{stem}.csv", results / f"{stem}_calibration.json"
    if not (csv.is_file() and calib.is_file()):
        sys.exit(f"{csv.name} or {calib.name} not in {results}: run `python benchmarks/fidelity.py --part {part}` first")
    runs = pl.read_csv(csv, infer_schema_length=None).with_columns(pl.lit(part).alias("part"))
    return with_versions(runs, results / f"{stem}.json"), load_calibration(calib)


def with_versions(scored: pl.DataFrame, figures: Path) -> pl.DataFrame:
    """``scored`` with each run's framework version from the runs file it was scored from
    (``runs_file`` in ``figures``), joined on ``row``: the version picks the scheduler loop
    a vLLM run is replayed with (``replayfit.run_server``), as it did for LOGO; without
    it a vLLM 0.12 run would replay on the async loop it never ran."""
    name = json.loads(figures.read_text())["runs_file"]
    path = aic_root(shared_dir()) / "systems" / name
    if not path.is_file():
        sys.exit(f"{figures.name} was scored from {name}, which is not in {path.parent}")
    source = load_runs(path).with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    joined = scored.drop("framework_version", strict=False).join(
        source.select("row", *(pl.col(c).alias(f"_{c}") for c in IDENTITY), "framework_version"), on="row", how="left")
    moved = joined.filter(pl.any_horizontal(*(pl.col(c) != pl.col(f"_{c}") for c in IDENTITY))
                          | pl.col("_model").is_null())
    if len(moved):
        sys.exit(f"{figures.with_suffix('.csv').name} row {moved['row'][0]} is not row {moved['row'][0]} of {name}: "
                 f"rerun the part that wrote it")
    return joined.drop(*(f"_{c}" for c in IDENTITY))


def setup_keys(part: str) -> list[str]:
    return LOGO_KEYS if part == "dense" else BREADTH_KEYS


def without(entries: list[dict], held: pl.DataFrame, columns: list[str], runs: pl.DataFrame) -> tuple[list[dict], int]:
    """The entries no held-out row was fitted into, and how many pooled entries were refitted
    for it: an entry of a held-out combination or model is dropped; a pooled entry that held
    a held-out model beside others is refitted on the others' rows."""
    held_models = set(held["model"])
    held_combos = {(load_gpu(g).name, f, d) for g, f, d in held.select("gpu", "framework", "gemm_dtype").unique().rows()}
    kept, refits = [], 0
    for e in entries:
        if (e["gpu"], e["framework"], e["gemm_dtype"]) in held_combos and "gpu" in columns:
            continue
        fitted = set(entry_models(e, entries))
        if "model" in columns and fitted & held_models:
            rest = fitted - held_models
            if not rest:
                continue
            gpu, framework, _, dtype, path = entry_key(e)
            train = with_key_columns(runs).filter(pl.col("model").is_in(sorted(rest)), pl.col("framework") == framework,
                                                  pl.col("gemm_dtype") == dtype, pl.col("_gpu") == gpu,
                                                  pl.col("_path") == path)
            kept += replay_fitter(train.select(RUN_COLUMNS), keys=[entry_key(e)], bench=BenchClient())
            refits += 1
            continue
        kept.append(e)
    return kept, refits


def own_server(run: dict, own: list[dict]) -> dict | None:
    """The measured server the setup of ``run`` fitted on its own rows (its entry among the
    in-sample ``own``), None when it has none."""
    entry = chain_entry(run, own)
    mine = entry is not None and (entry["model"], entry["gpu"], entry["framework"], entry["gemm_dtype"]) == (
        run["model"], load_gpu(run["gpu"]).name, run["framework"], run["gemm_dtype"])
    return entry.get("measured_server") if mine else None


def score_fold(held: pl.DataFrame, entries: list[dict], tmp: Path, own: list[dict] | None = None) -> pl.DataFrame:
    """``held`` replayed as ``servetune validate`` would with ``entries`` as the calibration:
    each setup with the entry the chain gives it, or uncalibrated when none matches. With
    ``own`` (the in-sample entries), each setup's server is the one its own rows fitted."""
    path = tmp / "fold.json"
    save_calibration(entries, path)
    parts = []
    for _, rows in held.group_by(setup_keys(held["part"][0]), maintain_order=True):
        first = rows.row(0, named=True)
        matched = chain_entry(first, entries) is not None
        server = None if own is None else own_server(first, own)
        pred = predict_runs(rows.select(RUN_COLUMNS), calibration=path if matched else False, server=server)
        parts.append(rows.select("part", "row", "layout").hstack(pred.select(
            "model", "gpu", "framework", "gemm_dtype", "tp", "ttft_ms", "tpot_ms", "pred_ttft_ms", "pred_tpot_ms",
            pl.col("calibration_match").replace("off", "none"), "cost_source", "error")))
    return pl.concat(parts)


def run_protocol(runs: pl.DataFrame, entries: list[dict], columns: list[str],
                 own_servers: bool = False) -> tuple[pl.DataFrame, int]:
    """Every fold of one protocol: (held-out predictions, pooled entries refitted). With
    ``own_servers``, each held-out setup replays on the server its own rows fitted."""
    parts, refits = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for _, held in runs.group_by(columns, maintain_order=True):
            kept, n = without(entries, held, columns, runs)
            refits += n
            for _, part in held.group_by("part", maintain_order=True):
                parts.append(score_fold(part, kept, Path(tmp), own=entries if own_servers else None))
    return pl.concat(parts), refits


#: Tiers whose entry is lent from another model, GPU or path: each is scored against no entry on the same runs.
LENT = MATCHES[MATCHES.index("family"):]


def against_none(pred: pl.DataFrame, runs: pl.DataFrame) -> pl.DataFrame:
    """For every run some protocol scored at a lent tier (``LENT``), the same run replayed
    with no entry: (part, row, none_ttft_ms, none_tpot_ms). "No entry" is a candidate at
    every step of the chain, so each lent tier is judged against it run for run."""
    lent = pred.filter(pl.col("tier").is_in(LENT)).select("part", "row").unique()
    held = runs.join(lent, on=["part", "row"], how="semi")
    parts = []
    for (part,), rows in held.group_by("part", maintain_order=True):
        for _, setup in rows.group_by(setup_keys(part), maintain_order=True):
            none = predict_runs(setup.select(RUN_COLUMNS), calibration=False)
            parts.append(setup.select("part", "row").hstack(none.select(
                pl.col("pred_ttft_ms").alias("none_ttft_ms"), pl.col("pred_tpot_ms").alias("none_tpot_ms"))))
    schema = {"part": pl.Utf8, "row": pl.Int64, "none_ttft_ms": pl.Float64, "none_tpot_ms": pl.Float64}
    return pl.concat(parts) if parts else pl.DataFrame(schema=schema)


def logo_predictions(runs: pl.DataFrame) -> pl.DataFrame:
    """The LOGO predictions ``fidelity.py`` wrote, in ``score_fold``'s columns."""
    return runs.select("part", "row", "layout", "model", "gpu", "framework", "gemm_dtype", "tp", "ttft_ms", "tpot_ms",
                       pl.col("logo_ttft_ms").alias("pred_ttft_ms"), pl.col("logo_tpot_ms").alias("pred_tpot_ms"),
                       pl.col("logo_match").alias("calibration_match"), "cost_source",
                       pl.col("logo_error").alias("error"))


def with_tier(pred: pl.DataFrame) -> pl.DataFrame:
    return pred.with_columns(pl.struct("calibration_match", "cost_source").map_elements(
        lambda r: error_tier(r["calibration_match"] or "none", r["cost_source"] or ""), return_dtype=pl.Utf8
    ).alias("tier"))


def figures(pred: pl.DataFrame) -> dict:
    """Runs, setups and MAPE of the scored rows of ``pred``."""
    ok = pred.filter(pl.col("error").is_null())
    ttft, tpot = overall(pred) if ok.height else (None, None)
    setups = ok.select("part", "model", "gpu", "framework", "gemm_dtype", "layout").unique().height
    return {"runs": ok.height, "setups": setups, "failed": pred.height - ok.height, "ttft_mape": ttft, "tpot_mape": tpot}


def tier_table(pred: pl.DataFrame) -> dict[str, dict]:
    """Per tier, ``figures`` of the runs scored at it, each run once (first protocol kept);
    a lent tier also with the MAPE of the same runs replayed with no entry (``none_*``)."""
    once = pred.unique(["part", "row", "tier"], keep="first", maintain_order=True)
    table = {}
    for t in TIER_ORDER:
        rows = once.filter(pl.col("tier") == t)
        if rows.height == 0:
            continue
        table[t] = figures(rows)
        if t in LENT:
            table[t] = _figures_with_none(rows)
    return table


def decided_apart(pred: pl.DataFrame) -> list[str]:
    """The skip rule scored on setups it was not decided on: for each setup scored at a lent
    tier, whether the tier is skipped is decided (``losing_tiers``) on the other setups'
    runs only, and the setup is scored as that decision serves it. Lines for the report."""
    once = pred.filter(pl.col("tier").is_in(LENT), pl.col("error").is_null()).unique(
        ["part", "row", "tier"], keep="first", maintain_order=True)
    setup = ["part", "model", "gpu", "framework", "gemm_dtype", "layout"]
    lines = ["the skip rule decided without the setup it serves (leave one setup out), per lent tier:"]
    for (tier,), rows in once.group_by("tier", maintain_order=True):
        served = []
        for _, held in rows.group_by(setup, maintain_order=True):
            rest = rows.join(held.select(setup).unique(), on=setup, how="anti")
            skip = tier in losing_tiers({"tiers": {tier: _figures_with_none(rest)}}) if rest.height else False
            served.append(held.with_columns(*(pl.col(f"none_{m}_ms" if skip else f"pred_{m}_ms").alias(f"served_{m}")
                                              for m in ("ttft", "tpot"))))
        both = pl.concat(served)
        f = {name: overall(both.select(pl.col(a).alias("pred_ttft_ms"), pl.col(b).alias("pred_tpot_ms"), "ttft_ms",
                                        "tpot_ms", "error"))
             for name, a, b in (("chain", "pred_ttft_ms", "pred_tpot_ms"), ("no entry", "none_ttft_ms", "none_tpot_ms"),
                                ("decided apart", "served_ttft", "served_tpot"))}
        lines.append(f"  {tier:10s} {both.height:4d} runs: " + ", ".join(
            f"{name} TTFT {pct(t)} TPOT {pct(q)}" for name, (t, q) in f.items()))
    return lines if len(lines) > 1 else lines + ["  no run was scored at a lent tier"]


def _figures_with_none(rows: pl.DataFrame) -> dict:
    """``figures`` of ``rows`` with the same runs' no-entry MAPE (``none_*``)."""
    none = rows.select(pl.col("none_ttft_ms").alias("pred_ttft_ms"), pl.col("none_tpot_ms").alias("pred_tpot_ms"),
                       "ttft_ms", "tpot_ms", "error")
    return figures(rows) | dict(zip(("none_ttft_mape", "none_tpot_mape"), overall(none), strict=True))


def tier_table_lines(stored: dict) -> list[str]:
    """The per-tier table ``tune`` reads (``load_tier_errors``), with the tiers the chain skips."""
    skipped = losing_tiers(stored)
    lines = [f"the table tune reads (each run once per tier over the three protocols; a tier with fewer than "
             f"{MIN_TIER_RUNS} runs is not read; the chain skips a tier whose runs did better with no entry by more "
             f"than {SKIP_MARGIN:.0%}: {sorted(skipped) or 'none'}):"]
    for tier, f in stored["tiers"].items():
        none = (f"; the same runs with no entry: TTFT {pct(f['none_ttft_mape'])}  TPOT {pct(f['none_tpot_mape'])}"
                if "none_ttft_mape" in f else "")
        lines.append(f"  {tier:12s} TTFT {pct(f['ttft_mape'])}  TPOT {pct(f['tpot_mape'])}  over {f['runs']} runs of "
                     f"{f['setups']} setups{none}" + ("  (skipped)" if tier in skipped else ""))
    return lines


def pct(v) -> str:
    return "    -" if v is None else f"{v:5.1f}%"


def report(pred: pl.DataFrame, served: pl.DataFrame, skipped: set[str], refits: dict[str, int], stored: dict,
           elapsed: float, known: pl.DataFrame) -> str:
    """The protocols side by side (as the chain serves them now, and as it walked before any
    tier was skipped), the per-tier table and the held-out setups one by one."""
    lines = [f"{pred.filter(pl.col('protocol') == LOGO).height} dev runs (dense and breadth files) under three "
             f"protocols in {elapsed:.0f} s; pooled entries refitted without a held-out model: "
             + ", ".join(f"{k} {v}" for k, v in refits.items()),
             f"tiers the chain now skips (no entry did better on their held-out runs): {sorted(skipped) or 'none'}", "",
             "protocol                               part      runs  failed   TTFT    TPOT   (walked: TTFT  TPOT)"
             "  target (TTFT / TPOT)"]
    for ((protocol, part), rows), (_, now) in zip(pred.group_by("protocol", "part", maintain_order=True),
                                                  served.group_by("protocol", "part", maintain_order=True), strict=True):
        f, w = figures(now), figures(rows)
        target = "" if protocol == LOGO else "{ttft:.0f}% / {tpot:.0f}%".format(**TARGETS[part])
        met = "" if protocol == LOGO else ("  met" if f["ttft_mape"] <= TARGETS[part]["ttft"]
                                           and f["tpot_mape"] <= TARGETS[part]["tpot"] else "  NOT met")
        lines.append(f"{protocol:38s} {part:8s} {f['runs']:5d}  {f['failed']:6d}  {pct(f['ttft_mape'])}  "
                     f"{pct(f['tpot_mape'])}   ({pct(w['ttft_mape'])} {pct(w['tpot_mape'])})  {target}{met}")
    lines += ["", "the harsher protocols again, each held-out setup on the server its own rows fitted (what its "
              "launch settings,", "which the files do not record, would give; a diagnostic, not a protocol: those "
              "servers saw the held-out rows):"]
    for (protocol, part), rows in known.group_by("protocol", "part", maintain_order=True):
        f = figures(rows)
        lines.append(f"{protocol:38s} {part:8s} {f['runs']:5d}  {f['failed']:6d}  {pct(f['ttft_mape'])}  "
                     f"{pct(f['tpot_mape'])}")
    lines += ["", "per tier (the entry the chain, walking every tier, gave a held-out setup), TTFT / TPOT MAPE and runs:",
              f"{'tier':12s}" + "".join(f"{p[:30]:>32s}" for p in (LOGO, *(n for n, _ in PROTOCOLS)))]
    by_protocol = {p: tier_table(rows) for (p,), rows in pred.group_by("protocol", maintain_order=True)}
    for tier in TIER_ORDER:
        cells = []
        for p in (LOGO, *(n for n, _ in PROTOCOLS)):
            f = by_protocol.get(p, {}).get(tier)
            cells.append(f"{pct(f['ttft_mape'])} / {pct(f['tpot_mape'])} ({f['runs']:3d})" if f else "-")
        lines.append(f"{tier:12s}" + "".join(f"{c:>32s}" for c in cells))
    roofline = pred.filter(pl.col("cost_source").str.contains("roofline") & ~pl.col("cost_source").str.contains(
        "profiled")).height
    substituted = pred.filter(pl.col("cost_source").str.contains("unmeasured")).height
    lines += ["", f"predictions on roofline step times: {roofline}; on a substituted attention kernel: {substituted}",
              "", *tier_table_lines(stored)]
    lines += ["", *decided_apart(pred)]
    worst = (pred.filter(pl.col("protocol") != LOGO, pl.col("error").is_null())
             .group_by("protocol", "model", "gpu", "framework", "gemm_dtype", "tier", maintain_order=True)
             .agg(pl.len().alias("runs"),
                  ((pl.col("pred_ttft_ms") / pl.col("ttft_ms") - 1).abs().mean() * 100).alias("ttft"),
                  ((pl.col("pred_tpot_ms") / pl.col("tpot_ms") - 1).abs().mean() * 100).alias("tpot")))
    lines += ["", "per held-out model and combination (harsher protocols):"]
    for r in worst.iter_rows(named=True):
        lines.append(f"  {r['protocol'][:24]:24s} {r['model'].split('/')[-1]:22s} {r['gpu']:9s} {r['framework']}/"
                     f"{r['gemm_dtype']:6s} {r['tier']:10s} {r['runs']:4d} runs  TTFT {r['ttft']:5.1f}%  "
                     f"TPOT {r['tpot']:5.1f}%")
    failures = pred.filter(pl.col("error").is_not_null()).unique(["protocol", "error"]).head(10)
    lines += ["", "failed predictions (first 10):"]
    lines += [f"  {r['protocol']}: {r['error']}" for r in failures.iter_rows(named=True)] or ["  none"]
    return "\n".join(lines)


def unseen(results: Path) -> tuple[str, dict, pl.DataFrame]:
    """The three protocols on the dev rows: (report, figures incl. the stored tier table, predictions)."""
    t0 = time.perf_counter()
    parts = [load_part(results, p) for p in ("dense", "breadth")]
    runs = pl.concat([r for r, _ in parts], how="diagonal_relaxed")
    entries = [e for _, es in parts for e in es]
    keys = [entry_key(e) for e in entries]
    if len(set(keys)) != len(keys):
        sys.exit("the dense and breadth fits share an entry key; this protocol cannot tell which rows fitted it")
    runs = runs.with_columns(pl.col("layout").fill_null(
        pl.format("tp{}", pl.col("tp"))))  # the dense file has no layout column: plain TP
    preds, refits = [with_tier(logo_predictions(runs)).with_columns(pl.lit(LOGO).alias("protocol"))], {}
    for name, columns in PROTOCOLS:
        pred, refits[name] = run_protocol(runs, entries, columns)
        preds.append(with_tier(pred).with_columns(pl.lit(name).alias("protocol")))
    pred = pl.concat(preds, how="diagonal_relaxed")
    pred = pred.join(against_none(pred, runs), on=["part", "row"], how="left")
    known = pl.concat([run_protocol(runs, entries, columns, own_servers=True)[0].with_columns(
        pl.lit(name).alias("protocol")) for name, columns in PROTOCOLS], how="diagonal_relaxed")
    command = "python benchmarks/fidelity_unseen.py"
    stored = {"method": "held-out runs per tier: leave one setup out, leave (framework, dtype, GPU) out, leave model "
                        "out; each run once per tier", "command": command,
              "tiers": {t: f for t, f in tier_table(pred).items() if f["runs"] and f["ttft_mape"] is not None}}
    skipped = losing_tiers(stored)
    served = pred.with_columns(  # what the chain gives now that it skips the tiers no entry beat
        *(pl.when(pl.col("tier").is_in(sorted(skipped))).then(pl.col(f"none_{m}_ms")).otherwise(pl.col(f"pred_{m}_ms"))
          .alias(f"pred_{m}_ms") for m in ("ttft", "tpot")),
        pl.when(pl.col("tier").is_in(sorted(skipped))).then(pl.lit("none")).otherwise(pl.col("tier")).alias("tier"))
    text = report(pred, served, skipped, refits, stored, time.perf_counter() - t0, known)
    out = {"command": command, "tier_errors": stored, "refits": refits,
           "skipped_tiers": sorted(skipped),
           "protocols": {f"{p} | {part}": {"chain as walked": figures(rows), "as served": figures(now)}
                         for ((p, part), rows), (_, now) in zip(pred.group_by("protocol", "part", maintain_order=True),
                                                                served.group_by("protocol", "part", maintain_order=True),
                                                                strict=True)},
           "targets": TARGETS,
           "own_servers": {f"{p} | {part}": figures(rows)
                           for (p, part), rows in known.group_by("protocol", "part", maintain_order=True)}}
    return text, out, pred


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="where fidelity.py wrote its results")
    parser.add_argument("--install", action="store_true",
                        help="write the per-tier table into the bundled calibration (its entries kept)")
    args = parser.parse_args(argv)
    text, out, pred = unseen(args.results)
    print(text)
    (args.results / "fidelity_unseen.md").write_text(
        f"# Fidelity on unseen setups\n\nCommand: `{out['command']}`\n\n```\n{text}\n```\n")
    (args.results / "fidelity_unseen.json").write_text(json.dumps(out, indent=1) + "\n")
    pred.drop("cost_source").write_csv(args.results / "fidelity_unseen.csv")
    if args.install:
        save_calibration(load_calibration(BUNDLED), BUNDLED, tier_errors=out["tier_errors"])
        assert load_tier_errors(BUNDLED) == out["tier_errors"]


if __name__ == "__main__":
    main()
