"""Constants the engine's kernels are compiled with: knob positions in the config vector,
policy and mode codes, request states and reject reasons, kernel error codes, and the row
layouts of the outputs, the carried rows and the speculative slots.
"""

from __future__ import annotations

import numpy as np

from policies import fairness as fm
from policies import queues as qm
from policies.config import (
    ADMISSION_MODES,
    FAIRNESS_COST_UNITS,
    KNOB_INDEX,
    MAX_WAIT_ACTIONS,
    PREEMPTION_MODES,
    PREEMPTION_VICTIMS,
    SCHEDULE_MODES,
    SCHEDULING_POLICIES,
)
from policies.result import Reject, State

# Knob positions in the config vector (frozen into the kernel as constants).
I_MAX_BATCHED = KNOB_INDEX["max_num_batched_tokens"]
I_MAX_SEQS = KNOB_INDEX["max_num_seqs"]
I_CHUNKED = KNOB_INDEX["enable_chunked_prefill"]
I_LONG_PREFILL = KNOB_INDEX["long_prefill_token_threshold"]
I_BLOCK_SIZE = KNOB_INDEX["block_size"]
I_POLICY = KNOB_INDEX["scheduling_policy"]
I_SCHEDULE_MODE = KNOB_INDEX["schedule_mode"]
I_ASYNC = KNOB_INDEX["async_scheduling"]
I_MAX_PREFILL = KNOB_INDEX["max_prefill_tokens"]
I_STEP_CAP_MS = KNOB_INDEX["step_time_cap_ms"]
I_BATCH_WAIT_ITERS = KNOB_INDEX["batch_wait_iters"]
I_BATCH_WAIT_RATIO = KNOB_INDEX["batch_wait_token_ratio"]
I_DP_BALANCE_TIMEOUT = KNOB_INDEX["dp_balance_timeout_iters"]
I_DP_BALANCE_BATCHING = KNOB_INDEX["dp_balance_batching_iters"]
I_HEADROOM = KNOB_INDEX["kv_headroom"]
I_ADMISSION = KNOB_INDEX["admission_mode"]
I_QUANTILE = KNOB_INDEX["admission_quantile"]
I_CONSERVATIVENESS = KNOB_INDEX["schedule_conservativeness"]
I_PREEMPTION = KNOB_INDEX["preemption_mode"]
I_VICTIM = KNOB_INDEX["preemption_victim"]
I_MAX_PREEMPTIONS = KNOB_INDEX["max_preemptions"]
I_MAX_QUEUE = KNOB_INDEX["max_queue_len"]
I_MAX_WAIT = KNOB_INDEX["max_wait_s"]
I_HIGH_WATER = KNOB_INDEX["kv_high_water"]
I_UNMEETABLE = KNOB_INDEX["reject_unmeetable_deadline"]
I_MAX_MODEL_LEN = KNOB_INDEX["max_model_len"]
I_PREFIX_CACHING = KNOB_INDEX["enable_prefix_caching"]
I_COST_UNIT = KNOB_INDEX["fairness_cost_unit"]
I_W_IN = KNOB_INDEX["vtc_input_weight"]
I_W_OUT = KNOB_INDEX["vtc_output_weight"]
I_AGING = KNOB_INDEX["aging_rate"]
I_WAIT_ACTION = KNOB_INDEX["max_wait_action"]
I_DEADLINE_MARGIN = KNOB_INDEX["deadline_margin_ms"]
I_SPEC_MODE = KNOB_INDEX["speculative_mode"]
I_SPEC_GAMMA = KNOB_INDEX["num_speculative_tokens"]
I_DRAFT_MODE = KNOB_INDEX["speculative_draft_cost_mode"]
I_DRAFT_COST = KNOB_INDEX["speculative_draft_cost"]
I_SPEC_BATCH_2 = KNOB_INDEX["speculative_batch_2"]
I_SPEC_K_2 = KNOB_INDEX["speculative_k_2"]
I_SPEC_BATCH_3 = KNOB_INDEX["speculative_batch_3"]
I_SPEC_K_3 = KNOB_INDEX["speculative_k_3"]
I_LORA = KNOB_INDEX["enable_lora"]
I_MAX_LORAS = KNOB_INDEX["max_loras"]
I_MAX_CPU_LORAS = KNOB_INDEX["max_cpu_loras"]
I_LORA_RANK = KNOB_INDEX["max_lora_rank"]
I_LORA_POLICY = KNOB_INDEX["lora_eviction_policy"]
I_LORA_BASE_SLOT = KNOB_INDEX["lora_base_slot"]
I_LORA_PRELOAD = KNOB_INDEX["lora_preload"]
assert SCHEDULING_POLICIES == qm.QUEUE_ORDERS and FAIRNESS_COST_UNITS == fm.FAIRNESS_COST_UNITS
EDF = SCHEDULING_POLICIES.index("edf")
VTC = SCHEDULING_POLICIES.index("vtc")
LPM = SCHEDULING_POLICIES.index("lpm")
DFS_WEIGHT = SCHEDULING_POLICIES.index("dfs_weight")
ADMIT_FIRST = MAX_WAIT_ACTIONS.index("admit_first")
PREFILL_FIRST = SCHEDULE_MODES.index("prefill_first")
ADMIT_NONE = ADMISSION_MODES.index("none")
ADMIT_RESERVATION = ADMISSION_MODES.index("reservation")
ADMIT_PREDICTED = ADMISSION_MODES.index("predicted")
ADMIT_NTR = ADMISSION_MODES.index("new_token_ratio")
NEVER = np.iinfo(np.int64).max  # ``_head_start_free`` of a head no amount of free KV would start
PREEMPT_RECOMPUTE = PREEMPTION_MODES.index("recompute")
PREEMPT_SWAP = PREEMPTION_MODES.index("swap")
VICTIM_NEWEST = PREEMPTION_VICTIMS.index("newest")
VICTIM_LOWEST_PRIORITY = PREEMPTION_VICTIMS.index("lowest_priority")
S_FINISHED = int(State.FINISHED)
S_REJECTED = int(State.REJECTED)
S_TIMED_OUT = int(State.TIMED_OUT)
S_CANCELLED = int(State.CANCELLED)
R_NONE = int(Reject.NONE)
R_KV_HIGH_WATER = int(Reject.KV_HIGH_WATER)
R_QUEUE_FULL = int(Reject.QUEUE_FULL)
R_MAX_WAIT = int(Reject.MAX_WAIT)
R_DEADLINE = int(Reject.DEADLINE_UNMEETABLE)
R_EXCEEDS = int(Reject.EXCEEDS_CAPACITY)
R_MAX_PREEMPTIONS = int(Reject.MAX_PREEMPTIONS)
#: Kernel error codes: a step formed no work although requests were waiting or running;
#: ``withdraw`` was asked for a request the replica does not hold; ``advance``'s loop
#: passed its progress bound (``_progress``).
ERROR_STALLED = 1
ERROR_NOT_HELD = 2
ERROR_NO_PROGRESS = 3
#: What each error code means, for the error the Python side raises.
ERROR_WHY = {ERROR_STALLED: "a step formed no work although requests were waiting or running",
             ERROR_NOT_HELD: "asked to withdraw a request it does not hold",
             ERROR_NO_PROGRESS: "its loop passed its bound of iterations"}


class SimulationStalled(RuntimeError):
    """A kernel stopped a run that made no progress (an internal error: please report the
    trace, config and failure schedule)."""


# Per-request output rows (out_i, out_f) copied from the kernel's state.
O_STATE, O_REASON, O_GENERATED, O_PREEMPTS = 0, 1, 2, 3
O_FIRST_TOKEN, O_FINISH, O_FIRST_SCHED = 0, 1, 2
N_OI, N_OF = 4, 3
# Prefix-cache run figures (out_prefix): lookups' hit and query tokens, prefill time saved.
P_HIT_TOKENS, P_QUERY_TOKENS, P_SAVED_S, P_EVICTIONS = 0, 1, 2, 3
N_PREFIX = 4
# What a request takes from one replica to the next (``carry``): rows of carried_i / carried_f.
K_COMPUTED, K_GENERATED, K_PREEMPTS, K_CACHED_FIRST = 0, 1, 2, 3
# The sampler's state goes too: SmartSpec's acceptance counts, and (by construction) the
# draws, keyed by (run seed, request, token index) wherever the request runs.
K_FIRST_SCHED, K_FIRST_TOKEN, K_SPEC_HITS, K_SPEC_TRIALS = 0, 1, 2, 3
N_KI, N_KF = 4, 4
# Speculative per-slot rows, after L_SPEC in ``lists`` (allocated only when speculating).
SP_REQS, SP_TOK, SP_LIM, SP_SLACK, SP_ELL, SP_ACCEPTED, SP_SCRATCH, SP_HEAP = range(8)
N_SPEC_I = 8
