"""`servetune simulate` end to end, and the timeline plot it writes.

The CLI runs on a small native trace written into tmp_path, so it needs nothing from
../shared. Its JSON report must equal scoring the same simulation directly.
"""

import dataclasses
import json

import matplotlib
import numpy as np
import pytest
from typer.testing import CliRunner

from optimizer.cli import app
from optimizer.outputs.timeline import save_timeline, timeline_figure
from policies.result import SimResult, State
from studies.traces import Trace, write_trace

runner = CliRunner()


# -- timeline ------------------------------------------------------------------------------


def series_result(t, kv, running, waiting, capacity=200) -> SimResult:
    n = 1
    return SimResult(
        state=np.full(n, State.FINISHED, np.int8), reject_reason=np.zeros(n, np.int8),
        first_token_s=np.ones(n), finish_s=np.full(n, 2.0), tokens_generated=np.full(n, 3),
        preemptions=np.zeros(n, np.int32), cached_prompt_tokens=np.zeros(n, np.int64),
        queue_s=np.zeros(n), replica=np.zeros(n, np.int32), steps=3, busy_s=1.0,
        prefill_tokens_computed=10, out_of_range_steps=0, kv_capacity_blocks=capacity,
        kv_peak_blocks=int(max(kv, default=0)), series_t=np.asarray(t, float),
        series_kv_blocks=np.asarray(kv), series_running=np.asarray(running),
        series_waiting=np.asarray(waiting),
    )


def test_timeline_panels_hold_the_series():
    result = series_result([0.0, 1.0, 2.5], [50, 200, 100], [1, 4, 2], [3, 0, 1])
    fig = timeline_figure(result, title="run")
    kv_ax, running_ax, waiting_ax = fig.axes
    kv_line, running_line, waiting_line = (ax.get_lines()[0] for ax in fig.axes)
    assert kv_line.get_ydata().tolist() == [25.0, 100.0, 50.0]  # percent of 200 blocks
    assert running_line.get_ydata().tolist() == [1, 4, 2]
    assert waiting_line.get_ydata().tolist() == [3, 0, 1]
    assert waiting_line.get_xdata().tolist() == [0.0, 1.0, 2.5]
    assert waiting_line.get_drawstyle() == "steps-post"  # held until the next sample
    assert "200 blocks" in kv_ax.get_ylabel() and fig.get_suptitle() == "run"


def test_timeline_writes_png_without_touching_the_backend(tmp_path):
    backend = matplotlib.get_backend()
    path = save_timeline(series_result([0.0, 1.0], [1, 2], [1, 1], [0, 0]), tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.get_backend() == backend
    empty = save_timeline(series_result([], [], [], []), tmp_path / "empty.png")
    assert empty.stat().st_size > 0


def test_timeline_rejects_ragged_series():
    with pytest.raises(ValueError, match="series_running has 1 samples but series_t has 2"):
        timeline_figure(series_result([0.0, 1.0], [1, 2], [1], [0, 0]))


# -- the command ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """80 requests at ~4 req/s in two SLO classes and two tenants."""
    rng = np.random.default_rng(7)
    n = 80
    trace = Trace.from_columns(
        np.cumsum(rng.exponential(0.25, n)), rng.integers(50, 1500, n), rng.integers(1, 300, n),
        tenant=np.arange(n) % 2, slo_class=(np.arange(n) // 3) % 2,
        tenant_names=("alice", "bob"), slo_class_names=("default", "batch"),
    )
    return write_trace(trace, tmp_path_factory.mktemp("trace") / "small.csv")


BASE = ["simulate", "--model", "llama-3.1-8b", "--gpu", "h100"]


def invoke(*args):
    return runner.invoke(app, [*BASE, *args])


def test_json_report_equals_scoring_the_same_run(trace_file):
    from costmodels import build
    from optimizer.search.targets import engine_context
    from policies.engine import simulate
    from policies.engines import preset
    from studies.lengths import Predictor, with_client_caps
    from studies.metrics import score
    from studies.slo import parse_slo
    from studies.traces import load_trace

    out = invoke("--trace", str(trace_file), "--slo", "ttft:2000,tpot:100", "--format", "json", "--seed", "3")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    ctx = engine_context("llama-3.1-8b", "h100")
    # the file has no caps: clients get the engine's default, the model's context less the prompt
    trace = Predictor().apply(with_client_caps(load_trace(trace_file), context_len=ctx.context_len), seed=3)
    assert ctx.context_len == 131072 and trace.max_tokens[0] == 131072 - trace.prompt_tokens[0]
    result = simulate(trace, build("llama-3.1-8b", "h100"), preset("vllm-default", ctx), seed=3)
    expected = score(result, trace, parse_slo("ttft:2000,tpot:100")).to_dict()
    assert data["report"] == json.loads(json.dumps(expected))
    assert data["config"] == preset("vllm-default", ctx).to_dict()
    assert data["config_source"] == "vllm-default (h100)" and data["requests"] == 80
    assert data["report"]["n_offered"] == 80 and set(data["report"]["per_tenant"]) == {"alice", "bob"}


def test_table_shows_key_figures_and_cost_model_source(trace_file):
    out = invoke("--trace", str(trace_file), "--slo", "ttft:2000,tpot:100")
    assert out.exit_code == 0, out.output
    for label in ("request goodput", "SLO attainment", "TTFT", "TPOT", "E2EL", "QUEUE", "KV high-water",
                  "preemptions", "reject reasons", "cost model:", "vllm-default (h100)", "per tenant",
                  "per SLO class"):
        assert label in out.stdout, label


def test_overrides_and_config_file(trace_file, tmp_path):
    # vLLM's default max_model_len is the model's context (131072): without chunked prefill the
    # token budget must cover it, as vLLM requires, so a shorter max_model_len goes with it
    refused = invoke("--trace", str(trace_file), "--set", "enable_chunked_prefill=false", "--format", "json")
    assert refused.exit_code == 2 and "max_model_len=131072" in refused.output
    out = invoke("--trace", str(trace_file), "--set", "max_num_seqs=4", "--set", "admission_mode=reservation",
                 "--set", "enable_chunked_prefill=false", "--set", "max_model_len=4096", "--format", "json")
    assert out.exit_code == 0, out.output
    config = json.loads(out.stdout)["config"]
    assert (config["max_num_seqs"], config["admission_mode"], config["enable_chunked_prefill"],
            config["max_model_len"]) == (4, "reservation", False, 4096)
    policy = tmp_path / "policy.toml"
    policy.write_text("[policy]\nmax_num_batched_tokens = 2048\nscheduling_policy = \"priority\"\n")
    data = json.loads(invoke("--trace", str(trace_file), "--config", str(policy), "--format", "json").stdout)
    assert data["config"]["max_num_batched_tokens"] == 2048 and data["config_source"] == str(policy)
    sglang = json.loads(invoke("--trace", str(trace_file), "--preset", "sglang-default", "--format", "json").stdout)
    assert sglang["config"]["schedule_mode"] == "prefill_first"


def test_rate_scale_compresses_arrivals_and_raises_load(trace_file):
    slow, fast = (json.loads(invoke("--trace", str(trace_file), "--rate-scale", x, "--format", "json").stdout)
                  for x in ("1", "4"))
    assert fast["rate_scale"] == 4.0
    assert fast["report"]["offered_rps"] > 2 * slow["report"]["offered_rps"]


def test_timeline_option_writes_png(trace_file, tmp_path):
    png = tmp_path / "timeline.png"
    out = invoke("--trace", str(trace_file), "--timeline", str(png))
    assert out.exit_code == 0, out.output
    assert png.read_bytes()[:4] == b"\x89PNG" and "timeline written" in out.stdout


def test_out_of_range_steps_warn_visibly(trace_file, monkeypatch):
    import policies.engine

    real = policies.engine.simulate
    monkeypatch.setattr(policies.engine, "simulate",
                        lambda *a, **k: dataclasses.replace(real(*a, **k), out_of_range_steps=7))
    table = invoke("--trace", str(trace_file))
    assert table.exit_code == 0 and "warning:" in table.stdout and "7 steps" in table.stdout
    as_json = invoke("--trace", str(trace_file), "--format", "json")
    assert "7 steps" in as_json.stderr and json.loads(as_json.stdout)["report"]["out_of_range_steps"] == 7


@pytest.mark.parametrize(
    "args, message",
    [(["--slo", "ttft=5"], "expected KEY:MS"),
     (["--set", "max_num_seqs"], "expected KNOB=VALUE"),
     (["--set", "max_num_seqz=4"], "unknown knob"),
     (["--set", "max_num_seqs=0"], "max_num_seqs must be in"),
     (["--preset", "tgi-default"], "unknown preset"),
     (["--preset", "vllm-default", "--config", "x.toml"], "not both"),
     (["--config", "missing.toml"], "no such file"),
     (["--slo-file", "missing.toml"], "no such file"),
     (["--rate-scale", "0"], "rate factor 0.0"),
     (["--format", "yaml"], "--format must be table or json"),
     (["--framework", "tgi"], "unknown framework"),
     (["--timeline", "/nonexistent/dir/t.png"], "does not exist")],
)
def test_bad_input_is_one_line_and_exit_2(trace_file, args, message):
    out = invoke("--trace", str(trace_file), *args)
    assert out.exit_code == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.output


def test_bad_trace_model_and_config_file_exit_2(trace_file, tmp_path):
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[policy\n")
    cases = [
        (runner.invoke(app, ["simulate", "--trace", str(tmp_path / "none.csv"), "--model", "llama-3.1-8b",
                             "--gpu", "h100"]), "none.csv"),
        (invoke("--trace", str(trace_file), "--config", str(bad_toml)), "not valid TOML"),
        (runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "no-such-model",
                             "--gpu", "h100"]), "no-such-model"),
    ]
    for out, message in cases:
        assert out.exit_code == 2, out.output
        assert message in out.stderr and "Traceback" not in out.output


def test_slo_file_classes_with_default_from_flag(trace_file, tmp_path):
    slo_file = tmp_path / "slo.toml"
    slo_file.write_text("[slo.batch]\ne2el = 600000\nweight = 0.5\n")
    out = invoke("--trace", str(trace_file), "--slo-file", str(slo_file), "--slo", "ttft:2000", "--format", "json")
    assert out.exit_code == 0, out.output
    per_class = json.loads(out.stdout)["report"]["per_class"]
    assert per_class["batch"]["slo"] == "e2el:600000" and per_class["default"]["slo"] == "ttft:2000"
    clash = tmp_path / "clash.toml"
    clash.write_text("[slo.default]\nttft = 1\n")
    out = invoke("--trace", str(trace_file), "--slo-file", str(clash), "--slo", "ttft:2000")
    assert out.exit_code == 2 and "drop one" in out.stderr


def test_an_engine_file_runs_on_its_engines_tables_and_replicas_as_tune_ran_it(trace_file, tmp_path):
    """An SGLang file was timed with vLLM's op tables unless --framework was added, and an
    exported file's replica count was ignored (issue 47): both now come from the file."""
    sglang = tmp_path / "sglang.yaml"
    sglang.write_text("model-path: meta-llama/Llama-3.1-8B\ntp-size: 1\ndp-size: 2\n")
    out = invoke("--trace", str(trace_file), "--config", str(sglang), "--format", "json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["framework"] == "sglang" and "sglang" in data["cost_model_source"] and data["replicas"] == 2
    assert data["report"]["per_replica"] and len(data["report"]["per_replica"]) == 2
    preset = json.loads(invoke("--trace", str(trace_file), "--preset", "sglang-default", "--format", "json").stdout)
    assert preset["framework"] == "sglang" and preset["replicas"] == 1
    forced = invoke("--trace", str(trace_file), "--config", str(sglang), "--framework", "vllm", "--replicas", "1",
                    "--format", "json")
    assert forced.exit_code == 0 and json.loads(forced.stdout)["framework"] == "vllm"
    assert "warning: --framework vllm times" in forced.stderr and "its engine is sglang" in forced.stderr
    assert json.loads(forced.stdout)["replicas"] == 1  # the flag wins over the file's count
