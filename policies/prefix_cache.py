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
  inserted meanwhile is deduplicated: the request references the existing entry and its
  own copy is freed (SGLang: the radix tree frees the duplicate at once) or, with
  ``keep_copies`` (vLLM keeps both blocks under one hash, vllm/v1/core/block_pool.py
  ``BlockHashToBlockMap``), kept as the request's own (``R_COPIES``) until it lets go;
- ``release`` drops a request's references (finish, preemption, cancel, rejection);
  entries left unreferenced join the LRU list, deepest block first, so a chain's tail is
  evicted before its head (as vLLM frees blocks in reverse);
- ``evict`` frees unreferenced entries from the LRU head when free KV runs out, a KV block
  at a time, each entry's tail first; a lookup hits the head of a partly evicted entry
  (``partial_blocks``), and the request that takes it computes the rest.

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
S_EVICTIONS = 8  # entries evicted (own runs not counted)
N_STATS = 9


# rows of PrefixCache.req (per request) and PrefixCache.tab (per entry)
R_N_FULL = 0  # full hash blocks of the prompt, the only cacheable ones (0 with caching off)
R_HELD = 1  # leading entries the request references
R_COPIES = 2  # KV blocks of entries it computed while another request held them, kept as its own (vLLM)
N_REQ_ROWS = 3
E_CACHED = 0  # KV blocks the entry holds (entry_blocks, or an own run's count; 0: not cached)
E_REFS = 1
E_LRU_PREV = 2  # doubly linked LRU list of unreferenced cached entries
E_LRU_NEXT = 3
E_BORN = 4  # S_INSERTS when the entry was last created: the order SGLang's radix node gains its children
E_WAIT = 5  # scratch, zero between calls: waiting requests whose matched chain holds the entry (dfs_weight)
N_ENTRY_ROWS = 6


class PrefixCache(NamedTuple):
    """Cache state as a few arrays; build with ``new_prefix_cache``.

    ``entry``: per trace block (aligned with ``Trace.block_hashes``), its dense entry id
    (read-only, shared). ``req[ROW, request]`` (R_*) and ``tab[ROW, entry]`` (E_*) are
    field-major matrices: few arrays keep calls cheap in the kernel. ``tab`` has one column
    per entry, then per request one for its own run (``own_column``) and one for the copies
    it let go (``copies_column``).
    """

    entry: np.ndarray  # i8[H]
    req: np.ndarray  # i8[N_REQ_ROWS, n]
    tab: np.ndarray  # i8[N_ENTRY_ROWS, U]
    stats: np.ndarray  # i8[N_STATS]
    block_tokens: int
    entry_blocks: int  # KV blocks per entry
    kv_block_size: int

    # Python-side views by name (tests, inspection)
    n_full = property(lambda self: self.req[R_N_FULL])
    held = property(lambda self: self.req[R_HELD])
    copies = property(lambda self: self.req[R_COPIES])
    cached = property(lambda self: self.tab[E_CACHED] != 0)
    refs = property(lambda self: self.tab[E_REFS])


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


@njit(cache=True, nogil=True)
def empty_cache(entry, n_full, n_entries, block_tokens, kv_block_size):
    """An empty cache over a ``prefix_layout`` for one KV block size (``n_full`` is copied)."""
    pc = PrefixCache(entry, np.empty((N_REQ_ROWS, n_full.shape[0]), dtype=np.int64),
                     np.empty((N_ENTRY_ROWS, n_entries + 2 * n_full.shape[0]), dtype=np.int64),
                     np.empty(N_STATS, dtype=np.int64),
                     block_tokens, (block_tokens + kv_block_size - 1) // kv_block_size, kv_block_size)
    clear(pc, n_full)
    return pc


@njit(cache=True, nogil=True)
def clear(pc, n_full):
    """Empty the cache in place: no entry cached or referenced, counters zero;
    ``n_full`` sets the cacheable blocks per request (zeros: caching off)."""
    pc.req[R_N_FULL] = n_full
    pc.req[R_HELD] = 0
    pc.req[R_COPIES] = 0
    pc.tab[:] = 0
    pc.tab[E_LRU_PREV] = -1
    pc.tab[E_LRU_NEXT] = -1
    pc.stats[:] = 0
    pc.stats[S_HEAD] = -1
    pc.stats[S_TAIL] = -1


def new_prefix_cache(
    block_offsets: np.ndarray,
    block_hashes: np.ndarray,
    prompt_tokens: np.ndarray,
    block_tokens: int,
    kv_block_size: int,
) -> PrefixCache:
    """An empty cache for one trace (CSR prefix blocks) and one KV block size."""
    if kv_block_size <= 0:
        raise ValueError(f"kv_block_size must be positive, got {kv_block_size}")
    entry, n_full, n_entries = prefix_layout(block_offsets, block_hashes, prompt_tokens, block_tokens)
    return empty_cache(entry, n_full, n_entries, int(block_tokens), int(kv_block_size))


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


@njit(cache=True, nogil=True)
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
def _lru_unlink(pc, e):
    """Take e off the LRU list; its blocks stop being evictable."""
    prev = pc.tab[E_LRU_PREV, e]
    nxt = pc.tab[E_LRU_NEXT, e]
    if prev >= 0:
        pc.tab[E_LRU_NEXT, prev] = nxt
    else:
        pc.stats[S_HEAD] = nxt
    if nxt >= 0:
        pc.tab[E_LRU_PREV, nxt] = prev
    else:
        pc.stats[S_TAIL] = prev
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


# -- operations ----------------------------------------------------------------------------
@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def note_lookup(pc, hit_tokens, query_tokens):
    """Count one admission's lookup for the hit rate."""
    pc.stats[S_HIT_TOKENS] += hit_tokens
    pc.stats[S_QUERY_TOKENS] += query_tokens


@njit(cache=True, nogil=True)
def insert(pc, block_offsets, i, ctx, keep_copies):
    """Cache the full hash blocks request i completed by ``ctx`` computed tokens.

    Returns the KV blocks freed by deduplication (blocks of this request that another
    request had cached first); the caller returns them to the free pool. With
    ``keep_copies`` they stay the request's (``R_COPIES``) and nothing is freed. An idle
    entry counts as free already, so deduplicating onto it frees nothing: the request's
    copy goes back to the pool exactly as the entry it now references leaves it.
    """
    base = block_offsets[i]
    last = min(pc.req[R_N_FULL, i], ctx // pc.block_tokens)
    freed = 0
    for j in range(pc.req[R_HELD, i], last):
        e = pc.entry[base + j]
        if pc.tab[E_CACHED, e] == pc.entry_blocks:
            if pc.tab[E_REFS, e] > 0 and keep_copies:
                pc.req[R_COPIES, i] += pc.entry_blocks
            elif pc.tab[E_REFS, e] > 0:
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


@njit(cache=True, nogil=True)
def release(pc, block_offsets, i):
    """Drop request i's references, deepest first; idle entries become evictable. Its kept
    copies (``R_COPIES``) are the caller's to free.

    Returns the KV blocks of entries that became idle (evictable, so available again).
    """
    base = block_offsets[i]
    idle = 0
    for j in range(pc.req[R_HELD, i] - 1, -1, -1):
        e = pc.entry[base + j]
        pc.tab[E_REFS, e] -= 1
        if pc.tab[E_REFS, e] == 0:
            _lru_append(pc, e)
            idle += pc.entry_blocks
    pc.req[R_HELD, i] = 0
    pc.req[R_COPIES, i] = 0
    return idle


@njit(cache=True, nogil=True)
def evict(pc, kv_blocks_needed):
    """Evict from the LRU head until ``kv_blocks_needed`` KV blocks are freed or none is
    idle, a KV block at a time, each entry's tail first (vLLM evicts single blocks, and frees
    a request's blocks tail first). An entry left with only its head blocks stays at the
    head of the list: a lookup hits those blocks (``partial_blocks``).

    Returns the KV blocks freed.
    """
    own_from = pc.tab.shape[1] - 2 * pc.req.shape[1]
    freed = 0
    while freed < kv_blocks_needed and pc.stats[S_HEAD] >= 0:
        e = pc.stats[S_HEAD]
        blocks = pc.tab[E_CACHED, e]
        take = min(blocks, kv_blocks_needed - freed)
        if take == blocks:
            _forget(pc, e)
            if e < own_from:
                pc.stats[S_EVICTIONS] += 1
        else:
            pc.tab[E_CACHED, e] -= take
            pc.stats[S_EVICTABLE] -= take
            pc.stats[S_CACHED] -= take
        freed += take
    return freed


@njit(cache=True, nogil=True)
def partial_blocks(pc, block_offsets, i, k):
    """KV blocks cached of request i's entry k, the first one ``match`` did not find whole:
    the head of an entry partly evicted (0 when none). Such an entry is always idle."""
    if k >= pc.req[R_N_FULL, i]:
        return 0
    return pc.tab[E_CACHED, pc.entry[block_offsets[i] + k]]


@njit(cache=True, nogil=True)
def take_partial(pc, block_offsets, i, k):
    """Request i takes the partly evicted entry k (``partial_blocks``) out of the cache: the
    caller makes the blocks it hit private; it enters the cache whole once computed."""
    if k < pc.req[R_N_FULL, i]:
        _forget(pc, pc.entry[block_offsets[i] + k])


# -- own runs (vLLM) -----------------------------------------------------------------------
@njit(cache=True, nogil=True, inline="always")
def own_column(pc, i):
    """Request i's own-run column of ``tab``."""
    return pc.tab.shape[1] - 2 * pc.req.shape[1] + i


@njit(cache=True, nogil=True, inline="always")
def copies_column(pc, i):
    """The column of the copies request i let go (``keep_copies``)."""
    return pc.tab.shape[1] - pc.req.shape[1] + i


@njit(cache=True, nogil=True)
def own_blocks(pc, i):
    """KV blocks of request i's own run still cached (its leading blocks past its prefix)."""
    return pc.tab[E_CACHED, own_column(pc, i)]


@njit(cache=True, nogil=True)
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


@njit(cache=True, nogil=True)
def let_copies_go(pc, i):
    """Request i lets go of its copies (``R_COPIES``): vLLM frees them into its free queue
    still hashed, so they are evicted in turn like any idle block; they stay idle here, at
    the LRU tail, holding nothing a lookup hits. Returns the blocks let go."""
    copies = pc.req[R_COPIES, i]
    if copies > 0:
        e = copies_column(pc, i)
        blocks = copies + _forget(pc, e)  # with copies let go before and not evicted yet: one run
        pc.tab[E_CACHED, e] = blocks
        pc.stats[S_CACHED] += blocks
        _lru_append(pc, e)
        pc.req[R_COPIES, i] = 0
    return copies


@njit(cache=True, nogil=True)
def take_own(pc, i):
    """Request i is readmitted: its own run leaves the cache (the caller makes the blocks it
    hit private again; the rest were counted free already)."""
    _forget(pc, own_column(pc, i))


@njit(cache=True, nogil=True)
def cache_blocks(pc):
    """KV blocks held by cached entries and own runs, and how many of them are evictable."""
    return pc.stats[S_CACHED], pc.stats[S_EVICTABLE]
