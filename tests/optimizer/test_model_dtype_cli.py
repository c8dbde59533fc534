"""Issue 15 item 6: every command takes a model by name or config.json, and weight/KV dtypes
that reach the cost model, the engine's defaults and the exported file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from costmodels import build
from optimizer.cli import app
from optimizer.outputs.exports import Deployment, ExportError, engine_yaml, read_engine_file
from optimizer.outputs.replay import file_replay
from optimizer.search.evaluate import Evaluator
from optimizer.search.spec import SpecError, load_spec
from optimizer.search.targets import engine_context
from policies.engines import preset, target
from studies.traces import Trace, write_trace

ROOT = Path(__file__).resolve().parents[2]
LLAMA_CONFIG = ROOT / "costmodels" / "data" / "models" / "meta-llama--Meta-Llama-3.1-8B_config.json"
runner = CliRunner()


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    rng = np.random.default_rng(2)
    trace = Trace.from_columns(np.cumsum(rng.exponential(0.2, 60)), rng.integers(100, 2000, 60),
                               rng.integers(10, 100, 60))
    return write_trace(trace, tmp_path_factory.mktemp("t") / "trace.csv")


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m") / "my-llama"
    folder.mkdir()
    return Path(shutil.copy(LLAMA_CONFIG, folder / "config.json"))


def test_simulate_takes_a_config_json_as_the_model(trace_file, config_json):
    out = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", str(config_json), "--gpu", "h100",
                              "--slo", "ttft:2000", "--format", "json"])
    assert out.exit_code == 0, out.output
    run = json.loads(out.output[out.output.index("{"):out.output.rindex("}") + 1])
    assert run["cost_model"] == "my-llama@h100x1/vllm/bf16"
    named = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "my-model", "--model-config",
                                str(config_json), "--gpu", "h100", "--slo", "ttft:2000", "--format", "json"])
    assert named.exit_code == 0, named.output
    missing = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "nowhere/config.json",
                                  "--gpu", "h100", "--slo", "ttft:2000"])
    assert missing.exit_code == 2 and "model config nowhere/config.json does not exist" in missing.output


def test_fp8_weights_and_kv_reach_the_cost_model_and_the_pool(trace_file):
    bf16, fp8 = (build("meta-llama/Llama-3.1-8B", "h100", gemm_dtype=d, kv_dtype=d) for d in ("bf16", "fp8"))
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token and fp8.weight_bytes < 0.6 * bf16.weight_bytes
    out = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "meta-llama/Llama-3.1-8B",
                              "--gpu", "h100", "--slo", "ttft:2000", "--dtype", "fp8", "--kv-dtype", "fp8",
                              "--format", "json"])
    assert out.exit_code == 0, out.output
    run = json.loads(out.output[out.output.index("{"):out.output.rindex("}") + 1])
    assert run["cost_model"].endswith("/fp8") and run["dtype"] == {"weights": "fp8", "kv": "fp8"}
    bad = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "meta-llama/Llama-3.1-8B",
                              "--gpu", "h100", "--slo", "ttft:2000", "--dtype", "int4"])
    assert bad.exit_code == 2 and "--dtype takes" in bad.output


@pytest.mark.parametrize("engine, weights, kv", [("vllm", "fp8_per_tensor", "fp8"), ("sglang", "fp8", "fp8_e4m3")])
def test_the_exported_file_runs_the_simulated_dtypes(engine, weights, kv):
    # vLLM 0.33: --quantization fp8_per_tensor (weight_utils.py:356-359), --kv-cache-dtype fp8 (config/cache.py
    # CacheDType); SGLang 0.5.23: --quantization fp8, --kv-cache-dtype fp8_e4m3; checked with engine-check
    fp8 = engine_context("meta-llama/Llama-3.1-8B", "h100", dtype="fp8", kv_dtype="fp8")
    bf16 = engine_context("meta-llama/Llama-3.1-8B", "h100")
    text = engine_yaml(target(engine), preset(f"{engine}-default", fp8), Deployment("meta-llama/Llama-3.1-8B"), fp8)
    args = yaml.safe_load(text)
    assert args["quantization"] == weights and args["kv-cache-dtype"] == kv
    assert read_engine_file(target(engine), text, fp8) == target(engine).resolve(preset(f"{engine}-default", fp8), fp8)
    with pytest.raises(ExportError, match="the study simulated"):
        read_engine_file(target(engine), text, bf16)  # the file would not run what was simulated
    plain = yaml.safe_load(engine_yaml(target(engine), preset(f"{engine}-default", bf16),
                                       Deployment("meta-llama/Llama-3.1-8B"), bf16))
    assert "quantization" not in plain and "kv-cache-dtype" not in plain


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_checkpoint_already_in_fp8_runs_its_own_quantization(engine):
    # DeepSeek-V3's checkpoint is FP8 (block scales): a --quantization naming another method is
    # refused (vllm/config/model.py:1452-1462, sglang srt/configs/model_config.py:2105-2148;
    # engine-check refused vLLM's fp8_per_tensor), so the file leaves the weights' flag out
    ctx = engine_context("deepseek-ai/DeepSeek-V3", "h200", 8, dtype="fp8", kv_dtype="fp8")
    assert ctx.weight_quant == "fp8_block"
    args = target(engine).to_args(preset(f"{engine}-default", ctx), Deployment("deepseek-ai/DeepSeek-V3", 8).engine, ctx)
    assert "quantization" not in args and args["kv-cache-dtype"] == {"vllm": "fp8", "sglang": "fp8_e4m3"}[engine]
    assert target(engine).from_args(args, ctx) == target(engine).resolve(preset(f"{engine}-default", ctx), ctx)


def test_a_study_carries_its_dtypes_to_the_file_it_writes(trace_file, tmp_path):
    spec = load_spec(trace=trace_file, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000", engine="vllm",
                     dtype="fp8", kv_dtype="fp8", run_dir=tmp_path / "run")
    evaluator = Evaluator(spec)
    assert evaluator.cost_model.name.endswith("/fp8") and spec.context.kv_dtype == "fp8"
    replay = file_replay(spec, evaluator.target, evaluator.baselines()["vllm-default"], spec.fleet)
    assert yaml.safe_load(replay.text)["kv-cache-dtype"] == "fp8"
    assert spec.to_dict()["deployment"]["dtype"] == "fp8"
    with pytest.raises(SpecError, match="kv_dtype must be one of"):
        load_spec(trace=trace_file, model="meta-llama/Llama-3.1-8B", gpu="h100", slo="ttft:2000", kv_dtype="int8")
