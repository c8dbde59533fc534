"""Token-linear time of all layers: every op whose cost follows the step's new tokens T.

Per layer, on one GPU of a ``ParallelLayout``:

    attention projections  QKV and O GEMMs at m = T, heads split by the attention TP
                           (none for MLA: its module rows time them with the attention)
    MLP                    dense: gate/up and down GEMMs, split by TP;
                           MoE: the fused-MoE table (``costmodels.moeops``) + shared-expert
                           GEMMs + the router GEMM
    communication          attention TP > 1: an all-reduce of T x hidden;
                           attention DP = 1: an all-reduce of T x hidden after the MLP (TP or
                           EP alike: every GPU holds every token, and sums partial outputs);
                           attention DP = d > 1: the MLP sees the tokens of all d groups,
                           d x T, brought in by an all-gather and handed back by a reduce-
                           scatter, or with EP by two all-to-alls (dispatch, combine) of
                           T x top-k x hidden
    elementwise            norms, residuals, activation, RoPE: HBM-bound (roofline)

With attention DP the step tables describe one DP group's batch and time the MoE layer at
d x T tokens, every group holding as many; the groups step together, so the simulator
takes the step of the fullest group (``policies.engine.lockstep``), as the engines pad
their DP batches to the largest.
"""

from __future__ import annotations

import numpy as np

from costmodels.architecture import ModelArch
from costmodels.layout import ParallelLayout
from costmodels.moeops import MoEShape, moe_rows, moe_seconds

ACT_BYTES = 2  # activations stay bf16 whatever the GEMM dtype


def _gated_mlp(ops, tokens: np.ndarray, width: int, hidden: int, gated: bool) -> np.ndarray:
    return ops.gemm(tokens, (2 if gated else 1) * width, hidden) + ops.gemm(tokens, hidden, width)


def mlp_comm_seconds(ops, arch: ModelArch, layout: ParallelLayout, tokens: np.ndarray, routed: bool) -> np.ndarray:
    """Communication around one MLP (``routed``: an MoE layer) for T = ``tokens`` per DP group."""
    h, dp = arch.hidden_size, layout.attention_dp_size
    if dp == 1:
        return ops.allreduce(tokens * h, layout.tp) if layout.tp > 1 else np.zeros_like(tokens)
    if routed and layout.moe_ep_size > 1:
        return 2 * ops.collective("alltoall", tokens * arch.moe.top_k * h, layout.tp)
    gathered = dp * tokens * h
    return ops.collective("all_gather", gathered, layout.tp) + ops.collective("reduce_scatter", gathered, layout.tp)


def linear_seconds(arch: ModelArch, ops, layout: ParallelLayout, tokens: np.ndarray, hbm_bytes_per_s: float,
                   moe: MoEShape | None = None) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Token-linear seconds of all layers for each entry of ``tokens``, the part of them
    that is communication (the collectives' table times, which a calibration may rescale:
    an engine can fuse or overlap them unlike the microbenchmark), and notes on what was
    read beyond or beside the tables (``moe``: the MoE layers' table key)."""
    h, atp, tp = arch.hidden_size, layout.attention_tp, layout.tp
    mlp_tokens = tokens * layout.attention_dp_size
    notes: list[str] = []
    attention = np.zeros_like(tokens)
    rope = 0
    if arch.mla is None:
        q, kv = arch.q_size // atp, arch.kv_heads_per_gpu(atp) * arch.head_dim
        attention = ops.gemm(tokens, q + 2 * kv, h) + ops.gemm(tokens, h, q)
        rope = q + kv
    attention_comm = ops.allreduce(tokens * h, atp) if atp > 1 else np.zeros_like(tokens)
    dense_comm = mlp_comm_seconds(ops, arch, layout, tokens, routed=False)
    dense = _gated_mlp(ops, mlp_tokens, arch.intermediate_size // tp, h, arch.gated_mlp) + dense_comm
    dense_elementwise = 3 * arch.intermediate_size // tp
    total = arch.num_layers * (attention + attention_comm)
    comm = arch.num_layers * attention_comm
    if arch.moe is None:
        total = total + arch.num_layers * dense
        comm = comm + arch.num_layers * dense_comm
        elementwise = arch.num_layers * (10 * h + dense_elementwise + 2 * rope)
    else:
        m = arch.moe
        measured_tokens, measured_s, note = moe_rows(ops, moe)
        notes += [note] if note else []
        notes.append(f"MoE routing {moe.distribution}")
        if mlp_tokens[-1] > measured_tokens[-1]:
            notes.append(f"MoE measured to {int(measured_tokens[-1])} tokens, linear beyond")
        routed = moe_seconds(mlp_tokens, measured_tokens, measured_s) + ops.gemm(mlp_tokens, m.num_experts, h)
        shared_width = m.shared_experts * m.shared_intermediate_size // tp
        if shared_width:
            routed = routed + _gated_mlp(ops, mlp_tokens, shared_width, h, arch.gated_mlp)
        routed_comm = mlp_comm_seconds(ops, arch, layout, tokens, routed=True)
        routed = routed + routed_comm
        moe_layers, dense_layers = m.moe_layers(arch.num_layers), len(m.dense_layers)
        total = total + moe_layers * routed + dense_layers * dense
        comm = comm + moe_layers * routed_comm + dense_layers * dense_comm
        # the fused kernel does its own activation; shared experts and dense layers do not
        elementwise = (arch.num_layers * (10 * h + 2 * rope) + dense_layers * dense_elementwise
                       + moe_layers * 3 * shared_width)
    # two norms (read+write), two residual adds (2 reads+write), activation, RoPE on q and k
    return total + tokens * ACT_BYTES * elementwise / hbm_bytes_per_s, comm, notes
