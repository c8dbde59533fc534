"""Memory layout of one simulation inside the kernel: named rows and slots, no objects.

Per-request values live in two field-major matrices indexed ``[FIELD, request]`` (each
row is one contiguous array, i.e. structure of arrays): ``ri`` for integers and ``rf``
for times. Run-wide scalars live in ``g`` (integers) and ``gf`` (floats). Numba freezes
these module constants into the compiled code, so a name costs nothing at run time.
"""

from __future__ import annotations

# -- request lifecycle (ri[STATUS]) -------------------------------------------------------
NOT_ARRIVED = 0
WAITING = 1  # in the waiting queue: new, preempted (recompute) or swapped out
RUNNING = 2
DONE = 3  # final state recorded in ri[STATE]

# -- ri rows: per-request integers -------------------------------------------------------
STATUS = 0
COMPUTED = 1  # tokens whose KV is computed (vLLM num_computed_tokens)
GENERATED = 2  # output tokens sampled so far
HELD = 3  # GPU KV blocks held
HOST = 4  # KV blocks swapped out to host memory
RESERVED = 5  # KV blocks reserved by the admission rule while running
TARGET = 6  # tokens this request will generate: min(output, max_out), at least 1
MAX_OUT = 7  # output cap the scheduler knows: min(max_tokens, max_len - prompt)
PREEMPTS = 8
SCHED = 9  # tokens scheduled in the step being formed (0 = not in the batch)
STATE = 10  # policies.result.State once DONE
REASON = 11  # policies.result.Reject
N_RI = 12

# -- rf rows: per-request floats ---------------------------------------------------------
FIRST_SCHED = 0
FIRST_TOKEN = 1
FINISH = 2
N_RF = 3

# -- g slots: run-wide integers ----------------------------------------------------------
CAP = 0  # GPU KV blocks
HEADROOM = 1  # blocks kept free when admitting
FREE = 2
USED = 3
PEAK = 4
HOST_FREE = 5
N_RUN = 6
N_WAIT = 7
N_DONE = 8
NEXT_ARRIVAL = 9  # index of the next request not yet arrived
WAIT_SCAN = 10  # max-wait scan position (requests in arrival order)
STEPS = 11
OUT_OF_RANGE = 12
PREFILL_TOKENS = 13
RESERVED_TOTAL = 14
QUEUE_SEQ = 15  # push counter giving FCFS keys
PREEMPTED_NOW = 16  # a preemption happened in the step being formed
SWAP_OUTS = 17
PRED_BIN = 18  # predicted mode: calibrated quantile bin, -1 before calibration
N_CALIBRATED = 19
RNG_SEED = 20  # counter-based RNG for stochastic features: (seed, counter)
RNG_COUNTER = 21
N_SAMPLES = 22
SAMPLE_K = 23  # index of the next series grid time
BUDGET = 24  # token budget left in the step being formed
N_BATCH = 25
B_TOKENS = 26  # batch aggregates handed to step_seconds
B_LOGITS = 27
B_DECODES = 28
B_KV_DECODE = 29
B_PAIRS = 30
B_PREFILL = 31  # prefill (non-decode) tokens in the batch
MAX_LEN = 32  # longest prompt + output a request may reach
# admission was stuck in the last formed step (pure decode, nothing admitted), with the
# snapshot that keeps it stuck: no request ended, none queued, free KV did not grow
STUCK = 33
STUCK_DONE = 34
STUCK_SEQ = 35
STUCK_FREE = 36
# speculative decoding: decode slots of this step, run counters, dspark_lagged's K pipe
SPEC_SLOTS = 37
SPEC_DECODES = 38  # decode slots of steps that could speculate
SPEC_VERIFIES = 39  # slots that verified at least one draft
SPEC_DRAFTED = 40  # draft tokens verified
SPEC_ACCEPTED = 41  # draft tokens accepted and kept
SPEC_LAG = 42  # two slots: K computed at steps of each parity
N_G = 44

# -- gf slots: run-wide floats -----------------------------------------------------------
T = 0  # clock, seconds on the trace clock
BUSY = 1
RATIO = 2  # new_token_ratio
SWAP_S = 3  # host<->GPU copy seconds added to the step being formed
SERIES_T0 = 4
SERIES_EVERY = 5
NTR_REM = 6  # new_token_ratio: tokens still admissible in the step being formed
DRAFT_S = 7  # drafting seconds of the step being formed
N_GF = 8

# -- counters returned to Python (out_counts) ----------------------------------------------
C_STEPS = 0
C_OUT_OF_RANGE = 1
C_PREFILL_TOKENS = 2
C_CAP = 3
C_PEAK = 4
C_SWAP_OUTS = 5
C_N_SAMPLES = 6
C_USED_END = 7  # KV blocks still held at the end (0 unless something leaked)
C_RESERVED_END = 8  # blocks still reserved at the end (0: no ghost reservations)
C_HOST_USED_END = 9
C_ERROR = 10  # 0, or an internal error code (the kernel could not make progress)
C_SPEC_DECODES = 11
C_SPEC_VERIFIES = 12
C_SPEC_DRAFTED = 13
C_SPEC_ACCEPTED = 14
N_COUNTS = 15
F_BUSY = 0
F_END = 1
N_FCOUNTS = 2

#: Series buffer rows; when full, every other sample is dropped and the spacing doubles.
SERIES_CAPACITY = 2048
#: predicted mode: output/max_tokens ratio histogram bins, and samples before trusting it.
CALIBRATION_BINS = 64
MIN_CALIBRATION = 8
#: new_token_ratio mode (SGLang): clip on a request's future tokens, decay steps, retract steps.
NTR_CLIP = 4096
NTR_DECAY_STEPS = 600
NTR_RETRACT_STEPS = 20
NTR_MIN_FACTOR = 0.14
NTR_INIT = 0.7
