"""Block-level prefix cache keyed by the trace's prefix hashes, as jitted pure functions.

Unit of caching: one *hash block* of the trace (``Trace.block_tokens`` prompt tokens,
512 in Mooncake). A hash names the whole prefix up to and including its block, so a
request reuses the leading run of its hash blocks that are cached. Only *full* hash
blocks are cached (the partial tail of a prompt is private), as vLLM caches only full
KV blocks.

Granularity: the engine allocates KV in blocks of ``block_size`` tokens (e.g. 16). A
cached hash block occupies ``entry_blocks = ceil(block_tokens / block_size)`` KV blocks;
a request holding ``held`` leading entries keeps privately only the KV blocks of tokens
past ``held * block_tokens``: ``private_blocks(ctx, held) = ceil((ctx - held*BT)/bs)``.
When ``block_size`` divides ``block_tokens`` (all powers of two up to 512) a request's
blocks equal ``ceil(ctx / block_size)`` exactly as without caching; otherwise each entry
rounds up by less than one KV block.

Life of an entry:
- ``match`` finds a request's leading run of cached entries (no mutation);
- ``acquire`` takes a reference on each (referenced entries are never evicted);
- ``insert`` runs after a step computed prompt tokens through full hash blocks (by vLLM's
  rules, as the step is formed): each new block becomes an entry referenced by its
  request (its KV blocks move from the request to the cache); a block another request
  inserted meanwhile is deduplicated (SGLang: the radix tree frees the duplicate at once,
  and the request references the existing entry) or, with ``keep_copies``, kept as a
  *copy* (below);
- ``release`` drops a request's references (finish, preemption, cancel, rejection);
  entries left unreferenced join the LRU list, deepest block first, so a chain's tail is
  evicted before its head (as vLLM frees blocks in reverse);
- ``evict`` frees unreferenced entries from the LRU head when free KV runs out, a KV block
  at a time, each entry's tail first; a lookup hits the head of a partly evicted entry
  (``partial_blocks``), and the request that takes it computes the rest.

Copies (vLLM, ``keep_copies``): vLLM never deduplicates. A block computed again under a hash
that is cached stays the computing request's, and the hash maps to every such block in
insertion order; a lookup takes the oldest surviving one (vllm/v1/core/block_pool.py:49-53,
63-100, 666-686). Each physical copy is a node of its own here: a ``tab`` column from a pool
past the own-run columns, held by its request at its chain position (``E_AT``) and linked
behind the entry's column (``E_NEXT``, oldest first). Its blocks count as the request's
(``R_COPIES`` for quotas) while it is held; when the request lets go each copy joins the LRU
list at its place in the reversed chain, like any block vLLM frees; evicting it takes it off
its entry's list. The entry's column is the copy lookups hit: when it is evicted whole and a
copy survives, the oldest copy moves into the column (``_promote``), with its holder or its
LRU place. So an entry goes idle when its hitters let go, while copies of it are still held,
as vLLM's ref counts are per block. Not modelled: a lookup that takes an entry's head from a
partly evicted node and its tail from a copy stops at the head, and a block recomputed over a
partly evicted entry replaces it; and an entry is shared only once computed whole, where
vLLM shares each 16-token block as soon as it is scheduled, so a request admitted while
another computes a shared trace block in chunks that end inside it hits none of that block
here (the parity fixtures ``burst-pc-leapfrog-{b2048,b8192,seed3}`` show it).

Own runs (vLLM, ``keep_tail``): vLLM hashes every full block of a request, its generated
tokens included, and a freed block keeps its hash until the block is reused
(vllm/v1/core/block_pool.py ``free_blocks``, ``_maybe_evict_cached_block``), so a request
preempted for recompute finds its own blocks again when readmitted
(vllm/v1/core/kv_cache_manager.py:616-625). Such blocks are the request's alone; one LRU
node per request (a column past the trace's entries) holds the full blocks it computed past
its cached prefix. It joins the LRU list when the request lets go, before its prefix entries
(vLLM frees a request's blocks tail first), and is evicted a KV block at a time, its tail
first, so a readmitted request finds the leading part that survived. A request that lets go
in the middle of an entry leaves that entry's computed head cached the same way.

A full-prompt hit still computes one token (the logits need a forward pass), as vLLM:
the cached tokens are capped at ``prompt - 1``; that token rewrites its slot in the
last shared block, so it costs no extra KV block.

Entries are dense ids (``np.unique`` over the trace's hashes, once per trace), so the
cache is plain arrays indexed by entry: no hash table in the hot path.

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
S_HEAD = 0  # LRU list head (least recently released entry), -1 if empty
S_TAIL = 1  # LRU list tail, -1 if empty
S_CACHED = 2  # KV blocks held by cached entries and own runs
S_EVICTABLE = 3  # ... of them unreferenced (on the LRU list)
S_HIT_TOKENS = 4  # prompt tokens served from the cache, over all lookups noted
S_QUERY_TOKENS = 5  # prompt tokens looked up
S_INSERTS = 6  # entries created
S_DEDUPS = 7  # blocks computed twice because another request inserted them first
S_EVICTIONS = 8  # entries no longer cached by eviction (own runs and copies not counted)
S_POOL_NEXT = 9  # copy pool: the next column never used yet
S_POOL_FREE = 10  # copy pool: a stack of columns freed, linked through E_NEXT (-1: empty)
S_COPIES = 11  # copies alive (0 spares eviction a look at E_NEXT)
N_STATS = 12


# rows of PrefixCache.req (per request) and PrefixCache.tab (per entry)
R_N_FULL = 0  # full hash blocks of the prompt, the only cacheable ones (0 with caching off)
R_HELD = 1  # leading chain positions the request holds: entries it references, or its copies
R_COPIES = 2  # KV blocks of copies it computed (vLLM), charged to its quotas until it lets go
R_COPY_HEAD = 3  # its deepest copy still held (-1: none); E_HELD_NEXT links the shallower ones
N_REQ_ROWS = 4
E_CACHED = 0  # KV blocks the column holds (entry_blocks, or fewer once partly evicted; 0: not cached)
E_REFS = 1
E_LRU_PREV = 2  # doubly linked LRU list of unreferenced cached columns
E_LRU_NEXT = 3
E_BORN = 4  # S_INSERTS when the entry was last created: the order SGLang's radix node gains its children
E_WAIT = 5  # scratch, zero between calls: waiting requests whose matched chain holds the entry (dfs_weight)
E_NEXT = 6  # an entry's oldest copy, a copy's next younger one (-1: none); a free pool column's next
# rows of copies only (the last ones: ``clear`` leaves them to ``_new_copy``)
E_AT = 7  # a copy's chain position: the index into ``entry`` of (its request, its position)
E_OWNER = 8  # the request that computed a copy
E_HELD_NEXT = 9  # a held copy's next shallower copy held by the same request (-1: none)
N_ENTRY_ROWS = 10


class PrefixCache(NamedTuple):
    """Cache state as a few arrays; build with ``new_prefix_cache``.

    ``entry``: per trace block (aligned with ``Trace.block_hashes``), its dense entry id
    (read-only, shared). ``req[ROW, request]`` (R_*) and ``tab[ROW, column]`` (E_*) are
    field-major matrices: few arrays keep calls cheap in the kernel. ``tab`` has one column
    per entry, then per request one for its own run (``own_column``), then the copy pool
    (vLLM: as many columns as KV blocks, since every live copy holds one at least; only the
    columns used are ever written).
    """

    entry: np.ndarray  # i8[H]
    req: np.ndarray  # i8[N_REQ_ROWS, n]
    tab: np.ndarray  # i8[N_ENTRY_ROWS, n_entries + n + copy pool]
    stats: np.ndarray  # i8[N_STATS]
    block_tokens: int
    entry_blocks: int  # KV blocks per entry
    kv_block_size: int
    n_entries: int

    # Python-side views by name (tests, inspection)
    n_full = property(lambda self: self.req[R_N_FULL])
    held = property(lambda self: self.req[R_HELD])
    copies = property(lambda self: self.req[R_COPIES])
    cached = property(lambda self: self.tab[E_CACHED, :self.n_entries] != 0)  # per entry
    refs = property(lambda self: self.tab[E_REFS, :self.n_entries])


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


@njit(cache=True, nogil=True, _nrt=True)
def empty_cache(entry, n_full, n_entries, block_tokens, kv_block_size, copy_pool):
    """An empty cache over a ``prefix_layout`` for one KV block size (``n_full`` is copied),
    with ``copy_pool`` columns for copies (0 without ``keep_copies``)."""
    pc = PrefixCache(entry, np.empty((N_REQ_ROWS, n_full.shape[0]), dtype=np.int64),
                     np.empty((N_ENTRY_ROWS, n_entries + n_full.shape[0] + copy_pool), dtype=np.int64),
                     np.empty(N_STATS, dtype=np.int64),
                     block_tokens, (block_tokens + kv_block_size - 1) // kv_block_size, kv_block_size, n_entries)
    clear(pc, n_full)
    return pc


@njit(cache=True, nogil=True, _nrt=True)
def clear(pc, n_full):
    """Empty the cache in place: no entry cached or referenced, counters zero, the copy pool
    unused; ``n_full`` sets the cacheable blocks per request (zeros: caching off)."""
    pc.req[R_N_FULL] = n_full
    pc.req[R_HELD] = 0
    pc.req[R_COPIES] = 0
    pc.req[R_COPY_HEAD] = -1
    fixed = pc.n_entries + pc.req.shape[1]  # the pool's columns are written as they are taken,
    pc.tab[:E_AT, :fixed] = 0  # and so are the rows only copies use
    pc.tab[E_LRU_PREV, :fixed] = -1
    pc.tab[E_LRU_NEXT, :fixed] = -1
    pc.tab[E_NEXT, :fixed] = -1
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
    copy_pool: int = 0,
) -> PrefixCache:
    """An empty cache for one trace (CSR prefix blocks) and one KV block size; ``keep_copies``
    needs ``copy_pool`` columns, one per KV block of the GPU at most."""
    if kv_block_size <= 0:
        raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
    entry, n_full, n_entries = prefix_layout(block_offsets, block_hashes, prompt_tokens, block_tokens)
    return empty_cache(entry, n_full, n_entries, int(block_tokens), int(kv_block_size), int(copy_pool))


# -- KV accounting (pure arithmetic) ------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def kv_blocks(tokens, kv_block_size):
    """KV blocks that hold ``tokens`` tokens (tokens >= 0)."""
    return (tokens + kv_block_size - 1) // kv_block_size


@njit(cache=True, nogil=True, inline="always")
def private_blocks(ctx, held, block_tokens, kv_block_size):
    """KV blocks a request owns for ``ctx`` tokens when it references ``held`` entries."""
    own = ctx - held * block_tokens
    if own <= 0:
        return 0
    return kv_blocks(own, kv_block_size)


@njit(cache=True, nogil=True, _nrt=False)
def grow_blocks(ctx_old, ctx_new, held, n_full, block_tokens, kv_block_size, entry_blocks):
    """KV blocks to allocate for computing tokens ``ctx_old..ctx_new`` of a request.

    Counts every full hash block the chunk completes as a new entry (``entry_blocks``);
    ``insert`` later hands back the blocks of any that turn out to be duplicates. With
    ``n_full = 0`` (caching off) this is ``ceil(new/bs) - ceil(old/bs)``.
    """
    held_after = max(held, min(n_full, ctx_new // block_tokens))
    return (
        private_blocks(ctx_new, held_after, block_tokens, kv_block_size)
        + entry_blocks * (held_after - held)
        - private_blocks(ctx_old, held, block_tokens, kv_block_size)
    )


# -- LRU list of unreferenced entries ------------------------------------------------------
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


# -- copies (vLLM) ---------------------------------------------------------------------------
@njit(cache=True, nogil=True, _nrt=False)
def _new_copy(pc, e, at, i):
    """Request i computed entry e's blocks again at chain index ``at`` while e is cached: a
    copy it holds, the youngest of e's."""
    c = pc.stats[S_POOL_FREE]
    if c >= 0:
        pc.stats[S_POOL_FREE] = pc.tab[E_NEXT, c]
    else:
        c = pc.stats[S_POOL_NEXT]
        if c >= pc.tab.shape[1]:  # every live copy holds a KV block: more than the pool is a ledger bug
            raise RuntimeError("prefix cache: more copies than the copy pool holds")
        pc.stats[S_POOL_NEXT] += 1
    pc.stats[S_COPIES] += 1
    pc.tab[E_CACHED, c] = pc.entry_blocks
    pc.tab[E_REFS, c] = 1
    pc.tab[E_LRU_PREV, c] = -1
    pc.tab[E_LRU_NEXT, c] = -1
    pc.tab[E_NEXT, c] = -1
    pc.tab[E_AT, c] = at
    pc.tab[E_OWNER, c] = i
    pc.tab[E_HELD_NEXT, c] = pc.req[R_COPY_HEAD, i]
    pc.req[R_COPY_HEAD, i] = c
    last = e
    while pc.tab[E_NEXT, last] >= 0:
        last = pc.tab[E_NEXT, last]
    pc.tab[E_NEXT, last] = c


@njit(cache=True, nogil=True, inline="always")
def _recycle(pc, c):
    pc.tab[E_NEXT, c] = pc.stats[S_POOL_FREE]
    pc.stats[S_POOL_FREE] = c
    pc.stats[S_COPIES] -= 1


@njit(cache=True, nogil=True, _nrt=False)
def _unhold(pc, c):
    """Take held copy c off its request's list of held copies."""
    i = pc.tab[E_OWNER, c]
    nxt = pc.tab[E_HELD_NEXT, c]
    if pc.req[R_COPY_HEAD, i] == c:
        pc.req[R_COPY_HEAD, i] = nxt
        return
    prev = pc.req[R_COPY_HEAD, i]
    while pc.tab[E_HELD_NEXT, prev] != c:
        prev = pc.tab[E_HELD_NEXT, prev]
    pc.tab[E_HELD_NEXT, prev] = nxt


@njit(cache=True, nogil=True, _nrt=False)
def _promote(pc, e):
    """Entry e's column, just emptied, takes its oldest copy, which lookups hit from now on:
    with its holder, who now references e, or with its place in the LRU list."""
    c = pc.tab[E_NEXT, e]
    blocks = pc.tab[E_CACHED, c]
    pc.tab[E_NEXT, e] = pc.tab[E_NEXT, c]
    pc.tab[E_CACHED, e] = blocks
    pc.tab[E_REFS, e] = pc.tab[E_REFS, c]
    if pc.tab[E_REFS, c] > 0:
        _unhold(pc, c)
        pc.stats[S_CACHED] += blocks
    else:
        nxt = pc.tab[E_LRU_NEXT, c]
        _lru_link(pc, pc.tab[E_LRU_PREV, c], e)
        _lru_link(pc, e, nxt)
    _recycle(pc, c)


@njit(cache=True, nogil=True, _nrt=False)
def _drop_copy(pc, c):
    """Idle copy c was evicted whole: off its entry's list, back to the pool."""
    prev = pc.entry[pc.tab[E_AT, c]]
    while pc.tab[E_NEXT, prev] != c:
        prev = pc.tab[E_NEXT, prev]
    pc.tab[E_NEXT, prev] = pc.tab[E_NEXT, c]
    _recycle(pc, c)


@njit(cache=True, nogil=True, inline="always")  # inlined: eviction's hot path, where copies are rare
def _drop(pc, e):
    """Idle entry e stops being cached (``_forget``); its oldest copy takes its place.
    Returns whether one did."""
    _forget(pc, e)
    if pc.stats[S_COPIES] == 0 or pc.tab[E_NEXT, e] < 0:
        return False
    _promote(pc, e)
    return True


# -- operations ----------------------------------------------------------------------------
@njit(cache=True, nogil=True, _nrt=False)
def match(pc, block_offsets, prompt_tokens, i):
    """Leading entries of request i cached whole: (entries, cached tokens, KV blocks now idle).

    Cached tokens are capped at ``prompt - 1`` so a full hit still computes one token.
    Idle entries are unreferenced: acquiring them takes their blocks off the evictable
    list, which the caller must count when checking free KV before it acquires.
    """
    base = block_offsets[i]
    k = 0
    idle = 0
    while k < pc.req[R_N_FULL, i]:
        e = pc.entry[base + k]
        if pc.tab[E_CACHED, e] < pc.entry_blocks:
            break
        if pc.tab[E_REFS, e] == 0:
            idle += pc.entry_blocks
        k += 1
    tokens = min(k * pc.block_tokens, prompt_tokens[i] - 1)
    return k, tokens, idle


@njit(cache=True, nogil=True, _nrt=False)
def acquire(pc, block_offsets, i, k):
    """Reference request i's first k entries (all cached, as ``match`` found them).

    Returns the KV blocks that stopped being idle: ``match``'s count, unless an entry
    repeats in the chain (only a synthetic trace does that; a hash names its whole prefix).
    """
    base = block_offsets[i]
    taken = 0
    for j in range(k):
        e = pc.entry[base + j]
        if pc.tab[E_REFS, e] == 0:
            taken += pc.tab[E_CACHED, e]
        _ref(pc, e)
    pc.req[R_HELD, i] = k
    return taken


@njit(cache=True, nogil=True, _nrt=False)
def note_lookup(pc, hit_tokens, query_tokens):
    """Count one admission's lookup for the hit rate."""
    pc.stats[S_HIT_TOKENS] += hit_tokens
    pc.stats[S_QUERY_TOKENS] += query_tokens


@njit(cache=True, nogil=True, _nrt=False)
def insert(pc, block_offsets, i, ctx, keep_copies):
    """Cache the full hash blocks request i completed by ``ctx`` computed tokens.

    Returns the KV blocks freed by deduplication (blocks of this request that another
    request had cached first); the caller returns them to the free pool. With
    ``keep_copies`` they stay the request's as copies (``R_COPIES``) and nothing is freed.
    Without, an idle entry counts as free already, so deduplicating onto it frees nothing:
    the request's copy goes back to the pool exactly as the entry it now references leaves it.
    """
    base = block_offsets[i]
    last = min(pc.req[R_N_FULL, i], ctx // pc.block_tokens)
    freed = 0
    for j in range(pc.req[R_HELD, i], last):
        e = pc.entry[base + j]
        while keep_copies and 0 < pc.tab[E_CACHED, e] < pc.entry_blocks and pc.tab[E_NEXT, e] >= 0:
            _drop(pc, e)  # a partly evicted entry gives way to a copy that may be whole
        if pc.tab[E_CACHED, e] == pc.entry_blocks:
            if keep_copies:
                _new_copy(pc, e, base + j, i)
                pc.req[R_COPIES, i] += pc.entry_blocks
            else:
                if pc.tab[E_REFS, e] > 0:
                    freed += pc.entry_blocks
                _ref(pc, e)
            pc.stats[S_DEDUPS] += 1
        else:
            _forget(pc, e)  # what eviction left of it, if anything: this copy replaces it
            pc.tab[E_CACHED, e] = pc.entry_blocks
            pc.tab[E_REFS, e] = 1
            pc.tab[E_BORN, e] = pc.stats[S_INSERTS]
            pc.stats[S_CACHED] += pc.entry_blocks
            pc.stats[S_INSERTS] += 1
    if last > pc.req[R_HELD, i]:
        pc.req[R_HELD, i] = last
    return freed


@njit(cache=True, nogil=True, _nrt=False)
def release(pc, block_offsets, i):
    """Drop request i's references and copies, deepest first (vLLM frees a request's blocks
    in reverse): idle entries and copies become evictable.

    Returns the KV blocks of entries and copies that became idle (so available again).
    """
    base = block_offsets[i]
    idle = 0
    c = pc.req[R_COPY_HEAD, i]
    for j in range(pc.req[R_HELD, i] - 1, -1, -1):
        if c >= 0 and pc.tab[E_AT, c] == base + j:
            nxt = pc.tab[E_HELD_NEXT, c]
            pc.tab[E_REFS, c] = 0
            pc.stats[S_CACHED] += pc.tab[E_CACHED, c]
            _lru_append(pc, c)
            idle += pc.tab[E_CACHED, c]
            c = nxt
            continue
        e = pc.entry[base + j]
        pc.tab[E_REFS, e] -= 1
        if pc.tab[E_REFS, e] == 0:
            _lru_append(pc, e)
            idle += pc.entry_blocks
    pc.req[R_HELD, i] = 0
    pc.req[R_COPIES, i] = 0
    pc.req[R_COPY_HEAD, i] = -1
    return idle


@njit(cache=True, nogil=True, _nrt=False)
def evict(pc, kv_blocks_needed):
    """Evict from the LRU head until ``kv_blocks_needed`` KV blocks are freed or none is
    idle, a KV block at a time, each entry's tail first (vLLM evicts single blocks, and frees
    a request's blocks tail first). An entry left with only its head blocks stays at the
    head of the list: a lookup hits those blocks (``partial_blocks``).

    Returns the KV blocks freed.
    """
    copies_from = pc.n_entries + pc.req.shape[1]
    freed = 0
    while freed < kv_blocks_needed and pc.stats[S_HEAD] >= 0:
        e = pc.stats[S_HEAD]
        blocks = pc.tab[E_CACHED, e]
        take = min(blocks, kv_blocks_needed - freed)
        if take == blocks:
            if e < pc.n_entries:
                if not _drop(pc, e):
                    pc.stats[S_EVICTIONS] += 1
            else:
                _forget(pc, e)
                if e >= copies_from:
                    _drop_copy(pc, e)
        else:
            pc.tab[E_CACHED, e] -= take
            pc.stats[S_EVICTABLE] -= take
            pc.stats[S_CACHED] -= take
        freed += take
    return freed


@njit(cache=True, nogil=True, _nrt=False)
def partial_blocks(pc, block_offsets, i, k):
    """KV blocks cached of request i's entry k, the first one ``match`` did not find whole:
    the head of an entry partly evicted (0 when none). Such an entry is always idle."""
    if k >= pc.req[R_N_FULL, i]:
        return 0
    return pc.tab[E_CACHED, pc.entry[block_offsets[i] + k]]


@njit(cache=True, nogil=True, _nrt=False)
def take_partial(pc, block_offsets, i, k):
    """Request i takes the partly evicted entry k (``partial_blocks``) out of the cache: the
    caller makes the blocks it hit private; it enters the cache whole once computed."""
    if k < pc.req[R_N_FULL, i]:
        _drop(pc, pc.entry[block_offsets[i] + k])


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
    """Request i lets go of the ``blocks`` full KV blocks it computed past the entries it
    holds: they stay cached, idle (the caller counts them free), at the LRU tail. Mid-prompt
    they are the head of its next entry, which a lookup hits (``partial_blocks``) unless
    another copy of it is cached; past its prompt's entries they are its own run."""
    k = pc.req[R_HELD, i]
    if k < pc.req[R_N_FULL, i]:
        e = pc.entry[block_offsets[i] + k]
        if pc.tab[E_CACHED, e] > 0:
            return
        blocks = min(blocks, pc.entry_blocks - 1)
    else:
        e = own_column(pc, i)
    if blocks <= 0:
        return
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
    """KV blocks held by cached entries, own runs and idle copies, and how many of them are
    evictable."""
    return pc.stats[S_CACHED], pc.stats[S_EVICTABLE]


@njit(cache=True, nogil=True, _nrt=False)
def held_copy_blocks(pc, i):
    """KV blocks of the copies request i holds (its quota is charged ``R_COPIES``: a copy that
    took its entry's place stays charged until the request lets go)."""
    blocks = 0
    c = pc.req[R_COPY_HEAD, i]
    while c >= 0:
        blocks += pc.tab[E_CACHED, c]
        c = pc.tab[E_HELD_NEXT, c]
    return blocks
