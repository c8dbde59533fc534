"""Plain-Python reference simulator: the engine's rules, written for reading, not speed.

It follows the rules stated in ``policies.engine``'s docstring one step at a time with
ordinary objects and lists (no fast-forward, no heaps, no packed state), so agreement
with the kernel on random traces checks the kernel's bookkeeping, not a shared bug in a
shared helper. Only ``step_seconds`` (the cost model's lookup) is shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodels.steptable import step_seconds
from policies.config import SPECULATIVE_MODES
from policies.kernel_state import (
    CALIBRATION_BINS,
    MIN_CALIBRATION,
    NTR_CLIP,
    NTR_DECAY_STEPS,
    NTR_INIT,
    NTR_MIN_FACTOR,
    NTR_RETRACT_STEPS,
)
from policies.result import Reject, State
from policies.speculative import (
    MODE_ADAPTIVE,
    MODE_BATCH_SCHEDULE,
    MODE_DSPARK,
    MODE_DSPARK_LAGGED,
    MODE_OFF,
    MODE_SMARTSPEC,
    MODE_SPS_CAP_ACCEPT,
    MODE_SPS_TABLE,
    SPS_TABLE_CONTEXT,
    AcceptanceModel,
)

from . import reference_speculative as rspec
from .reference_sharing import (
    LPM_FCFS_ABOVE,
    RefPrefixCache,
    RefShares,
    dfs_weight_order,
    order_keys,
    private_blocks,
)

ORDERS = ("fcfs", "priority", "edf", "sjf", "lpm", "vtc", "lof", "dfs_weight")


@dataclass
class Req:
    id: int
    arrival: float
    prompt: int
    output: int
    max_tokens: int
    priority: int
    deadline: float
    tenant: int = 0
    klass: int = 0
    min_service: float = 0.0
    job: float = 0.0
    status: str = "new"  # new, waiting, running, done
    computed: int = 0
    generated: int = 0
    held: int = 0
    host: int = 0
    reserved: int = 0
    target: int = 0
    max_out: int = 0
    preempts: int = 0
    scheduled: int = 0
    key: tuple = ()
    first_sched: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    state: int = -1
    reason: int = 0
    cached_first: int = 0
    sampled_at: int = -1  # steps taken when it last sampled a token here


def blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class Reference:
    def __init__(self, trace, cost, config, cap_blocks: int, host_blocks: int, tenant_params=None, class_params=None,
                 acceptance=None, seed: int = 0):
        self.c = config
        self.tables = cost.tables
        self.kv_bytes = cost.kv_bytes_per_token
        self.swap_bw = cost.swap_bytes_per_s
        self.bs = config.block_size
        self.cap = cap_blocks
        self.headroom = int(config.kv_headroom * cap_blocks)
        self.free = cap_blocks
        self.peak = 0
        self.host_free = host_blocks
        max_len = config.max_model_len if config.max_model_len > 0 else cap_blocks * self.bs
        if not config.enable_chunked_prefill:
            max_len = min(max_len, config.max_num_batched_tokens)
        self.max_len = max_len
        self.reqs = [
            Req(i, float(trace.arrival_s[i]), int(trace.prompt_tokens[i]), int(trace.output_tokens[i]),
                int(trace.max_tokens[i]), int(trace.priority[i]), float(trace.deadline_s[i]),
                int(trace.tenant[i]), int(trace.slo_class[i]))
            for i in range(trace.n)
        ]
        for r in self.reqs:  # lone prefill, plus lone decodes up to the output estimate (queues.service_estimates)
            p = r.prompt
            r.min_service = step_seconds(self.tables, p, 1, 0, 0, p * (p + 1) / 2.0)[0]
            estimate = int(trace.output_estimate[r.id])  # the scheduler's guess, never the true length
            r.job = r.min_service + (estimate - 1) * step_seconds(self.tables, 1, 1, 1, p, 0.0)[0]
        # sharing: prefix cache, queue order, tenant ledger, quotas
        self.order = ORDERS.index(config.scheduling_policy)
        self.caching = config.enable_prefix_caching
        offsets, keyed = trace.block_offsets, trace.cache_block_hashes  # salted, as the engine keys them
        hashes = [keyed[offsets[i]:offsets[i + 1]].tolist() if self.caching else []
                  for i in range(trace.n)]
        # vLLM caches each KV block as it is scheduled, keeps copies, and keeps a request's
        # blocks past its prefix cached for its readmission; SGLang does none of these
        self.vllm_cache = (self.caching and config.schedule_mode != "prefill_first"
                         and trace.block_tokens % self.bs == 0)
        self.cache = RefPrefixCache(hashes, [r.prompt for r in self.reqs], trace.block_tokens, self.bs,
                                    keep_copies=self.vllm_cache)
        self.n_classes = len(trace.slo_class_names)
        if tenant_params is None:
            tenant_params = np.ones((len(trace.tenant_names), 3))
            class_params = np.tile([0.0, 1.0, 1.0], (self.n_classes, 1))
        self.tp, self.cp = tenant_params, class_params
        self.shares = RefShares(list(tenant_params[:, 0]))
        self.quotas = bool((tenant_params[:, 1:] < 1).any() or (class_params[:, 0] > 0).any()
                           or (class_params[:, 1:] < 1).any())
        self.tenant_kv = [0] * len(tenant_params)
        self.class_kv = [0] * self.n_classes
        self.hit_tokens = self.query_tokens = 0
        self.saved_s = 0.0
        self.inbox: list[tuple[float, Req]] = []  # delivered, not yet arrived: (time, request), in time order
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.seq = 0
        self.reserved_total = 0
        self.init_ratio = min(NTR_INIT * config.schedule_conservativeness, 1.0)
        self.ratio = self.init_ratio
        self.hist = [0] * CALIBRATION_BINS
        self.n_calibrated = 0
        self.pred_bin = -1
        self.t = self.reqs[0].arrival
        # async scheduling: the start of the step in flight (None: none), whose arrivals the
        # next formation sees; ended requests whose last token was in flight keep their seat
        # and KV until the next step is formed (status "done", still in ``running``)
        self.in_flight: float | None = None
        self.steps = 0
        self.batch_waited = 0  # steps the waiting prompts were held for the batch to fill
        self.dp_hold = False  # attention DP: the group holds this rank's new prompts this step
        self.busy = 0.0
        self.prefill_tokens = 0
        self.out_of_range = 0
        self.swap_outs = 0
        self.peak_step, self.peak_step_s = 0, math.nan  # most tokens one step computed, and when first
        # speculative decoding
        self.spec_mode = SPECULATIVE_MODES.index(config.speculative_mode)
        model = acceptance if acceptance is not None else AcceptanceModel()
        self.profiles, self.profile_rows = model.arrays(trace, config.num_speculative_tokens)
        self.spread, self.bias, self.seed = model.spread, model.bias, seed
        self.counts = rspec.AcceptanceCounts()
        self.lag = [0, 0]
        self.prev_scheduled = 0  # batch_schedule: requests the last step scheduled
        self.spec = {"decodes": 0, "verifies": 0, "drafted": 0, "accepted": 0}
        # fleet hooks (tests/policies/reference_fleet.py): a P/D prefill replica hands each
        # request off once it has sampled a token; admissions are reported when asked
        self.hand_off = False
        self.handoffs: list[tuple[int, float, dict]] = []  # (request, step end, what it carries)
        self.admitted: list[int] | None = None

    # -- bookkeeping -----------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.cap - self.free

    def hold(self, r: Req, delta: int) -> None:
        r.held += delta
        self.tenant_kv[r.tenant] += delta
        self.class_kv[r.klass] += delta

    def need(self, r: Req, ctx: int, held: int, idle_blocks: int = 0) -> int:
        """Blocks r must add to hold ctx tokens while referencing ``held`` cached entries."""
        c = self.cache
        after = max(held, min(c.n_full[r.id], ctx // c.bt))
        return private_blocks(ctx, after, c.bt, self.bs) + c.entry_blocks * (after - held) + idle_blocks - r.held

    def take(self, r: Req, n_blocks: int) -> None:
        short = n_blocks - (self.free - self.cache.cache_blocks()[1])
        if short > 0:
            self.cache.evict(short)
        self.free -= n_blocks
        self.hold(r, n_blocks)
        assert self.free >= 0, "KV over capacity"
        self.peak = max(self.peak, self.used)
        if self.c.admission_mode in ("reservation", "predicted") and r.held > r.reserved:
            self.reserved_total += r.held - r.reserved
            r.reserved = r.held

    def end(self, r: Req, state: State, reason: Reject, t_end: float) -> None:
        if r.status == "done":
            return
        if r.status == "running":
            self.running.remove(r)
            self.reserved_total -= r.reserved
            r.reserved = 0
        elif r.status == "waiting":
            self.waiting.remove(r)
            self.shares.dequeue(r.tenant)
        self.free_gpu(r, True)
        self.host_free += r.host
        r.host = 0
        r.status = "done"
        r.state, r.reason, r.finish = int(state), int(reason), t_end

    def end_by_deadline(self, r: Req) -> None:
        state = State.TIMED_OUT if r.first_token <= r.deadline else State.CANCELLED
        self.end(r, state, Reject.NONE, r.deadline)
        if state == State.CANCELLED:  # a token produced after the client left reached nobody
            r.first_token, r.generated = math.nan, 0

    def free_gpu(self, r: Req, drop_refs: bool, in_flight: bool = False) -> None:
        if drop_refs and self.vllm_cache:
            self.cache.keep_tail(r.id, self.tail_full_blocks(r, in_flight))
        self.free += r.held
        self.hold(r, -r.held)
        if drop_refs:
            self.hold_copies(r, -self.cache.copies[r.id])
            self.free += self.cache.release(r.id)  # its copies too

    def tail_full_blocks(self, r: Req, in_flight: bool) -> int:
        """Full blocks of r's known tokens computed past the prefix units it holds (a decode in
        flight computed a token vLLM had not seen when it scheduled it)."""
        c = self.cache
        known = min(r.computed, r.prompt + r.generated) - (in_flight and r.computed > r.prompt)
        return min(max(0, known // self.bs - c.held[r.id] * c.bt // self.bs), r.held)

    def lookup(self, r: Req) -> tuple[int, int, int, int]:
        """(entries cached whole, cached tokens, their idle blocks, blocks r takes as its own:
        the head of a partly evicted entry, or its own run); with own runs whole blocks over
        the prompt and the generated tokens, at least one token left."""
        c = self.cache
        held, cached, idle = c.match(r.id, r.prompt + r.generated)
        take = c.partial_blocks(r.id, held)
        prefix = held * c.bt
        if not self.vllm_cache:
            return held, min(prefix + take * self.bs, r.prompt - 1), idle, take
        if held == c.n_full[r.id]:
            take = c.own_blocks(r.id)
        cap = (r.prompt + r.generated - 1) // self.bs
        take = max(0, min(take, cap - prefix // self.bs))
        return held, min(prefix // self.bs + take, cap) * self.bs, idle, take

    def enqueue(self, r: Req, in_front: bool) -> None:
        self.seq += 1
        seq = -self.seq if in_front else self.seq
        r.key = order_keys(self.order, seq, r.arrival, r.priority, r.deadline, r.job, self.c.aging_rate, r.max_out)
        r.status = "waiting"
        self.waiting.append(r)
        self.shares.enqueue(r.tenant)

    def head(self, blocked: set) -> Req | None:
        live = [r for r in self.waiting if (r.tenant, r.klass) not in blocked]
        if not live:
            return None
        cache_aware = self.order == ORDERS.index("lpm") and len(self.waiting) <= LPM_FCFS_ABOVE

        def rank(r):
            counter = self.shares.counter[r.tenant] if self.order == ORDERS.index("vtc") else 0.0
            matched = self.cache.match(r.id, r.prompt)[1] if cache_aware else 0
            return (counter, -matched, *r.key, r.id)

        return min(live, key=rank)

    # -- boundary events -------------------------------------------------------------
    def max_out(self, r: Req) -> int:
        return min(r.max_tokens, self.max_len - r.prompt)

    def exceeds_capacity(self, r: Req, max_out: int) -> bool:
        """r (up to max_out tokens out) could never run here, not even alone."""
        c, bs = self.c, self.bs
        if r.prompt >= self.max_len:
            return True
        limit = self.cap - self.headroom
        if self.need(r, r.prompt + max_out - 1, 0) > limit:
            return True
        if c.admission_mode in ("reservation", "predicted") and blocks(r.prompt + max_out, bs) > limit:
            return True
        return c.admission_mode == "new_token_ratio" and r.prompt + max_out >= limit * bs

    def never_admits(self, i: int) -> bool:
        """Request i, never delivered here, would be rejected EXCEEDS_CAPACITY on arrival."""
        r = self.reqs[i]
        return self.exceeds_capacity(r, self.max_out(r))

    def arrival_reason(self, r: Req, t: float) -> Reject:
        c = self.c
        if self.exceeds_capacity(r, r.max_out):
            return Reject.EXCEEDS_CAPACITY
        if c.reject_unmeetable_deadline and not math.isnan(r.deadline):
            p = r.prompt
            alone, _ = step_seconds(self.tables, p, 1, 0, 0, p * (p + 1) // 2)
            if t + alone > r.deadline:
                return Reject.DEADLINE_UNMEETABLE
        if c.max_queue_len > 0 and len(self.waiting) >= c.max_queue_len:
            return Reject.QUEUE_FULL
        if c.kv_high_water < 1.0 and self.used >= c.kv_high_water * self.cap:
            return Reject.KV_HIGH_WATER
        return Reject.NONE

    def arrive(self) -> None:
        seen = self.t if self.in_flight is None or not self.c.async_scheduling else self.in_flight
        while self.inbox and self.inbox[0][0] <= seen:
            r = self.inbox.pop(0)[1]
            r.max_out = self.max_out(r)
            r.target = max(1, min(r.output, r.max_out))
            reason = self.arrival_reason(r, seen)
            if reason != Reject.NONE:
                self.end(r, State.REJECTED, reason, seen)
            else:
                self.enqueue(r, False)

    def expire(self) -> None:
        live = [r for r in self.waiting + self.running if r.deadline <= self.t and r.status != "done"]
        for r in sorted(live, key=lambda r: (r.deadline, r.id)):
            self.end_by_deadline(r)
        if self.c.max_wait_s > 0:
            for r in list(self.waiting):
                if math.isnan(r.first_sched) and self.t - r.arrival > self.c.max_wait_s:
                    if self.c.max_wait_action == "admit_first":
                        r.key = (-math.inf, r.key[1])
                    else:
                        self.end(r, State.REJECTED, Reject.MAX_WAIT, self.t)

    # -- the batch -------------------------------------------------------------------
    def is_decode(self, r: Req, n: int) -> bool:
        return n == 1 and r.generated >= 1 and r.computed == r.prompt + r.generated - 1

    def batch_parts(self):
        """(tokens, logit seqs, decodes, KV read by decodes, prefill pairs, prefill tokens)."""
        parts = [0, 0, 0, 0, 0, 0]
        for r in self.batch:
            n = r.scheduled
            if n == 0:
                continue
            parts[0] += n
            if r.computed + n == r.prompt + r.generated:
                parts[1] += 1
            if self.is_decode(r, n):
                parts[2] += 1
                parts[3] += r.computed + 1
            else:
                parts[4] += n * r.computed + n * (n + 1) // 2
                parts[5] += n
        return parts

    def fits_cap(self, r: Req, n: int, cap_s: float) -> bool:
        r.scheduled, saved = n, r.scheduled
        extra = r not in self.batch
        if extra:
            self.batch.append(r)
        p = self.batch_parts()
        if extra:
            self.batch.pop()
        r.scheduled = saved
        seconds, _ = step_seconds(self.tables, p[0], p[1], p[2], p[3], p[4])
        return seconds + self.swap_s <= cap_s

    def fit_step_cap(self, r: Req, n: int, may_split: bool) -> int:
        cap_s = self.c.step_time_cap_ms * 1e-3
        if cap_s <= 0.0 or self.is_decode(r, n):
            return n
        if may_split:
            lo, hi = 0, n
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.fits_cap(r, mid, cap_s):
                    lo = mid
                else:
                    hi = mid - 1
            allowed = lo
        else:
            allowed = n if self.fits_cap(r, n, cap_s) else 0
        if allowed == 0 and self.batch_parts()[0] == 0:
            allowed = 1 if may_split else n
        return allowed

    def charge_prefill(self, r: Req, n: int, sign: int) -> None:
        if self.c.fairness_cost_unit == "tokens" and not self.is_decode(r, n):
            self.shares.charge(r.tenant, sign * self.c.vtc_input_weight * n)

    def schedule(self, r: Req, n: int) -> None:
        self.take(r, self.need(r, r.computed + n, self.cache.held[r.id]))
        self.charge_prefill(r, n, 1)
        self.tenant_tokens[r.tenant] += n
        self.class_tokens[r.klass] += n
        r.scheduled = n
        self.batch.append(r)
        self.budget -= n
        if self.vllm_cache and self.cache.held[r.id] < self.cache.n_full[r.id]:
            self.cache_prompt_blocks(r, r.computed + n)  # vLLM caches blocks as they are scheduled

    def cache_prompt_blocks(self, r: Req, ctx: int) -> None:
        """Enter r's full prompt blocks by ctx tokens; a block another request holds is freed,
        or (vLLM) kept as r's copy until r lets go."""
        copies = self.cache.copies[r.id]
        self.free += self.cache.insert(r.id, ctx)
        self.hold_copies(r, self.cache.copies[r.id] - copies)
        self.hold(r, private_blocks(ctx, self.cache.held[r.id], self.cache.bt, self.bs) - r.held)

    def hold_copies(self, r: Req, delta: int) -> None:
        self.tenant_kv[r.tenant] += delta
        self.class_kv[r.klass] += delta

    def pick_victim(self) -> Req:
        mode = self.c.preemption_victim
        if mode == "newest":
            return self.running[-1]
        if mode == "lowest_priority":  # vLLM: max(running, key=(priority, arrival)), the first of equals
            return min(self.running, key=lambda r: (r.priority, -r.arrival))
        return min(self.running, key=lambda r: (self.committed(r), -r.prompt, -r.id))

    def in_flight_token(self, r: Req) -> bool:
        """Async scheduling: r's last token came from the step just ended, unseen as this one is formed."""
        return self.c.async_scheduling and r.sampled_at == self.steps

    def committed(self, r: Req) -> int:
        return r.generated - self.in_flight_token(r)

    def preempt(self, v: Req) -> None:
        self.preempted_now = True
        if v.scheduled > 0:
            self.charge_prefill(v, v.scheduled, -1)
            self.tenant_tokens[v.tenant] -= v.scheduled
            self.class_tokens[v.klass] -= v.scheduled
            self.budget += v.scheduled
            v.scheduled = 0
            keep = private_blocks(v.computed, self.cache.held[v.id], self.cache.bt, self.bs)
            self.free += v.held - keep
            self.hold(v, keep - v.held)
        if v.status == "done":  # ended, lingering: only its seat and KV go
            v.preempts += 1
            self.release(v)
            return
        if self.c.max_preemptions > 0 and v.preempts >= self.c.max_preemptions:
            self.end(v, State.REJECTED, Reject.MAX_PREEMPTIONS, self.t)
            return
        v.preempts += 1
        swap = False
        mode = self.c.preemption_mode
        # only private KV swaps: a request referencing cached prefix blocks is recomputed
        if mode != "recompute" and v.held > 0 and self.host_free >= v.held and self.cache.held[v.id] == 0:
            copy_s = v.held * self.bs * self.kv_bytes / self.swap_bw
            if mode == "swap":
                swap = True
            else:
                c = v.computed
                recompute_s, _ = step_seconds(self.tables, c, 1, 0, 0, c * (c + 1) // 2)
                swap = 2.0 * copy_s < recompute_s
                # a client leaving before the victim can return would make the copy out a waste
                if swap and not math.isnan(v.deadline):
                    swap = self.t + copy_s + self.return_wait_s(v, v.held) < v.deadline
            if swap:
                self.host_free -= v.held
                v.host = v.held
                self.swap_s += copy_s
                self.swap_outs += 1
        # before its progress is reset: vLLM keeps the blocks it computed
        self.free_gpu(v, not swap, self.in_flight_token(v))
        if not swap:
            v.computed = 0
            # SGLang's overlap loop (prefill-first) throws a retracted request's token in flight away
            if self.c.schedule_mode == "prefill_first" and self.in_flight_token(v):
                v.generated -= 1
                v.sampled_at = -1
                if v.generated == 0:
                    v.first_token = math.nan
        self.running.remove(v)
        self.reserved_total -= v.reserved
        v.reserved = 0
        self.enqueue(v, True)

    def return_wait_s(self, v: Req, need: int) -> float:
        """Seconds until the running batch but v frees ``need`` blocks: each running request
        frees its blocks over the decode steps left to its cap, at today's decode step time."""
        others = [r for r in self.running if r is not v]
        rate = 0.0
        for r in others:
            rate += r.held / max(1, r.max_out - r.generated)
        if rate <= 0.0:
            return math.inf
        k, kv = len(others), sum(r.computed for r in others)
        dt, _ = step_seconds(self.tables, k, k, k, kv, 0)
        return need / rate * dt

    def schedule_running(self, r: Req, n: int) -> None:
        while self.need(r, r.computed + n, self.cache.held[r.id]) > self.free:
            v = self.pick_victim()
            self.preempt(v)
            if v is r:
                return
        self.schedule(r, n)

    def reservation_blocks(self, r: Req) -> int:
        if self.c.admission_mode == "predicted":
            out = r.max_out
            if self.pred_bin >= 0:
                out = ((self.pred_bin + 1) * r.max_out + CALIBRATION_BINS - 1) // CALIBRATION_BINS
            return max(blocks(r.prompt + out, self.bs), blocks(r.prompt + r.generated, self.bs))
        return blocks(r.prompt + r.max_out, self.bs)

    def admissible(self, r: Req, held: int, idle_blocks: int) -> bool:
        if self.free - self.need(r, r.prompt + r.generated, held, idle_blocks) < self.headroom:
            return False
        mode = self.c.admission_mode
        if mode in ("reservation", "predicted"):
            return self.reserved_total + self.reservation_blocks(r) <= self.cap - self.headroom
        if mode == "new_token_ratio":
            total = r.prompt + r.generated - r.computed + min(r.max_out - r.generated, NTR_CLIP)
            if total >= self.ntr_rem:
                return False
            self.ntr_rem -= total
        return True

    def start(self, r: Req) -> None:
        self.waiting.remove(r)
        r.status = "running"
        self.running.append(r)
        if math.isnan(r.first_sched):
            r.first_sched = self.t
        if r.host > 0:
            self.swap_s += r.host * self.bs * self.kv_bytes / self.swap_bw
            self.host_free += r.host
            r.host = 0
        if self.c.admission_mode in ("reservation", "predicted"):
            r.reserved = self.reservation_blocks(r)
            self.reserved_total += r.reserved
        if self.admitted is not None:
            self.admitted.append(r.id)

    def over_quota(self, r: Req, first_blocks: int, n: int) -> bool:
        """Tenant quota or class budget binds (only once the tenant / class holds something)."""
        budget = self.c.max_num_batched_tokens
        t, k = r.tenant, r.klass
        if ((self.tenant_kv[t] > 0 and self.tenant_kv[t] + first_blocks > int(self.tp[t, 1] * self.cap))
                or (self.tenant_tokens[t] > 0 and self.tenant_tokens[t] + n > int(self.tp[t, 2] * budget))):
            return True
        return ((self.class_kv[k] > 0 and self.class_kv[k] + first_blocks > int(self.cp[k, 1] * self.cap))
                or (self.class_tokens[k] > 0 and self.class_tokens[k] + n > int(self.cp[k, 2] * budget))
                or (len(self.running) > 0 and self.free - first_blocks < self.cp[k, 0] * self.cap))

    def admit_waiting(self, prefill_first: bool) -> None:
        c = self.c
        rem_input = c.max_prefill_tokens - self.batch_parts()[5]
        if c.admission_mode == "new_token_ratio":
            future = sum(min(r.max_out - self.committed(r), NTR_CLIP) for r in self.running)
            self.ntr_rem = (self.free - self.headroom) * self.bs - self.ratio * future
        blocked: set = set()
        cache = self.cache
        if (self.order == ORDERS.index("dfs_weight") and self.caching and len(self.running) < c.max_num_seqs
                and self.budget > 0):  # sorted once per round that may admit, as SGLang
            by_id = {r.id: r for r in self.waiting}
            order = dfs_weight_order(cache, list(by_id), key=lambda i: (*by_id[i].key, i))
            for pos, i in enumerate(order):
                if by_id[i].key[0] != -math.inf:  # promoted (admit_first) stay ahead
                    by_id[i].key = (float(pos - len(order)), by_id[i].key[1])
        while len(self.running) < c.max_num_seqs and self.budget > 0:
            r = self.head(blocked)
            if r is None:
                break
            if (c.scheduling_policy == "edf" and math.isnan(r.first_sched) and not math.isnan(r.deadline)
                    and self.t + r.min_service + c.deadline_margin_ms * 1e-3 > r.deadline):
                self.end(r, State.REJECTED, Reject.DEADLINE_UNMEETABLE, self.t)
                continue
            held, cached, idle, own = cache.held[r.id], 0, 0, 0
            lookup = self.caching and r.computed == 0 and r.host == 0
            if lookup:
                held, cached, idle, own = self.lookup(r)
                r.computed = cached
            n = r.prompt + r.generated - r.computed
            if 0 < self.long_prefill < n:
                n = self.long_prefill
            stop = (prefill_first and n > rem_input and self.batch_parts()[0] > 0) or (
                not c.enable_chunked_prefill and n > self.budget)
            if not stop:
                n = min(n, self.budget)
                n = self.fit_step_cap(r, n, c.enable_chunked_prefill)
                if n > 0 and self.quotas and self.over_quota(r, self.need(r, r.computed + n, held, idle), n):
                    if lookup:
                        r.computed = 0
                    blocked.add((r.tenant, r.klass))
                    continue
                stop = n == 0 or not self.admissible(r, held, idle)
            if stop:
                if lookup:
                    r.computed = 0
                break
            self.shares.dequeue(r.tenant)
            if lookup:
                if held > 0:
                    idle = cache.acquire(r.id, held)  # match's count, unless a hash repeats in the chain
                cache.take_partial(r.id, held)
                if self.vllm_cache:
                    cache.take_own(r.id)
                self.hold(r, own)
                self.free -= idle + own
                self.peak = max(self.peak, self.used)
                self.hit_tokens += cached
                self.query_tokens += r.prompt
                if math.isnan(r.first_sched):
                    r.cached_first = cached
                if cached > 0:
                    full = cached + n
                    without = step_seconds(self.tables, full, 0, 0, 0, full * (full + 1) // 2)[0]
                    with_cache = step_seconds(self.tables, n, 0, 0, 0, n * cached + n * (n + 1) // 2)[0]
                    self.saved_s += without - with_cache
            self.start(r)
            self.schedule(r, n)
            rem_input -= n

    def batch_wait_over(self) -> bool:
        """TensorRT-LLM's batch waiting: may the waiting requests start beside the running ones?"""
        c, tokens = self.c, self.batch_parts()[0]
        if c.batch_wait_iters <= 0 or c.batch_wait_token_ratio <= 0 or tokens == 0:
            return True
        left = sum(r.prompt + r.generated - r.computed for r in self.waiting)
        if (self.batch_waited >= c.batch_wait_iters
                or tokens + min(left, self.budget) >= c.batch_wait_token_ratio * c.max_num_batched_tokens):
            self.batch_waited = 0
            return True
        self.batch_waited += 1
        return False

    def form_batch(self) -> None:
        c = self.c
        prefill_first = c.schedule_mode == "prefill_first"
        self.batch: list[Req] = []
        self.budget = c.max_num_batched_tokens
        self.preempted_now = False
        self.swap_s = 0.0
        self.tenant_tokens = [0] * len(self.tp)
        self.class_tokens = [0] * self.n_classes
        # vLLM 0.33 (v1/core/sched/scheduler.py:754-763): the long-prefill threshold holds
        # only when more than one request runs or waits as schedule() starts
        eligible = len(self.running) + len(self.waiting)
        self.long_prefill = c.long_prefill_token_threshold if eligible > 1 else 0
        for r in list(self.running):
            if self.budget <= 0:
                break
            # a lingering request that stopped short of its cap (EOS) decodes once more, in vain
            if r.status != "running" and not (r in self.running and r.target < r.max_out):
                continue
            n = r.prompt + r.generated - r.computed
            if prefill_first and self.is_decode(r, n):
                continue
            if 0 < self.long_prefill < n:
                n = self.long_prefill
            n = min(n, self.budget)
            n = self.fit_step_cap(r, n, True)
            if n > 0:
                self.schedule_running(r, n)
        if not self.preempted_now and not self.dp_hold and (not self.waiting or self.batch_wait_over()):
            self.admit_waiting(prefill_first)
        if prefill_first and self.batch_parts()[0] == 0:
            decoders = [r for r in self.running if r.status == "running" or r.target < r.max_out]
            ending = [r for r in self.running if r.status == "done" and r.target == r.max_out]
            need = sum(self.need(r, r.computed + 1, self.cache.held[r.id]) for r in decoders)
            if ending and need > self.free:
                decoders = []  # SGLang waits for the ending requests' KV rather than retract
            for r in decoders:
                if r.status == "running" or (r in self.running and r.status == "done"):
                    self.schedule_running(r, 1)
        if self.preempted_now and c.admission_mode == "new_token_ratio":
            if self.running:
                decoded = sum(r.generated for r in self.running)
                max_new = sum(r.max_out for r in self.running)
                self.ratio = min(1.0, (decoded + NTR_RETRACT_STEPS * len(self.running)) / max_new)
            else:
                self.ratio = self.init_ratio

    # -- speculative decoding --------------------------------------------------------
    def plan_verify(self, p) -> tuple[list, list, int, float]:
        """Verify budgets of the batch's decodes from what the formed batch left:
        (slots, drafts per slot, verify tokens, drafting seconds)."""
        c, bs, bt = self.c, self.bs, self.cache.bt
        slots = [r for r in self.batch if r.scheduled == 1 and r.status == "running" and self.is_decode(r, 1)]
        if not slots:
            return [], [], 0, 0.0
        gamma = c.num_speculative_tokens
        lim = [max(0, min(gamma, r.max_out - r.generated - 1)) for r in slots]
        slack = [self.cache.held[r.id] * bt + r.held * bs - r.computed - 1 for r in slots]
        surv = [[0.0] * gamma for _ in slots]
        if self.spec_mode in (MODE_DSPARK, MODE_DSPARK_LAGGED):
            surv = [rspec.survival(self.profiles[self.profile_rows[r.id]], self.seed, r.id, r.generated, gamma,
                                   self.spread, self.bias) for r in slots]
        alpha = [self.counts.alpha(r.id) for r in slots]
        n = len(slots)
        draft_pp = rspec.draft_per_position(self.tables, c.speculative_draft_cost_mode, c.speculative_draft_cost,
                                            n, p[3])
        # every decode's whole draft window is allocated first, evicting idle cached blocks for it
        short = sum(-(-max(0, m - sl) // bs) for m, sl in zip(lim, slack, strict=True)) - (
            self.free - self.cache.cache_blocks()[1])
        if short > 0:
            self.cache.evict(short)
        free_blocks = max(0, self.free - self.cache.cache_blocks()[1])
        if self.spec_mode in (MODE_ADAPTIVE, MODE_SPS_TABLE, MODE_SPS_CAP_ACCEPT):
            ell, x, charged, positions = self.engine_budgets(slots, lim, slack, free_blocks, draft_pp, p)
        else:
            k_fixed = gamma
            if self.spec_mode == MODE_BATCH_SCHEDULE:
                k_fixed = rspec.schedule_k(gamma, c.speculative_batch_2, c.speculative_k_2, c.speculative_batch_3,
                                           c.speculative_k_3, self.prev_scheduled)
            lag = self.steps % 2
            ell, x, _, positions, self.lag[lag], _ = rspec.verify_budgets(
                self.spec_mode, gamma, k_fixed, surv, alpha, lim, self.tables, tuple(p[:5]), draft_pp, self.budget,
                slack, free_blocks, bs, self.lag[lag])
            charged = x
        for r, m in zip(slots, ell, strict=True):
            if m:
                take = private_blocks(r.computed + 1 + m, self.cache.held[r.id], bt, bs) - r.held
                self.free -= take
                self.hold(r, take)
                self.spec["verifies"] += 1
        self.peak = max(self.peak, self.used)
        self.budget -= charged
        self.spec["decodes"] += n
        self.spec["drafted"] += x
        return slots, ell, x, positions * draft_pp

    def engine_budgets(self, slots, lim, slack, free_blocks, draft_pp, p):
        """adaptive_verify / sps_table / sps_cap_accept: (ell, verify tokens, tokens charged, drafted positions)."""
        c, gamma = self.c, self.c.num_speculative_tokens
        adaptive = self.spec_mode == MODE_ADAPTIVE
        scheduled, charged = list(lim), 0
        if adaptive:  # vLLM's scheduler charges every decode its drafts first
            for k, m in enumerate(lim):
                scheduled[k] = max(0, min(m, self.budget - charged))
                charged += scheduled[k]
        rows = [self.profiles[self.profile_rows[r.id]] for r in slots]
        stale = [rspec.stale_survival(row, self.seed, r.id, r.generated, gamma, self.spread, self.bias)
                 for row, r in zip(rows, slots, strict=True)]
        positions = rspec.drafted(gamma, scheduled)
        b = rspec.engine_budget(self.spec_mode, stale, scheduled, p[1] if adaptive else len(slots), gamma,
                                self.tables, p[0], positions * draft_pp, c.max_num_seqs,
                                SPS_TABLE_CONTEXT, c.speculative_draft_cost_mode, c.speculative_draft_cost)
        fresh = [rspec.survival(row, self.seed, r.id, r.generated, gamma, self.spread, self.bias)
                 for row, r in zip(rows, slots, strict=True)]
        ell, x = rspec.topk(fresh, scheduled, b, self.budget, rspec.KV(slack, free_blocks, self.bs))
        if self.spec_mode == MODE_SPS_CAP_ACCEPT:  # the whole blocks run; ell caps the accepted run only
            x = sum(scheduled)
        return ell, x, charged if adaptive else x, positions

    def settle_verify(self, slots, ell) -> None:
        """Sample each verify; keep the accepted drafts (up to the output length), free the rest's KV."""
        accepted = [rspec.accepted_drafts(self.profiles[self.profile_rows[r.id]], self.seed, r.id, r.generated, m,
                                          self.spread) for r, m in zip(slots, ell, strict=True)]
        if self.spec_mode == MODE_SMARTSPEC:
            for r, m, a in zip(slots, ell, accepted, strict=True):
                self.counts.observe(r.id, m, a)
        for r, m, a in zip(slots, ell, accepted, strict=True):
            if m == 0:
                continue
            kept = min(a, r.target - r.generated - 1)
            r.generated += kept
            r.scheduled += kept
            self.spec["accepted"] += kept
            extra = r.held - private_blocks(r.computed + 1 + kept, self.cache.held[r.id], self.cache.bt, self.bs)
            self.free += extra
            self.hold(r, -extra)
            if self.c.admission_mode in ("reservation", "predicted") and r.held > r.reserved:
                self.reserved_total += r.held - r.reserved
                r.reserved = r.held
            if self.c.fairness_cost_unit == "tokens" and kept > 0:
                self.shares.charge(r.tenant, self.c.vtc_output_weight * kept)

    # -- end of step -----------------------------------------------------------------
    def calibrate(self, r: Req) -> None:
        self.hist[(r.generated * CALIBRATION_BINS + r.max_out - 1) // r.max_out - 1] += 1
        self.n_calibrated += 1
        if self.n_calibrated < MIN_CALIBRATION:
            return
        need = self.c.admission_quantile * self.n_calibrated
        cumulative = 0
        for b, count in enumerate(self.hist):
            cumulative += count
            if cumulative >= need:
                self.pred_bin = b
                return

    def end_step(self, t_end: float, dt: float, step_tokens: int) -> None:
        unit = self.c.fairness_cost_unit
        for r in self.batch:
            n = r.scheduled
            if n == 0:
                continue
            r.scheduled = 0
            r.computed += n
            if self.caching and not self.vllm_cache and self.cache.held[r.id] < self.cache.n_full[r.id]:
                self.cache_prompt_blocks(r, r.computed)
            if unit == "gpu_time":
                self.shares.charge(r.tenant, dt * n / step_tokens)
            elif unit == "kv_byte_seconds":
                self.shares.charge(r.tenant, float(r.computed) * self.kv_bytes * dt)
            if r.computed != r.prompt + r.generated:
                continue
            r.generated += 1
            r.sampled_at = self.steps
            if unit == "tokens":
                self.shares.charge(r.tenant, self.c.vtc_output_weight)
            if math.isnan(r.first_token):
                r.first_token = t_end
            if r.generated < r.target:
                # a P/D prefill replica is done with it (one whose deadline passed is left to expire here)
                if self.hand_off and not r.deadline <= t_end:
                    self.handoffs.append((r.id, t_end, self.withdraw(r.id, keep_kv=True)))
                continue
            if r.deadline < t_end:
                self.end_by_deadline(r)
                continue
            if self.c.async_scheduling:  # lingers on the running list until the next formation
                r.status, r.state, r.reason, r.finish = "done", int(State.FINISHED), int(Reject.NONE), t_end
            else:
                self.end(r, State.FINISHED, Reject.NONE, t_end)
            if self.c.admission_mode == "predicted":
                self.calibrate(r)

    def release(self, r: Req) -> None:
        """A lingering ended request leaves the running list with its KV."""
        self.running.remove(r)
        self.reserved_total -= r.reserved
        r.reserved = 0
        self.free_gpu(r, True)
        r.scheduled = 0  # a decode past its stop is timed with the step, advances nothing

    def drain(self) -> None:
        """Nothing in flight: lingering requests leave; the next formation sees every arrival."""
        for r in [r for r in self.running if r.status == "done"]:
            self.release(r)
        self.in_flight = None

    def run(self) -> dict:
        for r in self.reqs:
            self.deliver(r.id, r.arrival)
        self.advance(math.inf)
        return self.results()

    # -- one replica of a fleet --------------------------------------------------------
    def deliver(self, i: int, t: float, carried: dict | None = None) -> None:
        """Request i reaches this replica at time t (deliveries come in time order); it
        arrives, as a trace arrival would, at the first step boundary >= t. ``carried``
        is what it brings from another replica (``withdraw``)."""
        assert not self.inbox or self.inbox[-1][0] <= t, "deliveries out of time order"
        r = self.reqs[i]
        carried = dict(carried or {})
        self.counts.hits[i] = carried.pop("spec_hits", 0.0)  # the sampler's state comes along
        self.counts.trials[i] = carried.pop("spec_trials", 0.0)
        for name, value in carried.items():
            setattr(r, name, value)
        r.status = "new"
        r.sampled_at = -1
        self.inbox.append((t, r))

    def advance(self, t_limit: float, inclusive: bool = False) -> None:
        """Run the steps that start before ``t_limit`` (at or before it if ``inclusive``);
        a started step completes, so the clock may end past the limit. The boundary the
        clock ends on is left unsettled (its arrivals and deadlines are handled when the
        replica next moves on), so requests delivered at that very time arrive together
        with the others, as in a single run. With nothing to do the clock moves to the
        limit (kept where it is for an infinite one)."""
        while self.t < t_limit or (inclusive and self.t == t_limit):
            self.arrive()
            self.expire()
            if not self.running and not self.waiting:
                if self.in_flight is not None:  # nothing in flight: what has arrived by now is seen now
                    self.in_flight = None
                    continue
                # idle with no step in flight: SGLang re-inits the ratio only then (its overlap loop
                # processes the last batch's result instead, scheduler.py event_loop_overlap's elif)
                self.ratio = self.init_ratio
                if self.inbox and self.inbox[0][0] < t_limit:
                    self.t = self.inbox[0][0]
                    continue
                if t_limit < math.inf:
                    self.t = t_limit
                return
            dt = self.form_step()
            if self.c.async_scheduling:
                if dt is None and self.in_flight is not None:
                    # an empty batch while one was in flight: wait for its outputs, form again
                    self.drain()
                    self.arrive()
                    self.expire()
                    dt = self.form_step()
                if dt is None:
                    self.drain()
                else:
                    for r in [r for r in self.running if r.status == "done"]:
                        self.release(r)
                    self.in_flight = self.t
            if dt is None:
                assert self.preempted_now or not (self.running or self.waiting), "the reference stalled"
                continue
            self.commit_step(dt)

    def form_step(self) -> float | None:
        """Form the step at the clock and time it (copies included; speculative outcomes
        settled); None when it holds no tokens."""
        self.form_batch()
        p = self.batch_parts()
        if p[0] == 0:
            return None
        slots, ell, x, draft_s = [], [], 0, 0.0
        if self.spec_mode != MODE_OFF and p[2] > 0:
            slots, ell, x, draft_s = self.plan_verify(p)
        if self.spec_mode == MODE_BATCH_SCHEDULE:
            self.prev_scheduled = len(self.batch)
        dt, oor = step_seconds(self.tables, p[0] + x, p[1] + x, p[2], p[3] + x, p[4])
        if p[0] + x > self.peak_step:
            self.peak_step, self.peak_step_s = p[0] + x, self.t
        if slots:
            dt += draft_s
            self.settle_verify(slots, ell)
        self.out_of_range += bool(oor)
        self.formed = (p, x)
        return dt + self.swap_s

    def step_tokens(self) -> tuple[int, int]:
        """The formed step's (tokens, decodes), as its time was read."""
        p, x = self.formed
        return p[0] + x, p[2]

    def commit_step(self, dt: float) -> None:
        """End the formed step after ``dt`` seconds."""
        p, x = self.formed
        t_end = self.t + dt
        self.steps += 1
        self.busy += dt
        self.prefill_tokens += p[5]
        if p[2] > 0 and self.c.admission_mode == "new_token_ratio":
            low = NTR_MIN_FACTOR * self.init_ratio
            self.ratio = max(self.ratio - (self.init_ratio - low) / NTR_DECAY_STEPS, low)
        self.end_step(t_end, dt, p[0] + x)
        self.t = t_end

    def withdraw(self, i: int, keep_kv: bool) -> dict:
        """Take request i off this replica (failure, migration, P/D hand-off): everything it
        holds here is freed (its cached prefix blocks stay cached, idle). Returns what the
        request carries to its next replica: the tokens it streamed and its counters, and
        its computed KV when ``keep_kv`` (without it the next replica recomputes it all)."""
        r = self.reqs[i]
        if r.status == "new":
            self.inbox = [e for e in self.inbox if e[1] is not r]
        elif r.status == "waiting":
            self.waiting.remove(r)
            self.shares.dequeue(r.tenant)
        else:
            assert r.status == "running", f"request {i} is not on this replica"
            self.running.remove(r)
            self.reserved_total -= r.reserved
            r.reserved = 0
        self.free_gpu(r, True)
        self.host_free += r.host
        r.host = 0
        r.status = "moved"
        return {"computed": r.computed if keep_kv else 0, "generated": r.generated, "preempts": r.preempts,
                "first_sched": r.first_sched, "first_token": r.first_token, "cached_first": r.cached_first,
                "spec_hits": self.counts.hits.pop(i, 0.0), "spec_trials": self.counts.trials.pop(i, 0.0)}

    def holds(self) -> list[int]:
        """Requests on this replica: delivered, waiting or running (not ended ones lingering)."""
        return sorted(r.id for r in self.running + self.waiting + [e[1] for e in self.inbox] if r.status != "done")

    def load(self) -> dict:
        """What a router reads of this replica (the fleet contract's replica summary)."""
        queued = self.waiting + [e[1] for e in self.inbox]
        head = self.head(set()) or (self.inbox[0][1] if self.inbox else None)  # the request admission tries next
        return {
            "outstanding": len(self.running) + len(queued),
            "running": len(self.running),
            "waiting": len(queued),
            "free": self.free,
            "headroom": self.headroom,
            "head": head,
            "head_demand": blocks(head.prompt + head.generated, self.bs) if head is not None else 0,
            "queued_tokens": sum(r.prompt + r.generated - r.computed for r in queued),
            "capacity": self.cap,
            "seq_tokens": sum(r.prompt + r.generated for r in queued),
        }

    def cached_tokens(self, i: int) -> int:
        """Leading prompt tokens of request i this replica's prefix cache holds (capped as admission caps them)."""
        return self.cache.match(i, self.reqs[i].prompt)[1]

    def results(self) -> dict:
        reqs = self.reqs
        return {
            "state": np.array([r.state for r in reqs], dtype=np.int8),
            "reject_reason": np.array([r.reason for r in reqs], dtype=np.int8),
            "first_token_s": np.array([r.first_token for r in reqs]),
            "finish_s": np.array([r.finish for r in reqs]),
            "tokens_generated": np.array([r.generated for r in reqs], dtype=np.int64),
            "preemptions": np.array([r.preempts for r in reqs], dtype=np.int32),
            "queue_s": np.array([r.first_sched - r.arrival for r in reqs]),
            "steps": self.steps,
            "busy_s": self.busy,
            "prefill_tokens_computed": self.prefill_tokens,
            "out_of_range_steps": self.out_of_range,
            "kv_peak_blocks": self.peak,
            "swap_outs": self.swap_outs,
            "peak_step_tokens": self.peak_step,
            "peak_step_s": self.peak_step_s,
            "end_s": self.t,
            "leftover": (self.cap - self.free, self.reserved_total),
            "cached_prompt_tokens": np.array([r.cached_first for r in reqs], dtype=np.int64),
            "tenant_service": np.array(self.shares.service),
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_query_tokens": self.query_tokens,
            "prefill_time_saved_s": self.saved_s,
            "prefix_evictions": self.cache.evictions,
            "spec_decodes": self.spec["decodes"],
            "spec_verifies": self.spec["verifies"],
            "spec_drafted_tokens": self.spec["drafted"],
            "spec_accepted_tokens": self.spec["accepted"],
        }


def reference_simulate(trace, cost, config, sharing=None, acceptance=None, seed=0) -> dict:
    """Run the reference; capacity as the engine computes it (``policies.engine.validate``)."""
    from policies.engine import fairness_params, validate

    cap, host = validate(trace, cost, config)
    return Reference(trace, cost, config, cap, host, *fairness_params(trace, config, sharing), acceptance, seed).run()
