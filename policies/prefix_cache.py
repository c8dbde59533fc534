"""Block-level prefix cache keyed by the trace's prefix hashes, as jitted pure functions.

Unit of caching. The trace names a prompt's prefix per *hash block* (``Trace.block_tokens``
prompt tokens, 512 in Mooncake): a hash names the whole prefix up to and including its
block, so a request reuses the leading run of its blocks that are cached. Only *full*
hash blocks are cacheable (the partial tail of a prompt is private). The cache counts in
*units*: SGLang's target (and vLLM's when ``block_size`` does not divide the hash block)
caches whole hash blocks, one unit each; vLLM's caches each full KV block of a hash block
on its own (``per_entry = block_tokens // block_size`` units of one block), as vLLM hashes
16-token blocks (vllm/v1/core/kv_cache_utils.py, block_pool.py). ``req`` counts a
request's cacheable and held units, and a request holding ``held`` leading units keeps
privately only the KV blocks of tokens past ``held * unit_tokens``:
``private_blocks(ctx, held) = ceil((ctx - held * unit_tokens) / block_size)``.

Life of a unit:
- ``match`` finds a request's leading run of cached units (no mutation);
- ``acquire`` takes a reference on each (referenced units are never evicted);
- ``insert`` runs as a step is formed, for the full units its chunk completes (vLLM caches
  a block once it is scheduled, so a request admitted later in the same step hits it): each
  becomes a unit referenced by its request (its KV blocks move from the request to the
  cache); one another request cached meanwhile is deduplicated (SGLang: the radix tree
  frees the duplicate at once, and the request references the cached one) or kept as a
  *copy* (vLLM, below);
- ``release`` drops a request's references (finish, preemption, cancel, rejection), deepest
  first: units left unreferenced join the LRU list, so a chain's tail is evicted before its
  head (as vLLM frees a request's blocks in reverse);
- ``evict`` frees unreferenced units from the LRU head when free KV runs out, a KV block at
  a time. SGLang's whole-block unit is evicted tail first, and a lookup hits the head of a
  partly evicted one (``partial_blocks``): the request that takes it computes the rest.

Whole entries and split entries (vLLM). Most hash blocks are computed by one request, so
their ``per_entry`` units share one holder set and one LRU place: such an entry is one
``tab`` column (its *whole* node) holding its leading units, evicted a block at a time from
its tail, exactly as its units would be. The node grows as its computer's chunks cover more
of the block, and a request that hits a node's head holds all it holds. An entry is *split*
(``_split``) into one pool column per unit once its units part ways: the node grows while
another request holds its head, two requests compute the block side by side, a request's
hit ends inside the node, or a copy outlives part of it. A split entry's unit heads are
found through ``units``, an open-addressing table from (entry, unit) to column; it is whole
again once computed to its end with its units alike (``_merge``), or once none is cached.
Both shapes give the same answers, unit for unit (``tests/policies/reference_sharing.py``
states the rules per unit).

Copies (vLLM): vLLM never deduplicates. A block computed again under a hash that is cached
stays the computing request's, and the hash maps to every such block in insertion order; a
lookup takes the oldest surviving one (vllm/v1/core/block_pool.py:49-53, 63-100, 666-686).
Each physical copy is a node of its own: a pool column held by its request at its chain
position (``E_AT``) and linked behind the unit's node (``E_NEXT``, oldest first). Its blocks
count as the request's (``R_COPIES`` for quotas) while it is held; when the request lets go
it joins the LRU list at its place in the reversed chain, like any block vLLM frees;
evicting it takes it off its unit's list. The head node is the one lookups hit: when it is
evicted and a copy survives, the oldest copy takes its place (``_promote``), with its holder
or its LRU place. So a unit goes idle when its hitters let go, while copies of it are still
held, as vLLM's ref counts are per block.

Own runs (vLLM, ``keep_tail``): vLLM hashes every full block of a request, its generated
tokens included, and a freed block keeps its hash until the block is reused
(vllm/v1/core/block_pool.py ``free_blocks``, ``_maybe_evict_cached_block``), so a request
preempted for recompute finds its own blocks again when readmitted
(vllm/v1/core/kv_cache_manager.py:616-625). Such blocks are the request's alone; one LRU
node per request (a column past the trace's entries) holds the full blocks it computed past
its cacheable prefix. It joins the LRU list when the request lets go, before its prefix
units (vLLM frees a request's blocks tail first), and is evicted a KV block at a time, its
tail first, so a readmitted request finds the leading part that survived.

A full-prompt hit still computes one token (the logits need a forward pass), as vLLM:
the cached tokens are capped at ``prompt - 1``; that token rewrites its slot in the
last shared block, so it costs no extra KV block.

Entries are dense ids (``np.unique`` over the trace's hashes, once per trace), so whole
entries are plain arrays indexed by entry; only split entries' units go through a table.

Identity: a block's KV is the same only for the same tokens *and* the same request
identity. Both engines fold a per-request ``cache_salt`` into the key (vLLM:
``_gen_extra_keys`` puts it in the first block's hash, which chains into every later one,
vllm/v1/core/kv_cache_utils.py:659-669; SGLang: ``RadixKey`` namespaces the tree by it,
sglang/srt/mem_cache/radix_cache.py:72-77, 245-247), so tenants of different security
domains never share a block; a LoRA adapter's or another model version's KV is other KV
too. ``Trace.cache_block_hashes`` salts the trace's hashes by (model version, adapter,
salt) once per trace; the cache and the consistent-hash ring both key on the result.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit

# indices into PrefixCache.stats
S_HEAD = 0  # LRU list head (least recently released node), -1 if empty
S_TAIL = 1  # LRU list tail, -1 if empty
S_CACHED = 2  # KV blocks held by cached nodes and own runs (not by copies still held)
S_EVICTABLE = 3  # ... of them unreferenced (on the LRU list)
S_INSERTS = 4  # units created
S_DEDUPS = 5  # units computed twice because another request cached them first
S_EVICTIONS = 6  # units no longer cached by eviction (own runs and copies not counted)
S_POOL_NEXT = 7  # node pool: the next column never used yet
S_POOL_FREE = 8  # node pool: a stack of columns freed, linked through E_NEXT (-1: empty)
# 0 spares the hot paths a look at another row of an entry (each row, another cache miss):
S_COPIES = 9  # whole copies alive (eviction need not read E_NEXT)
S_SPLITS = 10  # split entries alive (a release need not read E_CACHED)
N_STATS = 11


# rows of PrefixCache.req (per request) and PrefixCache.tab (per column)
R_N_FULL = 0  # cacheable units of the prompt (its full hash blocks; 0 with caching off)
R_HELD = 1  # leading units the request holds: units it references, or its copies
R_COPIES = 2  # KV blocks of copies it computed (vLLM), charged to its quotas until it lets go
R_COPY_HEAD = 3  # its deepest copy still held (-1: none); E_HELD_NEXT links the shallower ones
N_REQ_ROWS = 4
E_CACHED = 0  # KV blocks the node holds (fewer once partly evicted; 0: not cached; SPLIT: a split entry)
E_REFS = 1
E_LRU_PREV = 2  # doubly linked LRU list of unreferenced cached nodes
E_LRU_NEXT = 3
E_BORN = 4  # S_INSERTS when the entry was last created: the order SGLang's radix node gains its children
E_WAIT = 5  # scratch, zero between calls: waiting requests whose matched chain holds the entry (dfs_weight)
E_NEXT = 6  # a head node's oldest copy, a copy's next younger one (-1: none); a free pool column's next
E_SPLIT = 7  # a split entry's column: its units cached, each a pool column (``_split``)
# rows of pool columns only (``clear`` leaves them to ``_take_column``)
E_ENTRY = 8  # the entry a pool column (a whole copy, or a split unit) belongs to
E_UNIT = 9  # a unit node's unit in its entry; -1 for a whole copy
E_AT = 10  # a copy's chain position: its request's unit index (offsets * per_entry + unit held)
E_OWNER = 11  # the request that computed a copy
E_HELD_NEXT = 12  # a held copy's next shallower copy held by the same request (-1: none)
N_ENTRY_ROWS = 13
SPLIT = -1  # E_CACHED of a split entry: whole or not is read from the row a lookup reads anyway
FREE_KEY = -1  # an empty slot of the unit table
_HASH_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing


class PrefixCache(NamedTuple):
    """Cache state as a few arrays; build with ``new_prefix_cache``.

    ``entry``: per trace block (aligned with ``Trace.block_hashes``), its dense entry id
    (read-only, shared). ``req[ROW, request]`` (R_*) and ``tab[ROW, column]`` (E_*) are
    field-major matrices: few arrays keep calls cheap in the kernel. ``tab`` has one column
    per entry (its whole node), then per request one for its own run (``own_column``), then
    a pool for copies and split units (vLLM: as many columns as KV blocks, since each holds
    one at least; only the columns used are ever written). ``units`` is the table of split
    units' head nodes: keys (entry * per_entry + unit) in row 0, columns in row 1.
    """

    entry: np.ndarray  # i8[H]
    req: np.ndarray  # i8[N_REQ_ROWS, n]
    tab: np.ndarray  # i8[N_ENTRY_ROWS, n_entries + n + pool]
    stats: np.ndarray  # i8[N_STATS]
    units: np.ndarray  # i8[2, table size (a power of two), or 0 without copies]
    unit_tokens: int
    unit_blocks: int  # KV blocks per unit
    kv_block_size: int
    n_entries: int
    per_entry: int  # units per hash block
    keep_copies: int  # 1: vLLM's rules (copies, units of one KV block); 0: SGLang's (dedup)

    # Python-side views by name (tests, inspection)
    n_full = property(lambda self: self.req[R_N_FULL])
    held = property(lambda self: self.req[R_HELD])
    copies = property(lambda self: self.req[R_COPIES])
    cached = property(lambda self: self.tab[E_CACHED, :self.n_entries] > 0)  # per whole entry
    refs = property(lambda self: self.tab[E_REFS, :self.n_entries])
    entry_blocks = property(lambda self: self.per_entry * self.unit_blocks)  # KV blocks per hash block


def prefix_layout(
    block_offsets: np.ndarray, block_hashes: np.ndarray, prompt_tokens: np.ndarray, block_tokens: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Per trace block its dense entry id, per request its cacheable (full) hash blocks,
    and the number of distinct entries: computed once per trace."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    uniques, inverse = np.unique(np.asarray(block_hashes, dtype=np.int64), return_inverse=True)
    n_blocks = np.diff(np.asarray(block_offsets, dtype=np.int64))
    n_full = np.minimum(n_blocks, np.asarray(prompt_tokens, dtype=np.int64) // block_tokens)
    return inverse.astype(np.int64).ravel(), n_full.astype(np.int64), len(uniques)


@njit(cache=True, nogil=True, _nrt=False)
def unit_shape(block_tokens, kv_block_size, keep_copies):
    """(unit tokens, KV blocks per unit, units per hash block): vLLM's rules cache each KV
    block of a hash block (``block_size`` divides it), SGLang's the whole hash block."""
    if keep_copies:
        return kv_block_size, 1, block_tokens // kv_block_size
    return block_tokens, (block_tokens + kv_block_size - 1) // kv_block_size, 1


@njit(cache=True, nogil=True, _nrt=True)
def new_unit_table(pool):
    """The table of split units' heads for a pool of ``pool`` columns (none without copies):
    a power of two at least twice the most heads it can hold, so probes stay short."""
    size = 4
    while size < 2 * pool:
        size *= 2
    return np.full((2, size if pool > 0 else 0), FREE_KEY, dtype=np.int64)


@njit(cache=True, nogil=True, _nrt=True)
def empty_cache(entry, n_full, n_entries, unit_tokens, unit_blocks, kv_block_size, per_entry, keep_copies, pool):
    """An empty cache over a ``prefix_layout`` for one unit shape (``unit_shape``), with
    ``pool`` columns for copies and split units (0 without ``keep_copies``)."""
    pc = PrefixCache(entry, np.empty((N_REQ_ROWS, n_full.shape[0]), dtype=np.int64),
                     np.empty((N_ENTRY_ROWS, n_entries + n_full.shape[0] + pool), dtype=np.int64),
                     np.empty(N_STATS, dtype=np.int64), new_unit_table(pool), unit_tokens, unit_blocks,
                     kv_block_size, n_entries, per_entry, keep_copies)
    clear(pc, n_full)
    return pc


@njit(cache=True, nogil=True, _nrt=True)
def clear(pc, n_full):
    """Empty the cache in place: nothing cached or referenced, counters zero, the pool
    unused; ``n_full`` sets the cacheable hash blocks per request (zeros: caching off)."""
    for r in range(n_full.shape[0]):
        pc.req[R_N_FULL, r] = n_full[r] * pc.per_entry
    pc.req[R_HELD] = 0
    pc.req[R_COPIES] = 0
    pc.req[R_COPY_HEAD] = -1
    fixed = pc.n_entries + pc.req.shape[1]  # the pool's columns are written as they are taken,
    pc.tab[:E_ENTRY, :fixed] = 0  # and so are the rows only they use
    pc.tab[E_LRU_PREV, :fixed] = -1
    pc.tab[E_LRU_NEXT, :fixed] = -1
    pc.tab[E_NEXT, :fixed] = -1
    pc.units[0] = FREE_KEY
    pc.stats[:] = 0
    pc.stats[S_HEAD] = -1
    pc.stats[S_TAIL] = -1
    pc.stats[S_POOL_NEXT] = fixed
    pc.stats[S_POOL_FREE] = -1


def new_prefix_cache(
    block_offsets: np.ndarray,
    block_hashes: np.ndarray,
    prompt_tokens: np.ndarray,
    block_tokens: int,
    kv_block_size: int,
    keep_copies: bool = False,
    pool: int = 0,
) -> PrefixCache:
    """An empty cache for one trace (CSR prefix blocks) and one KV block size; vLLM's rules
    (``keep_copies``) need ``pool`` columns, one per KV block of the GPU at most."""
    if kv_block_size <= 0:
        raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
    if keep_copies and block_tokens % kv_block_size:
        raise ValueError(f"vLLM's block cache needs block_size {kv_block_size} to divide the hash block's "
                         f"{block_tokens} tokens")
    entry, n_full, n_entries = prefix_layout(block_offsets, block_hashes, prompt_tokens, block_tokens)
    unit_tokens, unit_blocks, per_entry = unit_shape(int(block_tokens), int(kv_block_size), bool(keep_copies))
    return empty_cache(entry, n_full, n_entries, unit_tokens, unit_blocks, int(kv_block_size), per_entry,
                       1 if keep_copies else 0, int(pool) if keep_copies else 0)


# -- KV accounting (pure arithmetic) ------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def kv_blocks(tokens, kv_block_size):
    """KV blocks that hold ``tokens`` tokens (tokens >= 0)."""
    return (tokens + kv_block_size - 1) // kv_block_size


@njit(cache=True, nogil=True, inline="always")
def private_blocks(ctx, held, unit_tokens, kv_block_size):
    """KV blocks a request owns for ``ctx`` tokens when it holds ``held`` units."""
    own = ctx - held * unit_tokens
    if own <= 0:
        return 0
    return kv_blocks(own, kv_block_size)


@njit(cache=True, nogil=True, _nrt=False)
def grow_blocks(ctx_old, ctx_new, held, n_full, unit_tokens, kv_block_size, unit_blocks):
    """KV blocks to allocate for computing tokens ``ctx_old..ctx_new`` of a request.

    Counts every full unit the chunk completes as a new one (``unit_blocks``); ``insert``
    later hands back the blocks of any that turn out to be duplicates. With ``n_full = 0``
    (caching off) this is ``ceil(new/bs) - ceil(old/bs)``.
    """
    held_after = max(held, min(n_full, ctx_new // unit_tokens))
    return (
        private_blocks(ctx_new, held_after, unit_tokens, kv_block_size)
        + unit_blocks * (held_after - held)
        - private_blocks(ctx_old, held, unit_tokens, kv_block_size)
    )


# -- LRU list of unreferenced nodes ----------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def _lru_append(pc, e):
    """Put idle e at the LRU tail; its blocks become evictable."""
    tail = pc.stats[S_TAIL]
    pc.tab[E_LRU_PREV, e] = tail
    pc.tab[E_LRU_NEXT, e] = -1
    if tail >= 0:
        pc.tab[E_LRU_NEXT, tail] = e
    else:
        pc.stats[S_HEAD] = e
    pc.stats[S_TAIL] = e
    pc.stats[S_EVICTABLE] += pc.tab[E_CACHED, e]


@njit(cache=True, nogil=True, inline="always")
def _lru_link(pc, a, b):
    """Make b follow a in the LRU list (a = -1: b is its head; b = -1: a is its tail)."""
    if a >= 0:
        pc.tab[E_LRU_NEXT, a] = b
    else:
        pc.stats[S_HEAD] = b
    if b >= 0:
        pc.tab[E_LRU_PREV, b] = a
    else:
        pc.stats[S_TAIL] = a


@njit(cache=True, nogil=True, inline="always")
def _lru_unlink(pc, e):
    """Take e off the LRU list; its blocks stop being evictable."""
    _lru_link(pc, pc.tab[E_LRU_PREV, e], pc.tab[E_LRU_NEXT, e])
    pc.tab[E_LRU_PREV, e] = -1
    pc.tab[E_LRU_NEXT, e] = -1
    pc.stats[S_EVICTABLE] -= pc.tab[E_CACHED, e]


@njit(cache=True, nogil=True, inline="always")
def _forget(pc, e):
    """Idle e stops being cached (its blocks count free as before, plain ones now); returns them."""
    blocks = pc.tab[E_CACHED, e]
    if blocks > 0:
        _lru_unlink(pc, e)
        pc.tab[E_CACHED, e] = 0
        pc.stats[S_CACHED] -= blocks
    return blocks


@njit(cache=True, nogil=True, inline="always")
def _ref(pc, e):
    if pc.tab[E_REFS, e] == 0:
        _lru_unlink(pc, e)
    pc.tab[E_REFS, e] += 1


# -- the table of split units' heads (open addressing, linear probing) -----------------------
@njit(cache=True, nogil=True, inline="always")
def _home(key, mask):
    return ((key * _HASH_MUL) >> 17) & mask


@njit(cache=True, nogil=True, _nrt=False)
def _head(pc, e, u):
    """The node lookups hit for unit u of split entry e (-1: not cached)."""
    key = e * pc.per_entry + u
    keys = pc.units[0]
    mask = keys.shape[0] - 1
    s = _home(key, mask)
    while keys[s] != FREE_KEY:
        if keys[s] == key:
            return pc.units[1, s]
        s = (s + 1) & mask
    return -1


@njit(cache=True, nogil=True, _nrt=False)
def _set_head(pc, key, c):
    keys = pc.units[0]
    mask = keys.shape[0] - 1
    s = _home(key, mask)
    while keys[s] != FREE_KEY and keys[s] != key:
        s = (s + 1) & mask
    keys[s] = key
    pc.units[1, s] = c


@njit(cache=True, nogil=True, _nrt=False)
def _drop_head(pc, key):
    """Remove ``key``, shifting back the keys probed past it so every lookup still finds its own."""
    keys = pc.units[0]
    mask = keys.shape[0] - 1
    gap = _home(key, mask)
    while keys[gap] != key:
        gap = (gap + 1) & mask
    s = gap
    while True:
        s = (s + 1) & mask
        if keys[s] == FREE_KEY:
            break
        home = _home(keys[s], mask)
        if (home <= gap or home > s) if gap < s else (s < home <= gap):  # home not in (gap, s]
            keys[gap] = keys[s]
            pc.units[1, gap] = pc.units[1, s]
            gap = s
    keys[gap] = FREE_KEY


# -- pool columns: copies and split units ----------------------------------------------------
@njit(cache=True, nogil=True, _nrt=False)
def _take_column(pc, e, unit, blocks, refs):
    """A fresh pool column holding ``blocks`` KV blocks with ``refs`` references, off the LRU list."""
    c = pc.stats[S_POOL_FREE]
    if c >= 0:
        pc.stats[S_POOL_FREE] = pc.tab[E_NEXT, c]
    else:
        c = pc.stats[S_POOL_NEXT]
        if c >= pc.tab.shape[1]:  # every live node holds a KV block: more than the pool is a ledger bug
            raise RuntimeError("prefix cache: more nodes than the pool holds")
        pc.stats[S_POOL_NEXT] += 1
    pc.tab[E_CACHED, c] = blocks
    pc.tab[E_REFS, c] = refs
    pc.tab[E_LRU_PREV, c] = -1
    pc.tab[E_LRU_NEXT, c] = -1
    pc.tab[E_NEXT, c] = -1
    pc.tab[E_ENTRY, c] = e
    pc.tab[E_UNIT, c] = unit
    pc.tab[E_AT, c] = -1
    pc.tab[E_OWNER, c] = -1
    pc.tab[E_HELD_NEXT, c] = -1
    return c


@njit(cache=True, nogil=True, inline="always")
def _recycle(pc, c):
    pc.tab[E_NEXT, c] = pc.stats[S_POOL_FREE]
    pc.stats[S_POOL_FREE] = c


@njit(cache=True, nogil=True, inline="always")
def _append_copy(pc, head, c):
    """Link copy c behind the youngest node of ``head``'s chain."""
    last = head
    while pc.tab[E_NEXT, last] >= 0:
        last = pc.tab[E_NEXT, last]
    pc.tab[E_NEXT, last] = c


@njit(cache=True, nogil=True, inline="always")
def _hold_copy(pc, c, at, i):
    """Request i holds copy c at its unit index ``at``: the deepest of its copies so far."""
    pc.tab[E_AT, c] = at
    pc.tab[E_OWNER, c] = i
    pc.tab[E_HELD_NEXT, c] = pc.req[R_COPY_HEAD, i]
    pc.req[R_COPY_HEAD, i] = c


@njit(cache=True, nogil=True, _nrt=False)
def _held_before(pc, c):
    """The held copy before c in its request's list (-1: c is its head)."""
    prev = -1
    x = pc.req[R_COPY_HEAD, pc.tab[E_OWNER, c]]
    while x != c:
        prev = x
        x = pc.tab[E_HELD_NEXT, x]
    return prev


@njit(cache=True, nogil=True, inline="always")
def _held_link(pc, i, a, b):
    """Make b follow a in request i's list of held copies (a = -1: b is its head)."""
    if a >= 0:
        pc.tab[E_HELD_NEXT, a] = b
    else:
        pc.req[R_COPY_HEAD, i] = b


@njit(cache=True, nogil=True, _nrt=False)
def _unhold(pc, c):
    """Take held copy c off its request's list: it became the node lookups hit, which its
    holder now references (its quota stays charged until it lets go)."""
    _held_link(pc, pc.tab[E_OWNER, c], _held_before(pc, c), pc.tab[E_HELD_NEXT, c])
    pc.stats[S_CACHED] += pc.tab[E_CACHED, c]


@njit(cache=True, nogil=True, _nrt=False)
def _unlink_copy(pc, head, c):
    """Take copy c off the chain behind ``head`` and back to the pool."""
    prev = head
    while pc.tab[E_NEXT, prev] != c:
        prev = pc.tab[E_NEXT, prev]
    pc.tab[E_NEXT, prev] = pc.tab[E_NEXT, c]
    _recycle(pc, c)


@njit(cache=True, nogil=True, _nrt=False)
def _promote(pc, e):
    """Whole entry e's column, just emptied, takes its oldest copy, which lookups hit from
    now on: with its holder, who now references e, or with its place in the LRU list."""
    c = pc.tab[E_NEXT, e]
    pc.tab[E_NEXT, e] = pc.tab[E_NEXT, c]
    pc.tab[E_CACHED, e] = pc.tab[E_CACHED, c]
    pc.tab[E_REFS, e] = pc.tab[E_REFS, c]
    if pc.tab[E_REFS, c] > 0:
        _unhold(pc, c)
    else:
        nxt = pc.tab[E_LRU_NEXT, c]
        _lru_link(pc, pc.tab[E_LRU_PREV, c], e)
        _lru_link(pc, e, nxt)
    _recycle(pc, c)
    pc.stats[S_COPIES] -= 1
    if pc.tab[E_CACHED, e] < pc.per_entry * pc.unit_blocks and pc.tab[E_NEXT, e] >= 0:
        _split(pc, e)  # the younger copies' tails now serve the units it lacks


@njit(cache=True, nogil=True, _nrt=False)
def _split_node(pc, e, x):
    """Node x of whole entry e (its column, or a whole copy behind it) becomes one pool
    column per cached unit, in x's place: the LRU list (tail unit nearest the head, as an
    entry is evicted) or its holder's list of copies. A unit no older node holds becomes
    the head lookups hit."""
    blocks = pc.tab[E_CACHED, x]
    refs = pc.tab[E_REFS, x]
    whole = x == e
    owner = -1 if whole else pc.tab[E_OWNER, x]
    held_copy = not whole and refs > 0
    if held_copy:
        last = _held_before(pc, x)
        after = pc.tab[E_HELD_NEXT, x]
    else:
        last = pc.tab[E_LRU_PREV, x]
        after = pc.tab[E_LRU_NEXT, x]
    idle = refs == 0 and blocks > 0
    for u in range(blocks - 1, -1, -1):
        c = _take_column(pc, e, u, 1, refs)
        head = _head(pc, e, u)
        if head < 0:
            _set_head(pc, e * pc.per_entry + u, c)
            pc.tab[E_SPLIT, e] += 1
            if held_copy:  # its holder references the head now
                pc.stats[S_CACHED] += 1
                continue
        else:
            _append_copy(pc, head, c)
            pc.tab[E_AT, c] = pc.tab[E_AT, x] + u
            pc.tab[E_OWNER, c] = owner
        if idle:
            _lru_link(pc, last, c)
            last = c
        elif held_copy:
            _held_link(pc, owner, last, c)
            last = c
    if idle:
        _lru_link(pc, last, after)
    elif held_copy:
        _held_link(pc, owner, last, after)


@njit(cache=True, nogil=True, _nrt=False)
def _split(pc, e):
    """Whole entry e becomes split: its node and each copy of it, oldest first, one pool
    column per unit (``_split_node``); its column then holds nothing."""
    pc.tab[E_SPLIT, e] = 0
    pc.stats[S_SPLITS] += 1
    copy = pc.tab[E_NEXT, e]
    _split_node(pc, e, e)
    pc.tab[E_CACHED, e] = SPLIT
    pc.tab[E_REFS, e] = 0
    pc.tab[E_LRU_PREV, e] = -1
    pc.tab[E_LRU_NEXT, e] = -1
    pc.tab[E_NEXT, e] = -1
    while copy >= 0:
        nxt = pc.tab[E_NEXT, copy]
        _split_node(pc, e, copy)
        _recycle(pc, copy)
        pc.stats[S_COPIES] -= 1
        copy = nxt


@njit(cache=True, nogil=True, _nrt=False)
def _evict_unit(pc, c):
    """Idle unit node c is evicted: off its unit's chain; a head gives way to its oldest copy,
    and the entry is whole again once none of its units is cached. Returns whether the
    unit stopped being cached."""
    _forget(pc, c)
    e = pc.tab[E_ENTRY, c]
    key = e * pc.per_entry + pc.tab[E_UNIT, c]
    head = _head(pc, e, pc.tab[E_UNIT, c])
    if head != c:
        _unlink_copy(pc, head, c)
        return False
    nxt = pc.tab[E_NEXT, c]
    _recycle(pc, c)
    if nxt >= 0:
        _set_head(pc, key, nxt)
        if pc.tab[E_REFS, nxt] > 0:
            _unhold(pc, nxt)
        return False
    _drop_head(pc, key)
    pc.tab[E_SPLIT, e] -= 1
    if pc.tab[E_SPLIT, e] == 0:
        pc.tab[E_CACHED, e] = 0  # whole again, and empty
        pc.stats[S_SPLITS] -= 1
    return True


@njit(cache=True, nogil=True, _nrt=False)
def _merge(pc, e):
    """Split entry e, just computed to its end, is whole again if its units agree: each
    cached once (no copy), all referenced, equally often. Held units have no LRU place, and
    equal counts mean every holder holds all of them, so one node says the same (a request
    computing a long prompt in chunks splits the entry its chunk ends in, then completes it)."""
    per = pc.per_entry
    if pc.tab[E_SPLIT, e] != per:
        return
    refs = pc.tab[E_REFS, _head(pc, e, 0)]
    for u in range(per):
        c = _head(pc, e, u)
        if pc.tab[E_REFS, c] != refs or refs == 0 or pc.tab[E_NEXT, c] >= 0:
            return
    for u in range(per):
        key = e * per + u
        _recycle(pc, _head(pc, e, u))
        _drop_head(pc, key)
    pc.tab[E_CACHED, e] = per * pc.unit_blocks
    pc.tab[E_REFS, e] = refs
    pc.stats[S_SPLITS] -= 1
    pc.tab[E_NEXT, e] = -1


@njit(cache=True, nogil=True, inline="always")
def _whole(pc, e):
    return pc.stats[S_SPLITS] == 0 or pc.tab[E_CACHED, e] != SPLIT


# -- operations ----------------------------------------------------------------------------
@njit(cache=True, nogil=True, _nrt=False)
def match(pc, block_offsets, prompt_tokens, i, known):
    """Leading units of request i that are cached: (units, cached tokens, KV blocks now idle).

    Cached tokens are capped at ``prompt - 1`` so a full hit still computes one token; with
    vLLM's rules at most ``(known - 1) // block_size`` blocks are hit, ``known`` being the
    tokens the request has (its prompt, and what it generated before a preemption): a
    prompt whose every block is cached computes its last block again
    (vllm/v1/core/kv_cache_manager.py ``get_computed_blocks``, ``max_cache_hit_length``).
    Idle units are unreferenced: acquiring them takes their blocks off the evictable list,
    which the caller must count when checking free KV before it acquires. With vLLM's rules
    the head of a whole entry (left by eviction, or still being computed) counts unit by
    unit, as a split entry's units do.
    """
    base = block_offsets[i]
    per = pc.per_entry
    n_full = pc.req[R_N_FULL, i]
    if pc.keep_copies:
        n_full = min(n_full, (known - 1) // pc.unit_tokens)
    h = 0
    j = 0  # the entry of unit h (h = j * per here): counted, not divided, in the hot loops
    idle = 0
    while h < n_full:
        e = pc.entry[base + j]
        j += 1
        if _whole(pc, e):
            cached = pc.tab[E_CACHED, e]
            if not pc.keep_copies:  # SGLang: whole hash blocks only
                if cached < pc.unit_blocks:
                    break
                if pc.tab[E_REFS, e] == 0:
                    idle += cached
                h += 1
                continue
            n = min(cached, n_full - h)  # its head: left by eviction, or its computer is still at it
            if pc.tab[E_REFS, e] == 0:
                idle += n
            h += n
            if n < per:
                break
            continue
        u = 0
        while u < per and h < n_full:
            c = _head(pc, e, u)
            if c < 0:
                break
            if pc.tab[E_REFS, c] == 0:
                idle += 1
            u += 1
            h += 1
        if u < per:
            break
    tokens = min(h * pc.unit_tokens, prompt_tokens[i] - 1)
    return h, tokens, idle


@njit(cache=True, nogil=True, _nrt=False)
def acquire(pc, block_offsets, i, h):
    """Reference request i's first h units (all cached, as ``match`` found them); holding
    part of what a whole entry's node holds splits it first.

    Returns the KV blocks that stopped being idle: ``match``'s count, unless an entry
    repeats in the chain (only a synthetic trace does that; a hash names its whole prefix).
    """
    base = block_offsets[i]
    per = pc.per_entry
    taken = 0
    for j in range((h + per - 1) // per):
        e = pc.entry[base + j]
        n = min(per, h - j * per)
        if _whole(pc, e):
            if n == per or n * pc.unit_blocks == pc.tab[E_CACHED, e]:  # all its node holds
                if pc.tab[E_REFS, e] == 0:
                    taken += pc.tab[E_CACHED, e]
                _ref(pc, e)
                continue
            _split(pc, e)
        for u in range(n):
            c = _head(pc, e, u)
            if pc.tab[E_REFS, c] == 0:
                taken += 1
            _ref(pc, c)
    pc.req[R_HELD, i] = h
    return taken


@njit(cache=True, nogil=True, _nrt=False)
def _insert_unit(pc, e, u, at, i):
    """Request i computed unit u of split entry e (its unit index ``at``): the head if none is
    cached, else a copy it holds."""
    key = e * pc.per_entry + u
    head = _head(pc, e, u)
    c = _take_column(pc, e, u, 1, 1)
    if head >= 0:
        _append_copy(pc, head, c)
        _hold_copy(pc, c, at, i)
        pc.req[R_COPIES, i] += 1
        pc.stats[S_DEDUPS] += 1
        return
    _set_head(pc, key, c)
    pc.tab[E_SPLIT, e] += 1
    pc.stats[S_CACHED] += 1
    pc.stats[S_INSERTS] += 1


@njit(cache=True, nogil=True, inline="always")  # inlined: insert's hot path
def _insert_whole(pc, e, lo, hi, at, i):
    """Request i computed units ``lo..hi`` of whole entry e, holding its first ``lo``; ``at``
    is its unit index of the entry's first unit. Returns the KV blocks freed by
    deduplication (SGLang), or -1 when the units part ways and e must be split first.

    A whole node may hold only the entry's head while its computer, alone, is still at it:
    the node grows with each chunk, and a request that hits the head holds all the node has.
    """
    ub = pc.unit_blocks
    blocks = pc.per_entry * ub
    cached = pc.tab[E_CACHED, e]
    if lo == 0 and hi == pc.per_entry and cached == blocks:
        pc.stats[S_DEDUPS] += pc.per_entry
        if pc.keep_copies:
            c = _take_column(pc, e, -1, blocks, 1)
            pc.stats[S_COPIES] += 1
            _append_copy(pc, e, c)
            _hold_copy(pc, c, at, i)
            pc.req[R_COPIES, i] += blocks
            return 0
        # an idle entry is free already: taking it back nets zero, a referenced one frees the copy
        freed = blocks if pc.tab[E_REFS, e] > 0 else 0
        _ref(pc, e)
        return freed
    if lo == 0 and (cached == 0 or not pc.keep_copies):
        _forget(pc, e)  # what eviction left of it, if anything: this one replaces it (SGLang)
        pc.tab[E_CACHED, e] = hi * ub
        pc.tab[E_REFS, e] = 1
        pc.tab[E_BORN, e] = pc.stats[S_INSERTS]
        pc.stats[S_CACHED] += hi * ub
        pc.stats[S_INSERTS] += hi
        return 0
    if lo > 0 and cached == lo * ub and pc.tab[E_REFS, e] == 1:  # its own node, held by it alone
        pc.tab[E_CACHED, e] = hi * ub
        pc.stats[S_CACHED] += (hi - lo) * ub
        pc.stats[S_INSERTS] += hi - lo
        return 0
    return -1


@njit(cache=True, nogil=True, _nrt=False)
def insert(pc, block_offsets, i, ctx):
    """Cache the full units request i completed by ``ctx`` computed tokens.

    Returns the KV blocks freed by deduplication (blocks of this request that another
    request had cached first); the caller returns them to the free pool. With vLLM's rules
    they stay the request's as copies (``R_COPIES``) and nothing is freed. Without, an idle
    entry counts as free already, so deduplicating onto it frees nothing: the request's
    copy goes back to the pool exactly as the entry it now references leaves it.
    """
    base = block_offsets[i]
    per = pc.per_entry
    last = min(pc.req[R_N_FULL, i], ctx // pc.unit_tokens)
    freed = 0
    h = pc.req[R_HELD, i]
    j = h // per
    start = j * per
    while h < last:
        end = min(last, start + per)
        e = pc.entry[base + j]
        if _whole(pc, e):
            got = _insert_whole(pc, e, h - start, end - start, base * per + start, i)
        else:
            got = -1
        if got >= 0:
            freed += got
        else:
            if _whole(pc, e):
                _split(pc, e)
            for k in range(h, end):
                _insert_unit(pc, e, k - start, base * per + k, i)
            if end == start + per:
                _merge(pc, e)
        h = end
        j += 1
        start += per
    if last > pc.req[R_HELD, i]:
        pc.req[R_HELD, i] = last
    return freed


@njit(cache=True, nogil=True, inline="always")
def _let_copy_go(pc, c):
    """Request let go of its copy c: idle, at the LRU tail. Returns its blocks."""
    pc.tab[E_REFS, c] = 0
    pc.stats[S_CACHED] += pc.tab[E_CACHED, c]
    _lru_append(pc, c)
    return pc.tab[E_CACHED, c]


@njit(cache=True, nogil=True, inline="always")
def _unref(pc, e):
    """Drop one reference on node e; returns the blocks that became idle."""
    pc.tab[E_REFS, e] -= 1
    if pc.tab[E_REFS, e] == 0:
        _lru_append(pc, e)
        return pc.tab[E_CACHED, e]
    return 0


@njit(cache=True, nogil=True, _nrt=False)
def release(pc, block_offsets, i):
    """Drop request i's references and copies, deepest first (vLLM frees a request's blocks
    in reverse): idle units and copies become evictable.

    Returns the KV blocks of nodes that became idle (so available again).
    """
    base = block_offsets[i]
    per = pc.per_entry
    idle = 0
    c = pc.req[R_COPY_HEAD, i]
    h = pc.req[R_HELD, i]
    j = (h - 1) // per
    start = j * per
    while h > 0:
        e = pc.entry[base + j]
        if _whole(pc, e):  # its holders hold all the node holds
            if c >= 0 and pc.tab[E_AT, c] == base * per + start:
                nxt = pc.tab[E_HELD_NEXT, c]
                idle += _let_copy_go(pc, c)
                c = nxt
            else:
                idle += _unref(pc, e)
        else:
            for k in range(h - 1, start - 1, -1):
                if c >= 0 and pc.tab[E_AT, c] == base * per + k:
                    nxt = pc.tab[E_HELD_NEXT, c]
                    idle += _let_copy_go(pc, c)
                    c = nxt
                else:
                    idle += _unref(pc, _head(pc, e, k - start))
        h = start
        j -= 1
        start -= per
    pc.req[R_HELD, i] = 0
    pc.req[R_COPIES, i] = 0
    pc.req[R_COPY_HEAD, i] = -1
    return idle


@njit(cache=True, nogil=True, inline="always")  # inlined: eviction's hot path, where copies are rare
def _drop(pc, e):
    """Idle whole entry e stops being cached (``_forget``); its oldest copy takes its place.
    Returns whether one did."""
    _forget(pc, e)
    if pc.stats[S_COPIES] == 0 or pc.tab[E_NEXT, e] < 0:
        return False
    _promote(pc, e)
    return True


@njit(cache=True, nogil=True, _nrt=False)
def evict(pc, kv_blocks_needed):
    """Evict from the LRU head until ``kv_blocks_needed`` KV blocks are freed or none is
    idle, a KV block at a time, each node's tail first (vLLM evicts single blocks, and frees
    a request's blocks tail first). A whole entry left with only its head blocks stays at
    the head of the list: a lookup hits those blocks.

    Returns the KV blocks freed.
    """
    own_from = pc.n_entries
    pool_from = pc.n_entries + pc.req.shape[1]
    freed = 0
    while freed < kv_blocks_needed and pc.stats[S_HEAD] >= 0:
        e = pc.stats[S_HEAD]
        blocks = pc.tab[E_CACHED, e]
        take = min(blocks, kv_blocks_needed - freed)
        if e >= pool_from and pc.tab[E_UNIT, e] >= 0:  # a split unit: one block
            if _evict_unit(pc, e):
                pc.stats[S_EVICTIONS] += 1
        elif e < own_from and take < blocks and pc.stats[S_COPIES] > 0 and pc.tab[E_NEXT, e] >= 0:
            _split(pc, e)  # its copies' tail blocks outlive its own: unit by unit from here
            continue
        elif take == blocks:
            if e < own_from:
                if not _drop(pc, e):
                    pc.stats[S_EVICTIONS] += take if pc.keep_copies else 1
            else:
                _forget(pc, e)
                if e >= pool_from:  # a whole copy
                    _unlink_copy(pc, pc.tab[E_ENTRY, e], e)
                    pc.stats[S_COPIES] -= 1
        else:
            pc.tab[E_CACHED, e] -= take
            pc.stats[S_EVICTABLE] -= take
            pc.stats[S_CACHED] -= take
            if e < own_from and pc.keep_copies:
                pc.stats[S_EVICTIONS] += take
        freed += take
    return freed


@njit(cache=True, nogil=True, _nrt=False)
def partial_blocks(pc, block_offsets, i, k):
    """KV blocks cached of request i's entry k, the first one ``match`` did not find whole:
    the head of an entry partly evicted (0 when none). Such an entry is always idle. With
    vLLM's rules ``match`` counts such a head itself, unit by unit: 0."""
    if pc.keep_copies or k >= pc.req[R_N_FULL, i]:
        return 0
    return pc.tab[E_CACHED, pc.entry[block_offsets[i] + k]]


@njit(cache=True, nogil=True, _nrt=False)
def take_partial(pc, block_offsets, i, k):
    """Request i takes the partly evicted entry k (``partial_blocks``) out of the cache: the
    caller makes the blocks it hit private; it enters the cache whole once computed."""
    if not pc.keep_copies and k < pc.req[R_N_FULL, i]:
        _forget(pc, pc.entry[block_offsets[i] + k])


# -- own runs (vLLM) -----------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def own_column(pc, i):
    """Request i's own-run column of ``tab``."""
    return pc.n_entries + i


@njit(cache=True, nogil=True, _nrt=False)
def own_blocks(pc, i):
    """KV blocks of request i's own run still cached (its leading blocks past its prefix)."""
    return pc.tab[E_CACHED, own_column(pc, i)]


@njit(cache=True, nogil=True, _nrt=False)
def keep_tail(pc, block_offsets, i, blocks):
    """Request i lets go of the ``blocks`` full KV blocks it computed past its prompt's
    cacheable units: they stay cached, idle (the caller counts them free), at the LRU tail,
    as its own run. (Within its cacheable prefix every full block is a unit, cached as it
    was scheduled.)"""
    if blocks <= 0 or pc.req[R_HELD, i] < pc.req[R_N_FULL, i]:
        return
    e = own_column(pc, i)
    pc.tab[E_CACHED, e] = blocks
    pc.stats[S_CACHED] += blocks
    _lru_append(pc, e)


@njit(cache=True, nogil=True, _nrt=False)
def take_own(pc, i):
    """Request i is readmitted: its own run leaves the cache (the caller makes the blocks it
    hit private again; the rest were counted free already)."""
    _forget(pc, own_column(pc, i))


@njit(cache=True, nogil=True, _nrt=False)
def cache_blocks(pc):
    """KV blocks held by cached units, own runs and idle copies, and how many of them are
    evictable."""
    return pc.stats[S_CACHED], pc.stats[S_EVICTABLE]


@njit(cache=True, nogil=True, _nrt=False)
def held_copy_blocks(pc, i):
    """KV blocks of the copies request i holds (its quota is charged ``R_COPIES``: a copy that
    took its unit's place stays charged until the request lets go)."""
    blocks = 0
    c = pc.req[R_COPY_HEAD, i]
    while c >= 0:
        blocks += pc.tab[E_CACHED, c]
        c = pc.tab[E_HELD_NEXT, c]
    return blocks
