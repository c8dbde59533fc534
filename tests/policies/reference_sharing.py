"""Plain-Python twins of the sharing building blocks: prefix cache, waiting queue, fairness.

They state the rules of ``policies.prefix_cache``, ``policies.queues`` and
``policies.fairness`` the obvious way (dicts, sorted lists, OrderedDict for LRU, keyed by
the trace's raw hashes rather than dense ids) so the kernels can be checked against them,
and the reference simulator uses them to implement the same rules.
"""

from __future__ import annotations

import math
from collections import OrderedDict

LPM_FCFS_ABOVE = 128


# -- prefix cache --------------------------------------------------------------------------
def private_blocks(ctx: int, held: int, unit_tokens: int, kv_block_size: int) -> int:
    return max(0, math.ceil((ctx - held * unit_tokens) / kv_block_size))


class RefPrefixCache:
    """Hash-keyed prefix cache with reference counts and LRU eviction of idle units, each
    request's own run (its blocks past its prefix, kept for its readmission: vLLM) and
    copies (vLLM: a block computed again while its hash is cached is a second copy under
    the hash; lookups hit the oldest that survives).

    SGLang's rules (``keep_copies`` off) cache whole hash blocks; vLLM's cache each KV block
    on its own, so here a hash block ``h`` is the units ``h * per + 0 .. h * per + per - 1`` of one
    block each: the plain statement of what the kernels' whole and split entries add up to."""

    def __init__(self, hashes_per_request, prompt_tokens, block_tokens: int, kv_block_size: int,
                 keep_copies: bool = False):
        self.keep = keep_copies
        self.prompt = list(prompt_tokens)
        self.entry_hashes = [list(h) for h in hashes_per_request]  # per hash block, whatever the unit
        full = [min(len(h), p // block_tokens) for h, p in zip(hashes_per_request, self.prompt, strict=True)]
        if keep_copies:
            per = block_tokens // kv_block_size
            self.hashes = [[x * per + u for x in h[:f] for u in range(per)]
                           for h, f in zip(hashes_per_request, full, strict=True)]
            self.bt, self.entry_blocks, self.per = kv_block_size, 1, per
            self.n_full = [f * per for f in full]
        else:
            self.hashes = [list(h) for h in hashes_per_request]
            self.bt, self.entry_blocks, self.per = block_tokens, math.ceil(block_tokens / kv_block_size), 1
            self.n_full = full
        self.held = [0] * len(self.prompt)
        self.copies = [0] * len(self.prompt)  # blocks of copies computed, charged to quotas (vLLM)
        self.held_copies: list[dict[int, int]] = [{} for _ in self.prompt]  # chain position -> copy held
        self.refs: dict[int, int] = {}  # cached hash -> references (its lookups' copy)
        self.part: dict[int, int] = {}  # idle hash partly evicted -> KV blocks of its head left
        self.own: dict[int, int] = {}  # request -> blocks of its own run still cached
        self.copy_of: dict[int, list[int]] = {}  # hash -> its copies, oldest first (copy ids)
        self.copy: dict[int, list] = {}  # copy id -> [hash, blocks, holder or None, position]
        self.next_copy = 0
        # least recently released first: hashes, ("own", request) for own runs, ("copy", id)
        self.idle: OrderedDict[object, None] = OrderedDict()
        self.hit_tokens = self.query_tokens = self.inserts = self.dedups = self.evictions = 0

    def match(self, i, known):
        """Leading cached units; vLLM's rules hit at most ``(known - 1) // block_size`` blocks."""
        n_full = min(self.n_full[i], (known - 1) // self.bt) if self.keep else self.n_full[i]
        k = 0
        while k < n_full and self.hashes[i][k] in self.refs and self.hashes[i][k] not in self.part:
            k += 1
        idle = sum(self.entry_blocks for h in self.hashes[i][:k] if self.refs[h] == 0)
        return k, min(k * self.bt, self.prompt[i] - 1), idle

    def partial_blocks(self, i, k):
        return self.part.get(self.hashes[i][k], 0) if k < self.n_full[i] else 0

    def _drop(self, h):
        """Idle h leaves the cache; its oldest copy, if any, takes its place (``_promote``)."""
        self.part.pop(h, None)
        del self.refs[h], self.idle[h]
        if not self.copy_of.get(h):
            return False
        c = self.copy_of[h].pop(0)
        _, blocks, holder, position = self.copy.pop(c)
        if blocks < self.entry_blocks:
            self.part[h] = blocks
        if holder is None:
            self.refs[h] = 0
            self.idle = OrderedDict((h if key == ("copy", c) else key, None) for key in self.idle)
        else:
            self.refs[h] = 1
            del self.held_copies[holder][position]
        return True

    def take_partial(self, i, k):
        h = self.hashes[i][k] if k < self.n_full[i] else None
        if h in self.part:
            self._drop(h)

    def _ref(self, h):
        if self.refs[h] == 0:
            del self.idle[h]
        self.refs[h] += 1

    def acquire(self, i, k):
        taken = 0
        for h in self.hashes[i][:k]:
            taken += self.entry_blocks if self.refs[h] == 0 else 0
            self._ref(h)
        self.held[i] = k
        return taken

    def insert(self, i, ctx):
        last = min(self.n_full[i], ctx // self.bt)
        freed = 0
        for j in range(self.held[i], last):
            h = self.hashes[i][j]
            if h in self.part:  # what eviction left of it: this copy replaces it (SGLang)
                del self.part[h], self.refs[h], self.idle[h]
            if h in self.refs:
                if self.keep:
                    self.copy[self.next_copy] = [h, self.entry_blocks, i, j]
                    self.copy_of.setdefault(h, []).append(self.next_copy)
                    self.held_copies[i][j] = self.next_copy
                    self.next_copy += 1
                    self.copies[i] += self.entry_blocks
                else:  # an idle entry is free already: taking it back nets zero
                    freed += self.entry_blocks if self.refs[h] > 0 else 0
                    self._ref(h)
                self.dedups += 1
            else:
                self.refs[h] = 1
                self.inserts += 1
        self.held[i] = max(self.held[i], last)
        return freed

    def release(self, i):
        idle = 0
        for j in reversed(range(self.held[i])):
            c = self.held_copies[i].pop(j, None)
            if c is not None:
                self.copy[c][2] = None
                self.idle[("copy", c)] = None
                idle += self.copy[c][1]
                continue
            h = self.hashes[i][j]
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.idle[h] = None
                idle += self.entry_blocks
        self.held[i] = 0
        self.copies[i] = 0
        return idle

    def keep_tail(self, i, blocks):
        """i lets go of the full blocks it computed past its held entries: the head of its next
        entry (unless another copy is cached), or past its prompt's entries its own run."""
        k = self.held[i]
        if k < self.n_full[i]:
            h = self.hashes[i][k]
            blocks = min(blocks, self.entry_blocks - 1)
            if h not in self.refs and blocks > 0:
                self.refs[h], self.part[h], self.idle[h] = 0, blocks, None
        elif blocks > 0:
            self.own[i] = blocks
            self.idle[("own", i)] = None

    def own_blocks(self, i):
        return self.own.get(i, 0)

    def take_own(self, i):
        if self.own.pop(i, 0):
            del self.idle[("own", i)]

    def evict(self, needed):
        freed = 0
        while freed < needed and self.idle:
            key = next(iter(self.idle))
            if isinstance(key, tuple):  # an own run or a copy goes a block at a time, tail first
                kind, x = key
                left = self.own[x] if kind == "own" else self.copy[x][1]
                take = min(left, needed - freed)
                if kind == "own":
                    self.own[x] -= take
                else:
                    self.copy[x][1] -= take
                if take == left:
                    del self.idle[key]
                    if kind == "own":
                        del self.own[x]
                    else:
                        self.copy_of[self.copy.pop(x)[0]].remove(x)
                freed += take
                continue
            left = self.part.get(key, self.entry_blocks)  # so does an entry
            take = min(left, needed - freed)
            if take < left:
                self.part[key] = left - take
            elif not self._drop(key):
                self.evictions += 1
            freed += take
        return freed

    def grow_blocks(self, i, ctx_old, ctx_new, kv_block_size):
        held = self.held[i]
        after = max(held, min(self.n_full[i], ctx_new // self.bt))
        return (
            private_blocks(ctx_new, after, self.bt, kv_block_size)
            + self.entry_blocks * (after - held)
            - private_blocks(ctx_old, held, self.bt, kv_block_size)
        )

    def held_copy_blocks(self, i):
        return sum(self.copy[c][1] for c in self.held_copies[i].values())

    def cache_blocks(self):
        own = sum(self.own.values())
        whole = len(self.refs) * self.entry_blocks - sum(self.entry_blocks - b for b in self.part.values())
        idle = sum(self.part.get(key, self.entry_blocks) for key in self.idle if not isinstance(key, tuple))
        copies = sum(c[1] for c in self.copy.values() if c[2] is None)
        return whole + own + copies, idle + own + copies


# -- waiting queue -------------------------------------------------------------------------
FCFS, PRIORITY, EDF, SJF, LPM, VTC, LOF, DFS_WEIGHT = range(8)


def order_keys(order, seq, arrival, priority, deadline, job_s, aging_rate, max_out=0):
    if order == LOF:  # SGLang schedule_policy.py:504-519: sort by -max_new_tokens, stable (enqueue order)
        return -float(max_out), float(seq)
    if order == PRIORITY:
        return -priority + aging_rate * arrival, arrival
    if order == EDF:
        return (math.inf, arrival) if math.isnan(deadline) else (deadline, arrival)
    if order == SJF:
        return job_s + aging_rate * arrival, arrival
    return 0.0, float(seq)


def dfs_weight_order(cache: RefPrefixCache, waiting: list[int], key) -> list[int]:
    """SGLang 0.5.23's dfs-weight order of the waiting requests (``_dfs_weight_order``,
    sglang/srt/mem_cache/base_prefix_cache.py:347-387), as an explicit tree walk.

    Nodes are cached hashes (a hash names its prefix); a request sits at the last block
    of its matched chain (root if none). Weight = waiting requests in the subtree.
    Depth first from the root, children by descending weight, ties in the order the
    node gained them (``node.children`` is an insertion-ordered dict and the sort is
    stable: here the hash's creation order, the order of ``cache.refs``), a node's own
    requests after its subtrees, in ``key`` order (the current queue order).
    """
    unit_born = {h: n for n, h in enumerate(cache.refs)}
    born = {h: unit_born[h * cache.per] for h in {x for i in waiting for x in cache.entry_hashes[i]}
            if h * cache.per in unit_born}  # a hash block is born with its first unit
    path = {i: tuple(cache.entry_hashes[i][: cache.match(i, cache.prompt[i])[0] // cache.per]) for i in waiting}
    children: dict[tuple, set] = {(): set()}
    at: dict[tuple, list[int]] = {}
    weight: dict[tuple, int] = {}
    for i in waiting:
        p = path[i]
        at.setdefault(p, []).append(i)
        for d in range(len(p) + 1):
            weight[p[:d]] = weight.get(p[:d], 0) + 1
            children.setdefault(p[:d], set())
            if d > 0:
                children[p[: d - 1]].add(p[:d])
    order: list[int] = []

    def walk(node):
        for child in sorted(children[node], key=lambda c: (-weight[c], born[c[-1]])):
            walk(child)
        order.extend(sorted(at.get(node, ()), key=key))

    walk(())
    return order


class RefWaitQueue:
    """Waiting requests as a dict of keys; ``pick`` sorts every candidate."""

    def __init__(self, lane_of, lane_tenant):
        self.lane_of = list(lane_of)
        self.lane_tenant = list(lane_tenant)
        self.keys: dict[int, tuple[float, float]] = {}

    def push(self, i, k1, k2):
        self.keys[i] = (k1, k2)

    def remove(self, i):
        self.keys.pop(i, None)

    def promote(self, i):
        self.keys[i] = (-math.inf, self.keys[i][1])

    def pick(self, order, lane_blocked, vtc_counter, cache: RefPrefixCache | None):
        live = [i for i in self.keys if not lane_blocked[self.lane_of[i]]]
        if not live:
            return -1
        cache_aware = order == LPM and len(self.keys) <= LPM_FCFS_ABOVE

        def rank(i):
            counter = vtc_counter[self.lane_tenant[self.lane_of[i]]] if order == VTC else 0.0
            matched = cache.match(i, cache.prompt[i])[1] if cache_aware else 0
            return (counter, -matched, *self.keys[i], i)

        return min(live, key=rank)


# -- fairness ledger -----------------------------------------------------------------------
class RefShares:
    """VTC counters with the backlog lift, and raw charged service per tenant."""

    def __init__(self, weights):
        self.weight = list(weights)
        self.counter = [0.0] * len(weights)
        self.service = [0.0] * len(weights)
        self.waiting = [0] * len(weights)

    def enqueue(self, t):
        if self.waiting[t] == 0:
            others = [self.counter[u] for u in range(len(self.weight)) if u != t and self.waiting[u] > 0]
            if others:
                self.counter[t] = max(self.counter[t], min(others))
        self.waiting[t] += 1

    def dequeue(self, t):
        self.waiting[t] -= 1

    def charge(self, t, cost):
        self.service[t] += cost
        self.counter[t] += cost / self.weight[t]
