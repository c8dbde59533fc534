"""Memory layout of one replica inside the kernel: named rows and slots, no objects.

Per-request values live in two field-major matrices indexed ``[FIELD, request]`` (each
row is one contiguous array, i.e. structure of arrays): ``ri`` for integers and ``rf``
for times. Index lists (running, batch, deadline heap, inbox) are the rows of ``lists``.
Run-wide scalars live in ``g`` (integers; its tail holds the predicted-mode histogram, the
step-time histogram and the fast-forward residues) and ``gf`` (floats). The read-only
trace columns are the rows of ``si`` (integers) and ``sf`` (floats) in
``engine.Statics``. Numba freezes these module constants into the compiled code, so a
name costs nothing at run time.
"""

from __future__ import annotations

from policies.result import STEP_HIST_BINS

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
CACHED_FIRST = 12  # prompt tokens from the prefix cache at first schedule
PC_REQ = 13  # four rows: the prefix cache's per-request rows (policies.prefix_cache R_*)
SAMPLED_AT = 17  # g[STEPS] after the step that sampled its last token (-1: none here)
N_RI = 18

# -- rf rows: per-request floats ---------------------------------------------------------
FIRST_SCHED = 0
FIRST_TOKEN = 1
FINISH = 2
DELIVERED = 3  # when the request reached this replica's inbox (its trace arrival when run alone)
SPEC_HITS = 4  # speculative (SmartSpec): the request's moving acceptance counts
SPEC_TRIALS = 5
N_RF = 6

# -- lists rows: index lists, i8[N_LISTS, n + 1] ------------------------------------------
L_RUN = 0  # running requests in admission order (g[N_RUN] of them)
L_ORDER = 1  # scratch copy of L_RUN while a step is formed (preemption edits L_RUN)
L_BATCH = 2  # requests of the step being formed (g[N_BATCH])
L_DHEAP = 3  # deadline heap (policies.waitqueue layout: slot 0 is the size)
L_INBOX = 4  # delivered requests in delivery order, a ring of n slots (g[INBOX_HEAD..N_DELIVERED])
L_QUEUE = 5  # two rows: the waiting queue's slot rows (policies.queues SLOT_REQ, POS)
L_OUTBOX = 7  # P/D: requests handed off and not yet taken by the fleet (g[N_OUTBOX])
N_LISTS = 8
L_SPEC = N_LISTS  # speculative per-slot rows follow when speculating (engine SP_*)

# -- fl rows: per-slot floats, f8[N_FL, n] ------------------------------------------------
FL_KEYS = 0  # two rows: the waiting queue's heap keys (policies.queues K1, K2)
N_FL = 2
FL_ALPHA = N_FL  # speculative (SmartSpec) acceptance estimate per slot, when speculating

# -- si rows: read-only per-request integers, i8[N_SI, n] ---------------------------------
S_PROMPT = 0
S_OUTPUT = 1  # true output length
S_MAX_TOKENS = 2
S_PRIORITY = 3
S_TENANT = 4
S_CLASS = 5  # SLO class
S_LANE = 6  # waiting-queue lane: (tenant, class)
S_N_FULL = 7  # full (cacheable) prefix hash blocks of the prompt
S_SPEC_ROW = 8  # speculative acceptance profile row
S_ADAPTER = 9  # LoRA adapter: its column in the adapter pool (policies.adapters), -1 = the base model
N_SI = 10

# -- sf rows: read-only per-request floats, f8[N_SF, n] -----------------------------------
S_ARRIVAL = 0
S_DEADLINE = 1  # absolute, NaN = none
S_MIN_SERVICE = 2  # lower bound on completion time (edf rejection)
S_JOB = 3  # predicted job length (sjf)
N_SF = 4
# -- Statics.lora: row 0 these parameters, rows 1.. costmodels.lora.LoRACost.grid -------------
LORA_BYTES_PER_RANK = 0  # GPU bytes of one adapter per unit of rank (0: the cost model has no LoRA cost)
LORA_DISK_BW = 1  # disk -> host bytes per second of adapter weights
LORA_ADAPTERS = 2  # distinct adapters the trace asks for

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
INBOX_HEAD = 9  # inbox position of the next delivered request not yet admitted or rejected
WAIT_SCAN = 10  # max-wait scan position (inbox positions, i.e. in delivery order)
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
LEFT_WAITING = 33  # requests still waiting after the last formed step
# speculative decoding: decode slots of this step, run counters, dspark_lagged's K pipe
SPEC_SLOTS = 37
SPEC_DECODES = 38  # decode slots of steps that could speculate
SPEC_VERIFIES = 39  # slots that verified at least one draft
SPEC_DRAFTED = 40  # draft tokens verified
SPEC_ACCEPTED = 41  # draft tokens accepted and kept
SPEC_LAG = 42  # two slots: K computed at steps of each parity (batch_schedule: requests the last step scheduled)
N_DELIVERED = 44  # requests delivered so far (inbox tail position)
CACHING = 45  # prefix caching on (1/0)
QUOTAS = 46  # some tenant quota or class budget binds: lanes may be blocked (1/0)
STUCK_MODES = 47  # a blocked waiting head stays blocked over a decode stretch under this config (1/0)
FAST_FORWARD = 48  # fast-forward pure-decode stretches (1/0)
ERROR = 49  # 0, or an internal error code (the kernel could not make progress)
HOST_CAP = 50  # host KV blocks
KV_BLOCK_SIZE = 51  # block_size of the config
ENTRY_BLOCKS = 52  # KV blocks per prefix-cache unit (policies.prefix_cache.unit_shape)
PC_STATS = 53  # policies.prefix_cache stats (N_STATS = 11 slots)
HAND_OFF = 64  # P/D prefill replica: a request leaves once it has sampled a token (1/0)
N_OUTBOX = 65  # requests in L_OUTBOX
UNSORTED = 66  # a delivery arrived before one delivered earlier (a fleet's re-route): 1/0
# progress guard (engine.replica._progress): advance's loop may iterate PROGRESS_BASE + PROGRESS_PER * progress times
ITERATIONS = 67  # iterations of advance's loop so far
ADVANCES = 68  # calls of advance (each may idle once, to its limit)
PROGRESS_BASE = 69
PROGRESS_PER = 70
PEAK_STEP = 71  # most tokens one step computed (its activation workspace: policies.workspace)
LORA = 72  # the adapter pool is on (enable_lora): 1/0
AD_STATE = 73  # policies.adapters state (N_STATE = 7 slots)
AD_BASE = 80  # pool column of a base-model request: the base column when it takes a slot, else -1
AD_LOADS = 81  # adapters loaded onto the GPU (the base column never counts)
AD_DISK_LOADS = 82  # ... of them read from disk first
AD_COLUMNS = 83  # adapter pool columns: the trace's adapters, and the base model's when it takes a slot
AD_POOL_ROW = 84  # first row of lists holding the pool (policies.adapters N_ROWS rows; LoRA only)
AD_SKIP_ROW = 85  # first row of fl holding (request, key1, key2) of requests skipped this round (LoRA only)
BATCH_WAITED = 86  # steps the waiting prompts have been held for the batch to fill (batch_wait_iters)
DP_HOLD = 87  # attention DP: this rank's waiting prompts are held this step (policies.engine.lockstep): 1/0
DP_WAITED = 88  # attention DP, on a group's first rank: steps prompts waited for every rank to have one
DP_BATCHED = 89  # ... and steps they waited beside every rank's decodes
GHOSTS = 90  # async scheduling: finished requests still holding their seat and KV (engine.pipeline)
# prefix caching by vLLM's rules (1/0): a block is cached as soon as it is scheduled, and a
# request's blocks past its entries stay cached when it lets go (prefix_cache.keep_tail)
VLLM_CACHE = 91
UNIT_TOKENS = 92  # prompt tokens per prefix-cache unit (policies.prefix_cache.unit_shape)
PER_ENTRY = 93  # prefix-cache units per hash block (ibid.)
N_G = 94
#: predicted mode: output/max_tokens ratio histogram bins (in g's tail, below).
CALIBRATION_BINS = 64
# g's tail: the predicted-mode histogram, the step-time histogram (policies.result
# STEP_HIST_*), then the fast-forward residues (block_size slots)
G_HIST = N_G
G_STEP_HIST = G_HIST + CALIBRATION_BINS
G_RESIDUES = G_STEP_HIST + STEP_HIST_BINS

# -- gf slots: run-wide floats -----------------------------------------------------------
T = 0  # clock, seconds on the trace clock
BUSY = 1
RATIO = 2  # new_token_ratio
SWAP_S = 3  # host<->GPU copy seconds added to the step being formed
SERIES_T0 = 4
SERIES_EVERY = 5
NTR_REM = 6  # new_token_ratio: tokens still admissible in the step being formed
DRAFT_S = 7  # drafting seconds of the step being formed
KV_BYTES = 8  # KV bytes per token of this replica's model
SWAP_BW = 9  # host<->GPU copy bytes per second
PREFIX_HIT = 10  # prefix cache: prompt tokens hit over every lookup
PREFIX_QUERY = 11  # prompt tokens looked up
PREFIX_SAVED_S = 12  # lone-prefill seconds the hits saved
SPEC_EST = 13  # two slots: speculative run-wide acceptance counts (hits, trials)
NEXT_DELIVERY = 15  # delivery time of the inbox head (inf when the inbox is empty)
PEAK_STEP_S = 16  # start of the first step that computed PEAK_STEP tokens
AD_LOAD_S = 17  # seconds of adapter loads so far (each added to the step that needed it)
AD_BYTES = 18  # GPU bytes of one adapter slot at the config's rank
AD_DISK_BW = 19  # disk -> host bytes per second of adapter weights
PIPELINE_T = 20  # async scheduling: start of the step in flight, whose arrivals the next formation sees; NaN when none
N_GF = 21

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
C_ITERATIONS = 15  # iterations of advance's loop (the progress guard's count)
C_RUNNING_END = 16  # requests running, queued and ended at the end (0, 0, all delivered unless the
C_WAITING_END = 17  # run stopped on an error)
C_ENDED_END = 18
C_PEAK_STEP = 19  # most tokens one step computed (the max over replicas and incarnations)
C_AD_LOADS = 20  # adapter loads onto the GPU, and those of them read from disk first
C_AD_DISK_LOADS = 21
C_STEP_HIST = 22  # STEP_HIST_BINS slots: steps per step-time bin (summed like the counters)
N_COUNTS = C_STEP_HIST + STEP_HIST_BINS
F_BUSY = 0
F_END = 1
F_PEAK_STEP_S = 2  # start of the first step that computed C_PEAK_STEP tokens (NaN: no step)
F_AD_LOAD_S = 3  # seconds the adapter loads added to steps
N_FCOUNTS = 4

#: Series buffer rows; when full, every other sample is dropped and the spacing doubles.
SERIES_CAPACITY = 2048
#: predicted mode: samples before trusting the histogram.
MIN_CALIBRATION = 8
#: new_token_ratio mode (SGLang): clip on a request's future tokens, decay steps, retract steps.
NTR_CLIP = 4096
NTR_DECAY_STEPS = 600
NTR_RETRACT_STEPS = 20
NTR_MIN_FACTOR = 0.14
NTR_INIT = 0.7
