"""`tune` reads what its spec file sets and names a bad deployment before creating anything."""

from typer.testing import CliRunner

from optimizer.cli import app
from optimizer.cli.tune import DEFAULT_HOLDOUT, _holdout

SAMPLE = "studies/data/mooncake_conversation_300s.parquet"


def test_the_spec_files_holdout_is_used_unless_the_flag_says_otherwise(tmp_path):
    spec = tmp_path / "study.toml"
    spec.write_text("[study]\nholdout = 0.1\n")
    assert _holdout(None, spec) == 0.1
    assert _holdout(0.3, spec) == 0.3
    assert _holdout(None, None) == DEFAULT_HOLDOUT
    (tmp_path / "bare.toml").write_text("[study]\ntrials = 4\n")
    assert _holdout(None, tmp_path / "bare.toml") == DEFAULT_HOLDOUT


def test_an_unknown_model_or_gpu_is_named_before_any_run_folder(tmp_path):
    for flag, value, message in (("--model", "nope", "unknown model 'nope'"), ("--gpu", "tpu9", "unknown GPU")):
        args = {"--model": "meta-llama/Llama-3.1-8B", "--gpu": "h100", flag: value}
        run_dir = tmp_path / value
        result = CliRunner().invoke(app, ["tune", "--trace", SAMPLE, *[x for kv in args.items() for x in kv],
                                          "--slo", "ttft:2000", "--trials", "2", "--run-dir", str(run_dir)])
        assert result.exit_code == 2 and message in result.output
        assert "Traceback" not in result.output and not run_dir.exists()
