"""Keyed binary heap of request ids with lazy removal: the engine's deadline queue.

A heap is an i8 array whose slot 0 holds the size and slots 1..size the entries. Order
is (key0[r], key1[r], r) ascending. Entries are removed lazily: callers skip ids whose
status says they left, which keeps cancellation O(1) while every live request has
exactly one entry. (The waiting queue is ``policies.queues``: lanes of indexed heaps,
one per (tenant, class), with every queue order.)
"""

from __future__ import annotations

from numba import njit


@njit(cache=True, nogil=True, _nrt=False)
def _before(key0, key1, a, b):
    if key0[a] != key0[b]:
        return key0[a] < key0[b]
    if key1[a] != key1[b]:
        return key1[a] < key1[b]
    return a < b


@njit(cache=True, nogil=True, _nrt=False)
def heap_push(heap, key0, key1, rid):
    heap[0] += 1
    i = heap[0]
    heap[i] = rid
    while i > 1:
        parent = i // 2
        if not _before(key0, key1, heap[i], heap[parent]):
            break
        heap[i], heap[parent] = heap[parent], heap[i]
        i = parent


@njit(cache=True, nogil=True, _nrt=False)
def heap_pop(heap, key0, key1):
    """Remove and return the first id (the heap must not be empty)."""
    top = heap[1]
    size = heap[0]
    heap[1] = heap[size]
    heap[0] = size - 1
    size -= 1
    i = 1
    while True:
        left = 2 * i
        if left > size:
            break
        child = left
        if left + 1 <= size and _before(key0, key1, heap[left + 1], heap[left]):
            child = left + 1
        if not _before(key0, key1, heap[child], heap[i]):
            break
        heap[i], heap[child] = heap[child], heap[i]
        i = child
    return top


@njit(cache=True, nogil=True, _nrt=False)
def heap_first_live(heap, key0, key1, status, live_lo, live_hi):
    """First id with live_lo <= status <= live_hi, dropping stale entries above it; -1 if none."""
    while heap[0] > 0:
        rid = heap[1]
        if live_lo <= status[rid] <= live_hi:
            return rid
        heap_pop(heap, key0, key1)
    return -1
