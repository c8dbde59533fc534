"""The communication inside a step's token-linear time, kept apart so a calibration can
rescale it (``CostModel.comm_s``, ``compose.with_comm_scale``, an entry's ``comm_scale``)."""

import json

import numpy as np
import pytest

from costmodels import CostModelError, build, load_model
from costmodels.compose import with_comm_scale
from costmodels.gpus import load_gpu
from costmodels.optables import ProfiledOps
from costmodels.steptable import step_seconds

LLAMA8 = "meta-llama/Llama-3.1-8B"


def test_communication_is_the_two_all_reduces_of_every_layer_and_nothing_at_tp1():
    one, two = (build(LLAMA8, "h100", tp=tp, framework="trtllm", calibration=False) for tp in (1, 2))
    assert not one.comm_s.any() and with_comm_scale(one.tables, one.comm_s, 0.5) is one.tables
    arch, ops = load_model(LLAMA8), ProfiledOps(load_gpu("h100").tables, "trtllm", "bf16")
    tokens = two.tables.linear_tokens
    # attention's all-reduce and the MLP's, of T x hidden each, in every layer
    expected = 2 * arch.num_layers * ops.allreduce(tokens * arch.hidden_size, 2)
    np.testing.assert_allclose(two.comm_s, expected, rtol=1e-12)
    assert (two.comm_s < two.tables.linear_s).all()


def test_a_communication_scale_moves_a_decode_step_by_its_share_of_the_collectives():
    cost = build(LLAMA8, "h100", tp=2, framework="trtllm", calibration=False)
    half = with_comm_scale(cost.tables, cost.comm_s, 0.5)
    # where the grid rises the step saves exactly half its collectives; where the grid's
    # running maximum held it flat (measured noise), no more than that
    saved = cost.tables.linear_s - half.linear_s
    assert (saved >= 0).all() and (saved <= 0.5 * cost.comm_s * (1 + 1e-12)).all()
    i = 9  # 10 tokens: a rising point of the H100 TRT-LLM grid
    n = cost.tables.linear_tokens[i]
    full_s, _ = step_seconds(cost.tables, n, n, n, 1000 * n, 0)
    half_s, _ = step_seconds(half, n, n, n, 1000 * n, 0)
    assert full_s - half_s == pytest.approx(0.5 * cost.comm_s[i], rel=1e-9)
    for name in ("head_s", "decode_s", "prefill_s"):  # the rest of the step as it was
        np.testing.assert_array_equal(getattr(half, name), getattr(cost.tables, name))
    assert half.overhead_s == cost.tables.overhead_s


def test_an_entry_with_a_communication_scale_applies_it_and_says_so(tmp_path):
    entry = {"model": LLAMA8, "gpu": "h100_sxm", "framework": "trtllm", "gemm_dtype": "bf16", "kv_dtype": "bf16",
             "tp": [2], "overhead_s": 1e-3, "scale": 1.0, "comm_scale": 0.5}
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"format": "servetune-calibration/1", "entries": [entry]}))
    plain = build(LLAMA8, "h100", tp=2, framework="trtllm", calibration=False)
    cost = build(LLAMA8, "h100", tp=2, framework="trtllm", calibration=path)
    np.testing.assert_array_equal(cost.tables.linear_s, with_comm_scale(plain.tables, plain.comm_s, 0.5).linear_s)
    assert "communication x0.500" in cost.source and cost.calibration["comm_scale"] == 0.5
    path.write_text(json.dumps({"format": "servetune-calibration/1", "entries": [{**entry, "comm_scale": 0.0}]}))
    with pytest.raises(CostModelError, match="entry 0 needs"):
        build(LLAMA8, "h100", tp=2, framework="trtllm", calibration=path)
