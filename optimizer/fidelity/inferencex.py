"""The servers SemiAnalysis InferenceX's benchmark scripts launch, known per measured run.

A run measured by InferenceX (``client`` "inferencex": ``costmodels.runs.client_column``)
was served by a public script that sets the scheduler from the run's own concurrency and
prompt length. Where that script is known, the replay serves the run with it
(``known_server``) instead of a server the replay fit chooses among
``replayfit.SERVER_CANDIDATES``: a fact about the run is not a term to fit.

Scripts (SemiAnalysisAI/InferenceX, ``benchmarks/``), all TensorRT-LLM without chunked prefill:

* ``dsr1_fp8_h200_trt_slurm.sh`` (DeepSeek-V3/R1 FP8 on 8 H200, tensor parallel only):
  ``max_num_tokens = ceil((C + ISL + 64) / 64) * 64``, no ``max_batch_size`` (TRT-LLM's 2048);
* ``dsr1_fp8_h200_trt_mtp.sh`` (the same with MTP; added 2026-01-07, the only H200 DeepSeek
  TRT-LLM config whose search space has expert parallelism or attention DP, so the R1 EP8
  and attention-DP rows, measured after it, are MTP runs): 3 MTP layers without attention
  DP, 1 with it; ``max_batch_size`` C per attention-DP group;
  ``max_num_tokens = ceil(((MTP + 1) x max_batch_size + ISL + 64) / 64) * 64``; with
  attention DP ``attention_dp_config`` ``enable_balance``, ``timeout_iters`` 60,
  ``batching_wait_iters`` 0 (the engine's ``dp_balance_*`` knobs);
* ``70b_fp8_b200_trt_slurm.sh`` (Llama-3.1-70B FP8 on B200): ``max_num_tokens`` 16384; its
  1k/1k runs below TP 8 also hold new prompts beside running requests while the batch
  fills (``batch_wait_max_tokens_ratio`` 0.9, ``batch_wait_timeout_iters`` 20: the
  engine's ``batch_wait_*`` knobs).

The breadth runs record no MTP acceptance, so ``MTP_ACCEPTANCE`` is taken from elsewhere
(stated there); a runs file that measured it gives it per run (``mtp_acceptance``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.speculative import AcceptanceModel

#: TRT-LLM rounds these scripts' step budgets up to a multiple of 64 tokens.
_BUDGET_ROUND = 64
#: Conditional acceptance of every MTP draft position: the runs record none, so it comes
#: from TensorRT-LLM's MTP blog (tech blog 2): 3 MTP layers speed DeepSeek-R1 up 2.16x at
#: batch 1 (strict acceptance). A 4-token verify and three drafts take 1.375x a decode step
#: on these tables (R1, H200, TP8; mean of EP 1 and 8), so a step keeps 2.16 x 1.375 = 2.97
#: tokens: 1 + c + c^2 + c^3 = 2.97 gives c = 0.80, near the DeepSeek-V3 report's 85-90% for
#: the first position.
MTP_ACCEPTANCE = 0.80
#: An MTP draft position runs one decoder layer (DeepSeek-V3/R1: 61 layers, one MTP
#: module; embedding and head shared), so it costs that share of a decode step.
MTP_DRAFT_FRACTION = 1.0 / 61.0
_DEEPSEEK = frozenset({"deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-R1"})


@dataclass(frozen=True)
class KnownServer:
    """The scheduler a run's script set: ``overrides`` of ``closedloop.framework_config``
    and, for a speculative server, the drafter's ``acceptance``."""

    script: str
    overrides: dict
    acceptance: AcceptanceModel | None = None


def _round_up(tokens: int) -> int:
    return -(-int(tokens) // _BUDGET_ROUND) * _BUDGET_ROUND


def _acceptance(row: dict) -> float:
    """The run's measured acceptance per MTP draft position, else ``MTP_ACCEPTANCE``."""
    measured = row.get("mtp_acceptance")
    return MTP_ACCEPTANCE if measured is None or math.isnan(measured) else float(measured)


def known_server(row: dict) -> KnownServer | None:
    """The server of ``row`` (a ``load_runs`` row with its layout) when its script is
    known, else None. ``batch_size`` is the clients of one attention-DP group."""
    if row.get("client") != "inferencex" or row.get("framework") != "trtllm":
        return None
    clients, isl = int(row["batch_size"]), int(row["isl"])
    no_chunking = {"enable_chunked_prefill": False}
    if row["model"] in _DEEPSEEK and row["gpu"] == "h200_sxm" and row["gemm_dtype"] == "fp8" and row["tp"] == 8:
        if row.get("moe_ep_size", 1) == 1 and row.get("attention_dp_size", 1) == 1:
            return KnownServer("dsr1_fp8_h200_trt_slurm.sh",
                               no_chunking | {"max_num_batched_tokens": _round_up(clients + isl + 64)})
        dp = row.get("attention_dp_size", 1) > 1
        mtp = 1 if dp else 3
        balance = {"dp_balance_timeout_iters": 60, "dp_balance_batching_iters": 0} if dp else {}
        return KnownServer("dsr1_fp8_h200_trt_mtp.sh", no_chunking | balance | {
            "max_num_seqs": clients, "max_num_batched_tokens": _round_up((mtp + 1) * clients + isl + 64),
            "speculative_mode": "fixed", "num_speculative_tokens": mtp,
            "speculative_draft_cost_mode": "fraction", "speculative_draft_cost": MTP_DRAFT_FRACTION},
            AcceptanceModel(default=(_acceptance(row),) * mtp))
    if row["model"] == "meta-llama/Llama-3.1-70B" and row["gpu"] == "b200_sxm" and row["gemm_dtype"] == "fp8":
        server = no_chunking | {"max_num_batched_tokens": 16384}
        if row["isl"] == 1024 and row["osl"] == 1024 and row["tp"] < 8:
            server |= {"batch_wait_iters": 20, "batch_wait_token_ratio": 0.9}
        return KnownServer("70b_fp8_b200_trt_slurm.sh", server)
    return None
