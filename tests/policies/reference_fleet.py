"""Plain-Python reference fleet: reference replicas under one clock, with every router of issue 8.

It implements the fleet contract (/work/notes/fleet_contract.md) from its text, with its
own hash ring, prefix sets and scores, so that the jitted fleet (``policies.fleet``) can be
checked against it request by request. Each replica is a ``tests.policies.reference``
``Reference`` fed through its inbox (``deliver``) and advanced to a time limit
(``advance``); only ``step_seconds`` is shared with the engine.

The loop: take the earliest external event t_e (an arrival, a delivery of a moved request,
a failure down/up, a migration tick, or a step end that is an event, below); advance every
alive replica to t_e; then, at t_e, process downs, ups, deliveries, the migration tick and
the arrivals, in that order. Every request that arrives or has to be placed again joins
the fleet queue, which is dispatched (FIFO) once the downs and ups at t_e are done (the
requests a failure displaced go first), again after the migration tick, and at each
arrival: the head is routed to a replica (colocated: among the alive replicas; P/D: among
the alive prefill replicas, once a decode replica promised it KV) and delivered there at
t_e; with no replica to take it, the queue waits. Ties everywhere go to the lowest
replica index. A delivered request arrives on its replica exactly as a trace arrival
(arrival-time rejections apply there; FCFS queues it behind what that replica already
queued; max_out follows that replica's max_len) and keeps its streamed tokens, first
token, first schedule and preemption count.

Rules the contract leaves open, as implemented here:

* Replica clocks start at the first arrival. ``advance`` leaves the boundary a replica
  stops on unsettled: requests delivered at or before its clock arrive there together
  with the earlier ones, as trace arrivals do in a single run (so one replica is exactly
  the single engine). A router reads that state: the inbox counts in ``outstanding``,
  ``waiting`` and ``queued_tokens``; ``head_demand`` is that of the waiting queue's head
  in the replica's own queue order, else of its first inbox request (as
  ``policies.engine.head_demand_blocks``), and the migration rule's head is the same one.
* ``round_robin`` keeps the index of the replica it chose last and takes the next
  eligible index after it, wrapping. ``cache_aware`` keeps every block hash of the routed
  request's trace blocks (the partial tail too); the match rate is
  (match x block_tokens) / prompt_tokens. ``unified``: T_prefill(n | c) is one lone
  step of n new tokens after c cached ones (one sampled sequence,
  n·c + n(n+1)/2 attention pairs) on the replica's tables; T_step(B) = T_prefill(B | 0);
  max_out = min(max_tokens, replica max_len − prompt); a routed request never carries KV,
  so T_transfer = 0; score = ((T_saved − w_q·T_queue) − T_risk), each term as the
  contract writes it, left to right. ``consistent_hash`` uses the hash definitions of
  ``policies.hashring``'s docstring (reimplemented below on Python ints).
* The engines' DP balancers, from their source with exact replica state (no snapshots):
  ``vllm_dp`` (vllm/v1/engine/core_client.py:1766-1805, one client): from the scan start
  (moved to the first candidate at or after it), score = max(outstanding, waiting +
  running) + [waiting > 0] waiting x 6.0 x max(0, usage - 0.5), usage = 1 - free /
  capacity; strict < keeps the first of the scan; the start then moves one past where
  the scan began. ``total_requests`` / ``total_tokens`` (SGLang
  data_parallel_controller.py:140-150): min running + waiting, resp. min (used blocks x
  block_size + prompt + generated of the waiting and inbox requests, running + waiting),
  the lowest index on ties.
* Failures: at t_down the replica (already advanced to t_down, its last step complete)
  loses every request it holds, every request in flight to it, and, for a decode replica,
  every request it promised KV to (still on a prefill replica): each is withdrawn without
  its KV (``reprefill_tokens`` += the computed tokens lost) and queued again in arrival
  order. A step in flight at t_down completes (its tokens were streamed), so a request
  withdrawn from a replica whose clock is past t_down is not placed before that clock:
  the queue (FIFO) waits for it. Its promises and prefix set are dropped. At t_up it returns as a new replica
  (empty KV, cache, queue, scheduler state) with its clock at t_up. The fleet queue is
  looked at only at events: a queued request whose deadline passed before the current
  event ends at its deadline (in no replica); one that can be placed is placed even if
  its deadline is now, and its replica settles it. A request still queued when no
  replica will come back ends at its deadline if it has one, else FAILED at the time it
  was last queued, or at its first token if a failure withdrew it from a step in flight
  that streamed it later.
* Migration ticks at first arrival + k·``migration_interval_s`` (k = 1, 2, ...), at
  every event that falls on one; the next tick after the current time is itself an
  event while some alive replica holds a request. Per pool (P/D: prefill and decode replicas apart), F_j = (free − headroom −
  head_demand) / max(1, running + [waiting > 0]); a source has F < threshold and a head
  whose blocks(prompt + generated) exceed free − headroom; a destination F >= threshold.
  Sources by increasing (F, index) pair with destinations by decreasing F (then index);
  a source moves its last admitted running request if T_mig = pause + computed·kv_bytes
  / bandwidth < tick − head's arrival; it is delivered with its KV at tick + T_mig.
* P/D: the FIFO head needs a promise of blocks(prompt + generated + 1) on an alive decode
  replica d with promised_d + need <= free_d − headroom_d, taking the one with the largest
  (free_d − promised_d − headroom_d − head_demand_d) / max(1, running_d + waiting_d); a
  head no decode replica could ever hold (need > capacity − headroom on each) is rejected
  EXCEEDS_CAPACITY by the fleet, and so is an arrival every prefill replica would reject
  EXCEEDS_CAPACITY (``Reference.never_admits``), at its arrival. The promise ends when
  the request is admitted on d or ends; one that ends as the replicas start their steps
  at t (below), with requests queued, makes t the next event again. A prefill replica
  hands a request off at the end of the step that sampled its token (in batch order,
  where a finishing request would end; one whose deadline passed by then stays to
  expire there); it reaches d at step end + (computed + 1)·kv_bytes /
  bandwidth. While P/D is on, every prefill replica's step
  end is an event, and so is every decode replica's while the queue holds requests: after
  the events at t the replicas concerned start their step at t (``advance(t,
  inclusive=True)``) and its end becomes an event, so hand-offs are always delivered in
  the future.
* A request's final replica is the replica it ended on (-1: in the fleet queue);
  ``replica`` keeps SimResult's meaning (only finished requests name one).
"""

from __future__ import annotations

import bisect
import math
import sys

import numpy as np

from costmodels.steptable import linear_step_seconds, step_seconds
from policies.config import check_fleet
from policies.result import Reject, State

from .reference import Reference, blocks

MASK64 = (1 << 64) - 1
OUTCOME = (("state", np.int8), ("reject_reason", np.int8), ("finish_s", np.float64), ("first_token_s", np.float64),
           ("tokens_generated", np.int64), ("preemptions", np.int32), ("queue_s", np.float64),
           ("cached_prompt_tokens", np.int64), ("end_replica", np.int32))


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def mix(a: int, b: int) -> int:
    return splitmix64((a & MASK64) ^ splitmix64(b & MASK64))


def prefill_s(tables, n: int, cached: int) -> float:
    """One lone step computing n prompt tokens after ``cached`` ones."""
    return step_seconds(tables, n, 1, 0, 0, n * cached + n * (n + 1) // 2)[0]


def advance_group(reps: list[Reference], t_limit: float, inclusive: bool = False) -> None:
    """The ranks of one attention-DP instance on one clock (``policies.engine.lockstep``):
    at each step every rank takes its arrivals and deadlines and forms its batch; every
    rank's step ends after the largest of the ranks' step times less their token-linear
    parts, plus the token-linear part at the ranks' mean tokens (the MoE layers over all). A rank with no batch sits it
    out (its ratio reset if it holds nothing); with no rank holding a request the ranks
    jump together to the first delivery, else to a finite limit."""
    lead = reps[0]
    while lead.t < t_limit or (inclusive and lead.t == t_limit):
        t = lead.t
        for rep in reps:
            rep.arrive()
            rep.expire()
        if not any(rep.running or rep.waiting for rep in reps):
            t_next = min((rep.inbox[0][0] for rep in reps if rep.inbox), default=math.inf)
            if t_next >= t_limit:
                t_next = t_limit if t_limit < math.inf else t
            if t_next <= t:
                return
            for rep in reps:
                rep.ratio = rep.init_ratio
                rep.t = t_next
            continue
        if lead.c.dp_balance_timeout_iters > 0:
            balance(reps)
        steps = [rep.form_step() if rep.running or rep.waiting else None for rep in reps]
        for rep, dt in zip(reps, steps, strict=True):
            assert dt is not None or not (rep.running or rep.waiting) or rep.preempted_now, "the reference stalled"
        if all(dt is None for dt in steps):
            continue
        formed = [(rep, dt, *rep.step_tokens()) for rep, dt in zip(reps, steps, strict=True) if dt is not None]
        rest = max([0.0, *(dt - linear_step_seconds(rep.tables, tokens, decodes) for rep, dt, tokens, decodes in formed)])
        step = rest + linear_step_seconds(lead.tables, sum(f[2] for f in formed) / len(reps),
                                          sum(f[3] for f in formed) / len(reps))
        for rep, dt in zip(reps, steps, strict=True):
            if dt is not None:
                rep.commit_step(step)
                continue
            if not rep.running and not rep.waiting:
                rep.ratio = rep.init_ratio
            rep.t = t + step


def balance(reps: list[Reference]) -> None:
    """TensorRT-LLM's attention-DP balancing (``policies.engine.lockstep._balance``; its
    counters on the first rank): prompts start when every rank has one and room, after at
    most ``dp_balance_batching_iters`` more steps while every rank decodes; else they wait,
    released every ``dp_balance_timeout_iters`` steps of waiting and at once when some
    rank has nothing running."""
    c, lead = reps[0].c, reps[0]
    every_prompt = all(rep.waiting for rep in reps)
    every_decode = all(rep.running for rep in reps)
    every_room = all(len(rep.running) < c.max_num_seqs for rep in reps)
    waited, batched = getattr(lead, "dp_waited", 0), getattr(lead, "dp_batched", 0)
    hold = False
    if every_room and every_prompt:
        waited = 0
        if every_decode and batched < c.dp_balance_batching_iters:
            batched, hold = batched + 1, True
        elif every_decode:
            batched = 0
    else:
        waited, hold = waited + 1, True
        if waited >= c.dp_balance_timeout_iters or not every_decode:
            waited, hold = 0, False
    lead.dp_waited, lead.dp_batched = waited, batched
    for rep in reps:
        rep.dp_hold = hold


class Fleet:
    def __init__(self, trace, costs, config, seed: int, failures, lockstep: int = 1):
        from policies.engine import fairness_params, validate

        self.trace, self.c, self.seed = trace, config, seed
        self.costs = list(costs)
        n_rep = len(self.costs)
        check_fleet(config, n_rep, lockstep)
        self.lockstep = lockstep
        self.limits = [validate(trace, cost, config) for cost in self.costs]
        self.side = fairness_params(trace, config, None)
        self.n_rep = n_rep
        self.pd = n_rep > 1 and config.prefill_replicas > 0
        # pool 1: the decode replicas; pool 0: the prefill ones, or every replica when colocated
        self.pool = [int(self.pd and j >= config.prefill_replicas) for j in range(n_rep)]
        self.t0 = float(trace.arrival_s[0])
        self.incarnations: list[Reference] = []
        self.reps = [self.new_replica(j, self.t0) for j in range(n_rep)]
        self.alive = [True] * n_rep
        n = trace.n
        off = trace.block_offsets
        keyed = trace.cache_block_hashes
        self.hashes = [keyed[off[i]:off[i + 1]].tolist() for i in range(n)]
        self.owner: list[Reference | None] = [None] * n  # the replica a request is on, if any
        self.carry: list[dict | None] = [None] * n  # what a queued / moving request brings along
        self.queue: list[tuple[int, float]] = []  # fleet queue: (request, time queued)
        self.ready: dict[int, float] = {}  # a displaced request: when its last step ended
        self.in_flight: list[tuple[float, int, int]] = []  # sorted (delivery time, request, destination)
        self.fleet_end: dict[int, tuple[int, int, float]] = {}  # ended in the queue: state, reason, finish
        self.promise: dict[int, tuple[int, int]] = {}  # request -> (decode replica, blocks)
        self.promised = [0] * n_rep
        self.rr_last = -1
        self.dp_start = 0  # vllm_dp: eng_start_index (client_index 0 of 1 client)
        self.prefix_sets: list[set[int]] = [set() for _ in range(n_rep)]
        self.next_arrival = 0
        self.tick = 1
        rows = [] if failures is None else [tuple(row) for row in failures.rows()]
        self.downs = sorted((float(d), int(j)) for j, d, _ in rows)
        self.ups = sorted((float(u), int(j)) for j, _, u in rows if math.isfinite(u))
        self.reroutes = [0] * n
        self.reprefill = [0] * n
        self.routed = [0] * n_rep
        self.migrations = self.handoffs = 0

    def new_replica(self, j: int, t: float) -> Reference:
        cap, host = self.limits[j]
        rep = Reference(self.trace, self.costs[j], self.c, cap, host, *self.side, None, self.seed)
        rep.t = t
        rep.hand_off = self.pd and self.pool[j] == 0
        rep.admitted = []
        rep.index = j
        self.incarnations.append(rep)
        return rep

    # -- requests ------------------------------------------------------------------------
    def request_done(self, i: int) -> bool:
        if i in self.fleet_end:
            return True
        return self.owner[i] is not None and self.owner[i].reqs[i].status == "done"

    def deliver(self, i: int, j: int, t: float) -> None:
        self.owner[i] = self.reps[j]
        self.reps[j].deliver(i, t, self.carry[i])
        self.carry[i] = None
        self.routed[j] += 1

    def send(self, i: int, j: int, t_arrive: float, carried: dict) -> None:
        """Request i left its replica with ``carried`` and reaches replica j at ``t_arrive``."""
        self.owner[i] = None
        self.carry[i] = carried
        bisect.insort(self.in_flight, (t_arrive, i, j))

    def requeue(self, i: int, t: float, carried: dict, lost_tokens: int, ready: float) -> None:
        """Request i lost ``lost_tokens`` of KV to a failure: it is placed again, fresh, once
        the step it was last in ended (``ready``)."""
        self.reprefill[i] += lost_tokens
        self.reroutes[i] += 1
        self.promise_end(i)
        self.owner[i] = None
        self.carry[i] = carried
        self.ready[i] = ready
        self.queue.append((i, t))

    def end_in_fleet(self, i: int, state: State, reason: Reject, t: float) -> None:
        self.fleet_end[i] = (int(state), int(reason), t)

    def promise_end(self, i: int) -> None:
        if i in self.promise:
            d, need = self.promise.pop(i)
            self.promised[d] -= need

    def collect(self, rep: Reference) -> bool:
        """After a replica ran: hand-offs leave for their decode replica, promises of
        requests admitted on their decode replica or ended anywhere are released; returns
        whether one was."""
        j = rep.index
        promised = len(self.promise)
        for i, t_end, carried in rep.handoffs:
            d = self.promise[i][0]
            kv_bytes = (carried["computed"] + 1) * self.costs[j].kv_bytes_per_token
            self.send(i, d, t_end + kv_bytes / (self.c.interconnect_gbps * 1e9), carried)
            self.handoffs += 1
        rep.handoffs.clear()
        for i in rep.admitted:
            if i in self.promise and self.promise[i][0] == j:
                self.promise_end(i)
        rep.admitted.clear()
        for i in [i for i in self.promise if self.request_done(i)]:
            self.promise_end(i)
        return len(self.promise) < promised

    def run_replica(self, j: int, t_limit: float, inclusive: bool = False) -> bool:
        """Advance replica j to ``t_limit`` (an attention-DP rank with the other ranks of its
        instance); returns whether a promise ended (``collect``)."""
        if self.lockstep > 1:
            first = j - j % self.lockstep
            group = self.reps[first:first + self.lockstep]
            advance_group(group, t_limit, inclusive)
            return any([self.collect(rep) for rep in group])
        self.reps[j].advance(t_limit, inclusive)
        return self.collect(self.reps[j])

    # -- routing -------------------------------------------------------------------------
    def route(self, i: int, cands: list[int]) -> int:
        router = self.c.router
        loads = {j: self.reps[j].load() for j in cands}
        if router == "round_robin":
            later = [j for j in cands if j > self.rr_last]
            self.rr_last = later[0] if later else cands[0]
            return self.rr_last
        if router == "least_outstanding":
            return min(cands, key=lambda j: (loads[j]["outstanding"], j))
        if router == "least_kv":
            return self.argmax(cands, lambda j: (loads[j]["free"] - loads[j]["headroom"] - loads[j]["head_demand"])
                               / max(1, loads[j]["running"] + loads[j]["waiting"]))
        if router == "cache_aware":
            return self.cache_aware(i, cands, loads)
        if router == "unified":
            scores = {j: self.unified_score(i, j, loads[j]) for j in cands}
            return min(cands, key=lambda j: (-scores[j], loads[j]["outstanding"], j))
        if router == "vllm_dp":
            return self.vllm_dp(cands, loads)
        if router == "total_requests":
            return min(cands, key=lambda j: (loads[j]["running"] + loads[j]["waiting"], j))
        if router == "total_tokens":
            bs = self.c.block_size

            def tokens(j):
                return (loads[j]["capacity"] - loads[j]["free"]) * bs + loads[j]["seq_tokens"]
            return min(cands, key=lambda j: (tokens(j), loads[j]["running"] + loads[j]["waiting"], j))
        assert router == "consistent_hash", router
        return self.consistent_hash(i, cands, loads)

    @staticmethod
    def argmax(cands, value) -> int:
        best, best_value = cands[0], value(cands[0])
        for j in cands[1:]:
            v = value(j)
            if v > best_value:
                best, best_value = j, v
        return best

    def vllm_dp(self, cands: list[int], loads: dict) -> int:
        n = self.n_rep
        start = next((self.dp_start + s) % n for s in range(n) if (self.dp_start + s) % n in cands)
        min_score, eng_index = float(sys.maxsize), None
        for s in range(n):
            idx = (start + s) % n
            if idx not in cands:
                continue
            load = loads[idx]
            waiting, running = load["waiting"], load["running"]
            score = max(load["outstanding"], waiting + running)
            if waiting:
                usage = 1.0 - load["free"] / load["capacity"] if load["capacity"] else 0.0
                score += waiting * 6.0 * max(0.0, usage - 0.5)
            if score < min_score:
                min_score, eng_index = score, idx
        self.dp_start = (start + 1) % n
        return eng_index

    def cache_aware(self, i: int, cands: list[int], loads: dict) -> int:
        c = self.c
        out = {j: loads[j]["outstanding"] for j in cands}
        hi, lo = max(out.values()), min(out.values())
        if hi - lo > c.router_balance_abs and hi > lo * c.router_balance_rel:
            chosen = min(cands, key=lambda j: (out[j], j))
        else:
            match = {}
            for j in cands:
                k = 0
                while k < len(self.hashes[i]) and self.hashes[i][k] in self.prefix_sets[j]:
                    k += 1
                match[j] = k
            prompt = int(self.trace.prompt_tokens[i])
            best_rate = max(match[j] * self.trace.block_tokens / prompt for j in cands)
            if best_rate > c.router_cache_threshold:
                chosen = min(cands, key=lambda j: (-match[j], out[j], j))
            else:
                chosen = min(cands, key=lambda j: (len(self.prefix_sets[j]), j))
        self.prefix_sets[chosen].update(self.hashes[i])
        return chosen

    def unified_score(self, i: int, j: int, load: dict) -> float:
        rep, bs = self.reps[j], self.c.block_size
        prompt = int(self.trace.prompt_tokens[i])
        cached = rep.cached_tokens(i)
        full = prefill_s(rep.tables, prompt, 0)
        saved = full - prefill_s(rep.tables, prompt - cached, cached)
        batch = self.c.max_num_batched_tokens
        queue = load["queued_tokens"] / batch * prefill_s(rep.tables, batch, 0)
        max_out = min(int(self.trace.max_tokens[i]), rep.max_len - prompt)
        need = blocks(prompt + max_out, bs)
        avail = load["free"] - load["headroom"] - blocks(load["queued_tokens"], bs)
        risk = full * max(0, need - avail) / need
        return saved - self.c.router_queue_weight * queue - risk

    def consistent_hash(self, i: int, cands: list[int], loads: dict) -> int:
        c = self.c
        key = 0
        lead = self.hashes[i][: c.hash_prefix_blocks]
        for b in lead if lead else [i]:
            key = mix(key, b)
        if c.hash_by_tenant:
            key = mix(key, int(self.trace.tenant[i]))
        ring = sorted((mix(j, v), j) for j in cands for v in range(c.hash_virtual_nodes))
        at = bisect.bisect_left(ring, (key, -1)) % len(ring)
        primary = ring[at][1]
        secondary = next((ring[(at + s) % len(ring)][1] for s in range(1, len(ring))
                          if ring[(at + s) % len(ring)][1] != primary), None)
        mean = sum(loads[j]["outstanding"] for j in cands) / len(cands)
        if secondary is not None and loads[primary]["outstanding"] > c.hash_overflow_factor * mean + 1:
            return secondary
        return primary

    # -- the fleet queue -----------------------------------------------------------------
    def alive_in(self, pool: int) -> list[int]:
        return [j for j in range(self.n_rep) if self.alive[j] and self.pool[j] == pool]

    def promise_blocks(self, i: int) -> int:
        """KV a decode replica needs for request i once its prefill sampled a token."""
        generated = (self.carry[i] or {}).get("generated", 0)
        return blocks(int(self.trace.prompt_tokens[i]) + generated + 1, self.c.block_size)

    def promise_for(self, i: int) -> tuple[int, int] | None:
        """(decode replica, blocks) promising request i its KV, or None for now."""
        need = self.promise_blocks(i)
        best, best_f = None, -math.inf
        for d in self.alive_in(1):
            load = self.reps[d].load()
            if self.promised[d] + need > load["free"] - load["headroom"]:
                continue
            f = ((load["free"] - self.promised[d] - load["headroom"] - load["head_demand"])
                 / max(1, load["running"] + load["waiting"]))
            if best is None or f > best_f:
                best, best_f = d, f
        return None if best is None else (best, need)

    def never_fits(self, i: int) -> bool:
        need = self.promise_blocks(i)
        return all(need > cap - int(self.c.kv_headroom * cap)
                   for j, (cap, _) in enumerate(self.limits) if self.pool[j] == 1)

    def dispatch(self, t: float) -> None:
        """Place queued requests, head first, while they can be placed; requests whose
        deadline passed while they waited (before t) end at it first."""
        for i, _ in [q for q in self.queue if self.trace.deadline_s[q[0]] < t]:
            self.end_by_deadline_in_fleet(i)
        self.queue = [q for q in self.queue if not self.trace.deadline_s[q[0]] < t]
        while self.queue:
            i = self.queue[0][0]
            cands = self.alive_in(0)
            if not cands or self.ready.get(i, t) > t:
                return
            if self.pd:
                if self.never_fits(i):
                    self.queue.pop(0)
                    self.end_in_fleet(i, State.REJECTED, Reject.EXCEEDS_CAPACITY, t)
                    continue
                promise = self.promise_for(i)
                if promise is None:
                    return
                self.promise[i] = promise
                self.promised[promise[0]] += promise[1]
            self.queue.pop(0)
            self.deliver(i, self.route(i, cands), t)

    def end_by_deadline_in_fleet(self, i: int) -> None:
        deadline = float(self.trace.deadline_s[i])
        first = (self.carry[i] or {}).get("first_token", math.nan)
        cancelled = not first <= deadline
        self.end_in_fleet(i, State.CANCELLED if cancelled else State.TIMED_OUT, Reject.NONE, deadline)
        if cancelled and self.carry[i]:  # nothing reached the client
            self.carry[i] = {**self.carry[i], "first_token": math.nan, "generated": 0}

    # -- failures and migration ----------------------------------------------------------
    def fail(self, j: int, t: float) -> None:
        def lose(rep: Reference, i: int) -> tuple[dict, int, float]:
            return rep.withdraw(i, keep_kv=False), rep.reqs[i].computed, max(t, rep.t)

        rep = self.reps[j]
        rep.drain()  # requests that ended with its last step leave with it
        lost = {i: lose(rep, i) for i in rep.holds()}
        doomed = {f[1] for f in self.in_flight if f[2] == j}
        if self.pool[j] == 1:  # requests it promised KV to, still prefilling or moving between prefill replicas
            doomed |= {i for i, (d, _) in self.promise.items() if d == j and i not in lost}
        for i in doomed:
            if self.owner[i] is None:
                self.in_flight = [f for f in self.in_flight if f[1] != i]
                lost[i] = {**self.carry[i], "computed": 0}, self.carry[i]["computed"], t
            else:
                lost[i] = lose(self.owner[i], i)
        for i in sorted(lost):
            self.requeue(i, t, *lost[i])
        assert self.promised[j] == 0, "a promise outlived its decode replica"
        self.alive[j] = False
        self.prefix_sets[j].clear()

    def migrate(self, t: float) -> None:
        c = self.c
        for pool in (0, 1):
            members = self.alive_in(pool)
            loads = {j: self.reps[j].load() for j in members}
            f = {j: (loads[j]["free"] - loads[j]["headroom"] - loads[j]["head_demand"])
                 / max(1, loads[j]["running"] + (loads[j]["waiting"] > 0)) for j in members}
            sources = sorted((j for j in members if f[j] < c.migration_threshold and loads[j]["head"] is not None
                              and loads[j]["head_demand"] > loads[j]["free"] - loads[j]["headroom"]),
                             key=lambda j: (f[j], j))
            targets = sorted((j for j in members if f[j] >= c.migration_threshold), key=lambda j: (-f[j], j))
            for s, d in zip(sources, targets, strict=False):
                rep = self.reps[s]
                running = [r for r in rep.running if r.status == "running"]  # not ended ones lingering
                if not running:
                    continue
                r = running[-1]
                move_s = c.migration_pause_ms * 1e-3 + r.computed * self.costs[s].kv_bytes_per_token / (
                    c.interconnect_gbps * 1e9)
                if move_s < t - loads[s]["head"].arrival:
                    self.send(r.id, d, t + move_s, rep.withdraw(r.id, keep_kv=True))
                    self.migrations += 1

    # -- the loop ------------------------------------------------------------------------
    def stepwise(self) -> list[int]:
        """Replicas whose every step end is an event (P/D only)."""
        if not self.pd:
            return []
        pools = (0, 1) if self.queue else (0,)
        return [j for j in range(self.n_rep) if self.alive[j] and self.pool[j] in pools]

    def next_event(self, t: float, stepping: list[int]) -> float | None:
        times = []
        if self.next_arrival < self.trace.n:
            times.append(float(self.trace.arrival_s[self.next_arrival]))
        if self.in_flight:
            times.append(self.in_flight[0][0])
        if self.downs:
            times.append(self.downs[0][0])
        if self.ups:
            times.append(self.ups[0][0])
        if self.queue and self.ready.get(self.queue[0][0], t) > t:
            times.append(self.ready[self.queue[0][0]])
        if self.c.migration:
            while self.t0 + self.tick * self.c.migration_interval_s <= t:
                self.tick += 1
            if any(self.alive[j] and self.reps[j].holds() for j in range(self.n_rep)):
                times.append(self.t0 + self.tick * self.c.migration_interval_s)
        times += [self.reps[j].t for j in stepping if self.reps[j].t > t]
        return min(times) if times else None

    def events_at(self, t: float) -> None:
        while self.downs and self.downs[0][0] == t:
            self.fail(self.downs.pop(0)[1], t)
        while self.ups and self.ups[0][0] == t:
            j = self.ups.pop(0)[1]
            self.reps[j] = self.new_replica(j, t)
            self.alive[j] = True
        self.dispatch(t)
        while self.in_flight and self.in_flight[0][0] == t:
            _, i, j = self.in_flight.pop(0)
            self.deliver(i, j, t)
        if self.c.migration and t == self.t0 + self.tick * self.c.migration_interval_s:
            self.tick += 1
            self.migrate(t)
        self.dispatch(t)
        while self.next_arrival < self.trace.n and self.trace.arrival_s[self.next_arrival] == t:
            i = self.next_arrival
            self.next_arrival += 1
            if self.pd and all(self.reps[j].never_admits(i) for j in range(self.n_rep) if self.pool[j] == 0):
                self.end_in_fleet(i, State.REJECTED, Reject.EXCEEDS_CAPACITY, t)
            else:
                self.queue.append((i, t))
            self.dispatch(t)

    def run(self) -> dict:
        t = self.t0
        while True:
            stepping = self.stepwise()
            released = False
            for j in stepping:
                rep, free = self.reps[j], self.reps[j].load()["free"]
                released |= self.run_replica(j, t, inclusive=True)
                # a decode replica that let KV go at t, forming no step: requests that ended
                # with its last step left it
                released |= self.pool[j] == 1 and rep.t == t and rep.load()["free"] > free
            # a promise ended at t, or KV let go at t, may unblock the queue
            t_next = t if released and self.queue else self.next_event(t, stepping)
            if t_next is None:
                break
            t = t_next
            for j in range(self.n_rep):
                if self.alive[j]:
                    self.run_replica(j, t)
            self.events_at(t)
        for j in range(self.n_rep):
            if self.alive[j]:
                self.run_replica(j, math.inf)
        assert not self.in_flight, "a hand-off left after the last event"
        for i, t_queued in self.queue:  # no replica will come back for them
            if math.isnan(self.trace.deadline_s[i]):
                first = (self.carry[i] or {}).get("first_token", math.nan)  # a step in flight streamed it
                self.end_in_fleet(i, State.FAILED, Reject.NONE, t_queued if math.isnan(first) else max(t_queued, first))
            else:
                self.end_by_deadline_in_fleet(i)
        self.queue.clear()
        return self.results()

    def outcome(self, i: int) -> tuple:
        """Request i's final values, wherever it ended (an ``OUTCOME`` row)."""
        ended_on = [rep for rep in self.incarnations if rep.reqs[i].status == "done"]
        assert len(ended_on) + (i in self.fleet_end) == 1, f"request {i} ended {len(ended_on)} times"
        if i in self.fleet_end:
            c = self.carry[i] or {}
            return (*self.fleet_end[i], c.get("first_token", math.nan), c.get("generated", 0), c.get("preempts", 0),
                    c.get("first_sched", math.nan) - self.trace.arrival_s[i], c.get("cached_first", 0), -1)
        r = ended_on[0].reqs[i]
        return (r.state, r.reason, r.finish, r.first_token, r.generated, r.preempts, r.first_sched - r.arrival,
                r.cached_first, ended_on[0].index)

    def results(self) -> dict:
        columns = zip(*(self.outcome(i) for i in range(self.trace.n)), strict=True)
        out = {name: np.array(column, dtype=dtype) for (name, dtype), column in zip(OUTCOME, columns, strict=True)}
        out["replica"] = np.where(out["state"] == State.FINISHED, out["end_replica"], -1).astype(np.int32)
        out["reroutes"] = np.array(self.reroutes, dtype=np.int32)
        out["reprefill_tokens"] = np.array(self.reprefill, dtype=np.int64)
        out["replica_routed"] = np.array(self.routed, dtype=np.int64)
        hit, query = np.zeros(self.n_rep, dtype=np.int64), np.zeros(self.n_rep, dtype=np.int64)
        for rep in self.incarnations:
            hit[rep.index] += rep.hit_tokens
            query[rep.index] += rep.query_tokens
        out["replica_prefix_hit_tokens"], out["replica_prefix_query_tokens"] = hit, query
        out["prefix_hit_tokens"], out["prefix_query_tokens"] = int(hit.sum()), int(query.sum())
        out["prefill_tokens_computed"] = sum(rep.prefill_tokens for rep in self.incarnations)
        out["migrations"], out["handoffs"] = self.migrations, self.handoffs
        for rep in self.incarnations:
            rep.drain()  # the run ended: requests that ended with a replica's last step leave (the kernel's _retire)
        out["leftover"] = [(rep.cap - rep.free, rep.reserved_total) for rep in self.incarnations]
        return out


def reference_fleet(trace, costs, config, seed: int = 0, failures=None, lockstep: int = 1) -> dict:
    """Replay ``trace`` through a fleet of one replica per cost model in ``costs`` (a
    CostModel alone is one replica) running ``config``; ``failures`` is a
    ``policies.failures.FailureSchedule`` or None; ``lockstep``: replicas per attention-DP
    instance, stepping together (``advance_group``). Per-request arrays as SimResult names
    them, plus ``end_replica``, the fleet fields (``reroutes``, ``reprefill_tokens``,
    ``replica_routed``, ...) and ``leftover`` (KV and reservations each replica still holds)."""
    if not isinstance(costs, list | tuple):
        costs = [costs]
    if failures is not None:
        failures.check_replicas(len(costs))
    return Fleet(trace, costs, config, seed, failures, lockstep).run()
