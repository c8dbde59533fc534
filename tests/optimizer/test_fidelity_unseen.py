"""The harsher fidelity protocols (benchmarks/fidelity_unseen.py): no held-out row reaches an
entry that scores it, and a pool that held the model is refitted without it."""

import importlib.util
import sys
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports fidelity.py beside it
_spec = importlib.util.spec_from_file_location("fidelity_unseen_bench", ROOT / "benchmarks" / "fidelity_unseen.py")
unseen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(unseen)

LLAMA8, LLAMA70, QWEN = "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-32B"


def entry(model, gpu="h100_sxm", framework="trtllm", dtype="bf16", models=None):
    return {"model": model, "gpu": gpu, "framework": framework, "gemm_dtype": dtype, "tp": [1], "overhead_s": 1e-3,
            "scale": 1.0, **({"models": models} if models else {})}


def runs(*rows):
    cols = ["model", "gpu", "framework", "gemm_dtype", "tp", "moe_ep_size", "attention_dp_size"]
    base = pl.DataFrame([(*r, 1, 1) for r in rows], schema=cols[:5] + cols[5:], orient="row")
    extra = {"framework_version": "1.0.0rc3", "kv_dtype": "bf16", "batch_size": 8, "isl": 1024, "osl": 64, "ttft_ms": 100.0, "tpot_ms": 10.0,
             "client": "aiperf"}
    return base.with_columns(pl.lit(v).alias(k) for k, v in extra.items()).select(unseen.RUN_COLUMNS)


ENTRIES = [entry(LLAMA8), entry(QWEN), entry("*", models=[LLAMA8, QWEN]),
           entry(LLAMA8, framework="vllm"), entry("*", framework="vllm", models=[LLAMA8]),
           entry(LLAMA70, gpu="b200_sxm", dtype="fp8")]
ALL = runs((LLAMA8, "h100_sxm", "trtllm", "bf16", 1), (QWEN, "h100_sxm", "trtllm", "bf16", 1),
           (LLAMA8, "h100_sxm", "vllm", "bf16", 1), (LLAMA70, "b200_sxm", "trtllm", "fp8", 1))


def test_leaving_a_combination_out_drops_every_entry_fitted_on_it():
    held = ALL.filter(pl.col("framework") == "trtllm", pl.col("gpu") == "h100_sxm")
    kept, refits = unseen.without(ENTRIES, held, ["framework", "gemm_dtype", "gpu"], ALL)
    assert refits == 0
    assert [(e["model"], e["framework"], e["gpu"]) for e in kept] == [
        (LLAMA8, "vllm", "h100_sxm"), ("*", "vllm", "h100_sxm"), (LLAMA70, "trtllm", "b200_sxm")]


def test_leaving_a_model_out_refits_a_pool_that_held_it_beside_others(monkeypatch):
    fitted = []

    def fake_fit(train, keys=None, bench=None):
        fitted.append((train, keys))
        return [entry("*", models=sorted(set(train["model"])))]

    monkeypatch.setattr(unseen, "replay_fitter", fake_fit)
    held = ALL.filter(pl.col("model") == LLAMA8)
    kept, refits = unseen.without(ENTRIES, held, ["model"], ALL)
    # the trtllm pool held Llama-8B and Qwen: refitted on Qwen's rows alone; the vLLM pool held only Llama-8B
    assert refits == 1 and len(fitted) == 1
    train, keys = fitted[0]
    assert set(train["model"]) == {QWEN} and keys == [("h100_sxm", "trtllm", "*", "bf16", "tp")]
    assert all(LLAMA8 not in unseen.entry_models(e, kept) for e in kept)
    assert [(e["model"], e["framework"]) for e in kept] == [(QWEN, "trtllm"), ("*", "trtllm"), (LLAMA70, "trtllm")]


def test_each_scored_run_gets_the_framework_version_of_its_row_in_the_runs_file(tmp_path):
    """The version picks the loop a vLLM run replays on: fidelity.csv holds none, so the
    harsher protocols replayed vLLM 0.12 runs on the async loop until they joined it."""
    import json

    import pytest

    from costmodels import load_runs
    from costmodels.distil import aic_root, shared_dir

    path = aic_root(shared_dir()) / "systems" / "silicon_dense_h100.csv"
    if not path.is_file():
        pytest.skip(f"{path} not found (set SERVETUNE_SHARED)")
    source = load_runs(path).with_row_index("row").with_columns(pl.col("row").cast(pl.Int64))
    vllm = source.filter(pl.col("framework") == "vllm").head(2)
    scored = pl.concat([source.head(2), vllm]).drop("framework_version")
    figures = tmp_path / "fidelity.json"
    figures.write_text(json.dumps({"runs_file": path.name}))
    got = unseen.with_versions(scored, figures)
    assert got["framework_version"].to_list() == [*source.head(2)["framework_version"], "0.12.0", "0.12.0"]
    moved = scored.with_columns(pl.when(pl.col("row") == vllm["row"][0]).then(1.0).otherwise(pl.col("ttft_ms"))
                                .alias("ttft_ms"))
    with pytest.raises(SystemExit, match=f"row {vllm['row'][0]} is not row"):
        unseen.with_versions(moved, figures)


def test_the_diagnostic_server_is_the_setups_own_never_a_lent_entrys():
    """``own_server``: the launch settings a setup's own rows fitted, or none; a pooled or
    other-GPU entry the chain would lend it is not its server."""
    mine = entry(LLAMA8) | {"measured_server": {"max_num_batched_tokens": 4096}}
    pooled = entry("*", models=[LLAMA8, QWEN]) | {"measured_server": {"max_num_batched_tokens": 2048}}
    other_gpu = entry(LLAMA70, gpu="b200_sxm", dtype="fp8") | {"measured_server": {"max_num_batched_tokens": 8192}}
    llama, qwen, llama70 = (r for r in ALL.filter(pl.col("framework") == "trtllm").iter_rows(named=True))
    assert unseen.own_server(llama, [pooled, mine, other_gpu]) == {"max_num_batched_tokens": 4096}
    assert unseen.own_server(qwen, [pooled, mine, other_gpu]) is None
    assert unseen.own_server(llama70 | {"gpu": "h100_sxm"}, [pooled, other_gpu]) is None
    assert unseen.own_server(llama70, [mine, other_gpu]) == {"max_num_batched_tokens": 8192}
