"""servetune's vLLM target against vLLM 0.33.0's own scheduler, step for step.

Each recorded scenario (``../shared/oracle/vllm-0.33.0/``, ``tests/fixtures/vllm_oracle/``;
``optimizer.fidelity.parity``) is replayed through the vLLM target: every request's first token and
finish at the same time as in vLLM's run, and every step (start, tokens, first tokens,
finishes) the same, for vLLM's synchronous loop (``no-async-scheduling``) and for its async
loop (what ``vllm serve`` runs), prefix caching included: blocks cached as scheduled, evicted
a block at a time, and a preempted request's own blocks found again.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from optimizer.fidelity import parity

ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("SERVETUNE_SHARED", ROOT / ".." / "shared"))
FOLDERS = parity.scenarios(SHARED / "oracle" / "vllm-0.33.0", ROOT / "tests" / "fixtures" / "vllm_oracle")


def _cases():
    for folder in FOLDERS:
        modes = [m for m in parity.MODES if (folder / f"vllm-{m}_requests.csv").is_file()]
        for mode in modes:
            yield pytest.param(folder, mode, id=f"{folder.name}-{mode}")


CASES = list(_cases())


def test_the_oracle_scenarios_are_there():
    if not (SHARED / "oracle").is_dir():
        pytest.skip(f"no recorded vLLM runs at {SHARED / 'oracle'} (set SERVETUNE_SHARED)")
    assert len(CASES) >= 15, [c.id for c in CASES]
    assert sum(c.values[1] == "async" for c in CASES) >= 5


@pytest.mark.parametrize(("folder", "mode"), CASES)
def test_every_request_and_step_as_vllm(folder, mode):
    scenario = parity.load(folder)
    got = parity.agreement(scenario, mode)
    assert got.same_both == got.requests, got
    assert got.same_preemptions == got.requests, got
    assert got.exact, got


def test_async_scheduling_is_what_a_vllm_file_resolves_to():
    """An exported vLLM file leaves ``async-scheduling`` unset: vLLM 0.33 then runs the async
    loop, and so does the target; ``no-async-scheduling: true`` runs the sync loop."""
    from optimizer.outputs.exports import read_engine_file
    from optimizer.search.targets import engine_context
    from policies.engines import target

    ctx = engine_context("meta-llama/Llama-3.1-8B", "h100", 1, "vllm")
    base = "model: meta-llama/Llama-3.1-8B\nmax-num-batched-tokens: 4096\n"
    assert read_engine_file(target("vllm"), base, ctx).async_scheduling is True
    assert read_engine_file(target("vllm"), base + "no-async-scheduling: true\n", ctx).async_scheduling is False
    assert target("vllm").defaults(ctx).async_scheduling is True


def test_the_two_loops_differ_where_vllm_s_do():
    """Matching both recorded loops means something only if they differ: on every scenario
    with both runs, vLLM's async first tokens differ from its sync ones, and so do
    servetune's, by the same requests."""
    both = [f for f in FOLDERS if {"sync", "async"} <= set(parity.load(f).modes)]
    if not both:
        pytest.skip("no scenario recorded in both loops")
    for folder in both:
        scenario = parity.load(folder)
        theirs = parity.vllm_requests(folder, "async")["first_token"] != parity.vllm_requests(folder, "sync")["first_token"]
        ours = parity.replay(scenario, "async").first_token_s != parity.replay(scenario, "sync").first_token_s
        assert theirs.any(), folder.name
        assert (ours == theirs).all(), folder.name
