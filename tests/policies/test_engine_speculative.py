"""The engines' own verify budgets: vLLM's per-batch-size k and DSpark adaptive verification,
SGLang's DSPARK with an SPS table; their flags, rules and files, from the engines' source.

Rules cite vLLM 0.33.0 / SGLang 0.5.23 (paths relative to site-packages), as read in the
installed packages and checked with ../shared/tools/engine-check (check_vllm_serve.py with
VLLM_USE_V2_MODEL_RUNNER=1, as on an H100; check_sglang.py; SGLang's own table loader).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml

from costmodels import build
from optimizer.outputs.exports import (
    Deployment,
    ExportError,
    engine_yaml,
    read_engine_file,
    write_exports,
)
from optimizer.search.drafter import Drafter
from optimizer.search.targets import engine_context
from policies import speculative as spm
from policies.config import PolicyConfig
from policies.engine import simulate_many
from policies.engines import EngineError, target
from policies.engines.sglang import SPECULATIVE_MAX_RUNNING_REQUESTS, sps_table
from policies.engines.vllm import batch_schedule_knobs, batch_schedule_ranges
from policies.speculative import AcceptanceModel
from studies.scenarios import SCENARIOS, build_trace

from .conftest import cost_model, make_trace

LLAMA = "meta-llama/Llama-3.1-8B"
CTX = engine_context(LLAMA, "h100")
VLLM, SGLANG = target("vllm"), target("sglang")
ONE = Deployment(LLAMA, tp=1, replicas=1, gpu="h100")
DSPARK = Drafter(method="dspark", model="org/dspark-llama-8b")
EAGLE = Drafter(method="eagle3", model="org/eagle3-llama-8b")


def _file(engine, config, drafter, deployment=ONE):
    text = engine_yaml(engine, config, dataclasses.replace(deployment, drafter=drafter), CTX)
    return text, yaml.safe_load(text.split("\n", 1)[1] if text.startswith("#") else text)


def _vllm(**knobs):
    return VLLM.defaults(CTX).replace(speculative_mode="batch_schedule", num_speculative_tokens=5, **knobs)


# -- vLLM: num_speculative_tokens_per_batch_size ---------------------------------------
def test_schedule_ranges_start_at_one_and_read_back():
    config = _vllm(speculative_batch_2=5, speculative_k_2=3, speculative_batch_3=33, speculative_k_3=1)
    assert batch_schedule_ranges(config) == [[1, 4, 5], [5, 32, 3], [33, 1024, 1]]
    _, data = _file(VLLM, config, EAGLE)
    spec = data["speculative-config"]
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 5], [5, 32, 3], [33, 1024, 1]]
    back = read_engine_file(VLLM, yaml.safe_dump(data), CTX, drafter=EAGLE)
    assert (back.speculative_mode, back.speculative_batch_2, back.speculative_k_2, back.speculative_batch_3,
            back.speculative_k_3) == ("batch_schedule", 5, 3, 33, 1)


def test_schedule_rules_are_vllms():
    # v1/spec_decode/dynamic/utils.py:59 sorts first; :105-116 a gap takes the range before it;
    # :113-146 k above num_speculative_tokens is cut to it; k = 0 is allowed (:52-55)
    assert batch_schedule_knobs([[33, 1024, 1], [1, 4, 5], [8, 32, 3]], 5) == {
        "speculative_batch_2": 8, "speculative_k_2": 3, "speculative_batch_3": 33, "speculative_k_3": 1}
    assert batch_schedule_knobs([[1, 4, 9], [5, 64, 0]], 5) == {
        "speculative_batch_2": 5, "speculative_k_2": 0, "speculative_batch_3": 0, "speculative_k_3": 0}
    assert batch_schedule_knobs([[1, 4, 5], [5, 9, 5], [10, 99, 2]], 5)["speculative_batch_2"] == 10  # merged
    for bad, why in (([[1, 4, 5], [4, 32, 3]], "non-overlapping"),  # utils.py:61-65 (scheduler.py:325)
                     ([[2, 4, 5]], "start at 1"),  # utils.py:67-72
                     ([[1, 0, 5]], "start <= end"),  # utils.py:47-51
                     ([[1, 4, -1]], "k >= 0"),  # utils.py:52-55
                     ([[1, 4]], "[start, end, k]"),  # pydantic: Field required
                     ([[1, 2, 5], [3, 4, 4], [5, 6, 3], [7, 9, 2]], "at most 3")):
        with pytest.raises(EngineError, match=why.replace("[", r"\[").replace("]", r"\]")):
            batch_schedule_knobs(bad, 5)


def test_a_schedule_is_refused_where_vllm_would_drop_it():
    # config/vllm.py:1110-1127: data parallel > 1 drops the schedule (static k) with a warning
    config = _vllm(speculative_batch_2=8, speculative_k_2=2)
    with pytest.raises(ExportError, match="data parallelism"):
        _file(VLLM, config, EAGLE, Deployment(LLAMA, tp=1, replicas=2, gpu="h100"))
    assert VLLM.config_layout_violations(config, Deployment(LLAMA, 1, 2, gpu="h100").engine)
    assert not VLLM.config_layout_violations(config, ONE.engine)
    assert "batch_schedule" not in VLLM.speculative_search_modes(EAGLE.names, replicas=2)
    with pytest.raises(EngineError, match="non-overlapping"):
        VLLM.check(_vllm(speculative_batch_2=8, speculative_batch_3=8), CTX)


def test_adaptive_verification_is_dspark_only_and_no_lora():
    config = VLLM.defaults(CTX).replace(speculative_mode="adaptive_verify", num_speculative_tokens=7)
    assert VLLM.speculative_search_modes(DSPARK.names) == ("fixed", "batch_schedule", "adaptive_verify")
    assert "adaptive_verify" not in VLLM.speculative_search_modes(EAGLE.names)
    _, data = _file(VLLM, config, DSPARK)
    assert data["speculative-config"] == {"method": "dspark", "model": "org/dspark-llama-8b",
                                          "num_speculative_tokens": 7, "enable_adaptive_verification": True}
    assert read_engine_file(VLLM, yaml.safe_dump(data), CTX, drafter=DSPARK).speculative_mode == "adaptive_verify"
    with pytest.raises(ExportError, match="DSpark drafter"):
        _file(VLLM, config, EAGLE)
    with pytest.raises(EngineError, match="LoRA"):  # config/vllm.py:3158-3163
        VLLM.check(config.replace(enable_lora=True), CTX)


# -- SGLang: DSPARK ----------------------------------------------------------------------
def test_dspark_file_carries_block_size_table_and_planner_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("SGLANG_RAGGED_VERIFY_MODE", raising=False)  # unset: the mode servetune's command sets
    config = SGLANG.defaults(CTX).replace(speculative_mode="sps_table", num_speculative_tokens=7, max_num_seqs=48)
    text, data = _file(SGLANG, config, DSPARK)
    assert data["speculative-algorithm"] == "DSPARK"
    assert data["speculative-dspark-block-size"] == 7
    assert data["speculative-dspark-sps-table-path"] == "sps.json"
    assert "speculative-num-steps" not in data  # forced to 1 (arg_groups/speculative_hook.py:757-789)
    assert text.startswith("# SGLANG_RAGGED_VERIFY_MODE=compact sglang serve")  # srt/environ.py:1572
    back = read_engine_file(SGLANG, yaml.safe_dump(data), CTX, drafter=DSPARK)
    assert (back.speculative_mode, back.num_speculative_tokens) == ("sps_table", 7)
    static = {k: v for k, v in data.items() if k != "speculative-dspark-sps-table-path"}
    assert read_engine_file(SGLANG, yaml.safe_dump(static), CTX, drafter=DSPARK).speculative_mode == "fixed"
    tables = _tables()
    paths = write_exports(tmp_path, SGLANG, config, Deployment(LLAMA, 1, 1, gpu="h100", drafter=DSPARK), CTX,
                          tables=tables)
    assert json.loads(paths["sps.json"].read_text()) == json.loads(json.dumps(sps_table(tables, config)))


def test_dspark_rules_are_sglangs():
    base = {"model-path": LLAMA, "speculative-algorithm": "DSPARK", "speculative-draft-model-path": "d"}
    with pytest.raises(EngineError, match="block size"):  # gamma read from the checkpoint otherwise (:791-839)
        SGLANG.from_args(base, CTX)
    with pytest.raises(EngineError, match="gamma \\+ 1"):  # speculative_hook.py:824-839
        SGLANG.from_args({**base, "speculative-dspark-block-size": 7, "speculative-num-draft-tokens": 4}, CTX)
    # any drafter resets an unset max-running-requests to 48 (speculative_hook.py:852-860)
    config = SGLANG.from_args({**base, "speculative-dspark-block-size": 7}, CTX)
    assert config.max_num_seqs == SPECULATIVE_MAX_RUNNING_REQUESTS == 48
    assert SGLANG.from_args({**base, "speculative-dspark-block-size": 7, "max-running-requests": 128},
                            CTX).max_num_seqs == 128
    assert SGLANG.speculative_search_modes(DSPARK.names) == ("fixed", "sps_table")
    assert SGLANG.speculative_search_modes(EAGLE.names) == ("fixed",)
    with pytest.raises(ExportError, match="DSPARK"):
        _file(SGLANG, SGLANG.defaults(CTX).replace(speculative_mode="sps_table"), EAGLE)


def _tables():
    return build(LLAMA, "h100").tables


def test_sps_table_keeps_sglangs_schema_and_probes():
    # srt/speculative/dspark_components/dspark_sps.py:14-36: probes strictly increasing ints,
    # as many rates, max_batch_tokens >= the last probe; benchmark/dspark_sps_profiler.py:557-573
    table = sps_table(_tables(), PolicyConfig(num_speculative_tokens=7, max_num_seqs=48))
    probes, rates = table["sample_batch_tokens"], table["sample_steps_per_sec"]
    assert probes == [8, 16, 32, 64, 128, 192, 256, 320, 384]
    assert all(isinstance(p, int) for p in probes) and probes == sorted(set(probes))
    assert len(rates) == len(probes) and table["max_batch_tokens"] >= probes[-1]
    assert all(r > 0 for r in rates) and rates == sorted(rates, reverse=True)  # bigger steps are slower
    assert set(json.loads(json.dumps(table))) == {"sample_batch_tokens", "sample_steps_per_sec", "max_batch_tokens"}
    assert spm.sps_probe_counts(300)[-3:] == [224, 256, 300]


@pytest.mark.parametrize("most", [1, 7, 48, 100, 300, 1024])
def test_the_kernels_floor_probe_is_the_tables(most):
    counts = spm.sps_probe_counts(most)
    for q in range(0, most + 70):
        assert spm.sps_probe_floor(q, most) == max([p for p in counts if p <= q], default=1), q


def test_schedule_k_is_the_range_of_the_last_batch():
    # scheduler.py:1709-1714: none scheduled -> the static k; ranges from their first batch size
    k = [spm.batch_schedule_k(5, 4, 2, 9, 0, n) for n in range(12)]
    assert k == [5, 5, 5, 5, 2, 2, 2, 2, 2, 0, 0, 0]
    assert spm.batch_schedule_k(3, 2, 7, 0, 0, 5) == 3  # cut to num_speculative_tokens
    assert np.all(np.diff([spm.batch_schedule_k(5, 0, 1, 0, 1, n) for n in range(9)]) == 0)


def test_cap_accept_plans_as_compact_but_verifies_every_whole_block():
    """dspark_worker_v2.py:1103, 1151-1175 (cap-accept runs the full verify), dspark_accept.py:
    163-166 (the accepted run is cut at the planned length). Every request arrives at once, so
    both modes take the same steps and only the verify's width differs."""
    trace = make_trace(np.zeros(48), np.full(48, 64), np.full(48, 300))
    runs = simulate_many(trace, cost_model(65536), [
        PolicyConfig(max_num_batched_tokens=512, max_num_seqs=48, gpu_memory_utilization=1.0, block_size=16,
                     speculative_mode=mode, num_speculative_tokens=4) for mode in ("sps_table", "sps_cap_accept")],
        acceptance=AcceptanceModel([0.9, 0.6, 0.3, 0.2], spread=0.4))
    compact, cap = runs
    assert (cap.steps, cap.spec_verifies, cap.spec_accepted_tokens) == (compact.steps, compact.spec_verifies,
                                                                       compact.spec_accepted_tokens)
    assert cap.spec_drafted_tokens == pytest.approx(4 * cap.spec_decodes, rel=0.02)  # the whole blocks
    assert compact.spec_drafted_tokens < 0.9 * cap.spec_drafted_tokens  # the planner trimmed them
    assert cap.finish_s.max() > compact.finish_s.max()  # the same tokens for more compute


def test_idle_cached_blocks_make_room_for_the_drafts():
    """The engines allocate a decode's draft slots from a pool whose free blocks include idle
    cached ones (vLLM allocate_slots' lookahead, SGLang's decode reserve): a radix cache full
    of finished chat prompts must not cut the verify. It did: SGLang's static DSPARK verified
    2.5 of 7 drafts per decode with the cache on, 7.0 with it off."""
    data = json.loads(json.dumps(SCENARIOS["spec-dspark"]))
    data["workload"]["duration_s"] = 30
    trace = build_trace("spec-dspark", data)
    sglang = SGLANG.with_drafter(SGLANG.defaults(CTX)).replace(speculative_mode="fixed", num_speculative_tokens=7)
    vllm = VLLM.defaults(CTX).replace(speculative_mode="fixed", num_speculative_tokens=7)
    configs = [c.replace(enable_prefix_caching=on) for c in (sglang, vllm) for on in (True, False)]
    runs = simulate_many(trace, build(LLAMA, "h100"), configs, acceptance=AcceptanceModel([0.73] * 7))
    per_decode = [r.spec_drafted_tokens / r.spec_decodes for r in runs]
    assert runs[0].prefix_evictions > 0  # the cache was full
    assert per_decode[0] == pytest.approx(per_decode[1], rel=0.02)  # SGLang: cached or not
    assert per_decode[2] == pytest.approx(per_decode[3], rel=0.05)  # vLLM


def test_the_planner_mode_of_a_file_is_the_environments(monkeypatch):
    """srt/speculative/ragged_verify.py:13-27 (the modes; anything else is a ValueError);
    speculative_hook.py:878-883 (a table is a no-op under static)."""
    config = SGLANG.defaults(CTX).replace(speculative_mode="sps_cap_accept", num_speculative_tokens=7, max_num_seqs=48)
    text, data = _file(SGLANG, config, DSPARK)
    assert text.startswith("# SGLANG_RAGGED_VERIFY_MODE=cap-accept sglang serve")
    assert data["speculative-dspark-sps-table-path"] == "sps.json"
    for env, mode in (("cap-accept", "sps_cap_accept"), ("compact", "sps_table"), ("static", "fixed")):
        monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", env)
        assert read_engine_file(SGLANG, yaml.safe_dump(data), CTX, drafter=DSPARK).speculative_mode == mode
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "Compact")
    with pytest.raises(ExportError, match="expected one of 'static', 'cap-accept', 'compact'"):
        read_engine_file(SGLANG, yaml.safe_dump(data), CTX, drafter=DSPARK)
    assert "sps_cap_accept" not in SGLANG.speculative_search_modes(DSPARK.names)  # never above static


def test_a_drafter_without_a_checkpoint_exports_a_placeholder_unless_it_needs_none():
    config = VLLM.defaults(CTX).replace(speculative_mode="fixed", num_speculative_tokens=3)
    _, data = _file(VLLM, config, Drafter(method="dspark"))
    assert data["speculative-config"]["model"] == "FILL-IN-draft-model"
    _, data = _file(SGLANG, SGLANG.defaults(CTX).replace(speculative_mode="fixed", num_speculative_tokens=3),
                    Drafter(method="dspark"))
    assert data["speculative-draft-model-path"] == "FILL-IN-draft-model"  # SGLang refuses DSPARK without one
    _, data = _file(VLLM, config, Drafter(method="ngram"))
    assert "model" not in data["speculative-config"]
