"""Consistent hashing of a request's cache identity onto a ring of replicas, as jitted functions.

Each eligible replica j puts ``virtual_nodes`` points on a 64-bit ring, at ``mix(j, v)`` for
v = 0 .. V-1. A key belongs to the owner of the first point at or after it going clockwise
(past the top it wraps to the lowest point): its *primary*. Its *secondary* is the next
distinct replica met going on clockwise, which is exactly the replica that inherits the key
if the primary leaves. So removing a replica moves only its own keys, each to its old
secondary, and adding one takes keys only for itself: with V points per replica each
replica owns about 1/N of the ring, so about 1/N of the keys move, never all.
Two equal points (a 64-bit collision) sort the lower replica index first.

The hashes are fixed so a plain-Python reference can reproduce every decision bit for bit
(all arithmetic modulo 2**64; an int64 block hash is taken as its two's-complement bits):

- ``splitmix64(x)``: z = x + 0x9E3779B97F4A7C15; z = (z ^ z >> 30) * 0xBF58476D1CE4E5B9;
  z = (z ^ z >> 27) * 0x94D049BB133111EB; return z ^ z >> 31 (Steele, Lea and Flood's
  SplitMix64 output function; splitmix64(0) = 0xE220A8397B1DCDAF);
- ``mix(a, b) = splitmix64(a ^ splitmix64(b))``;
- ring point of replica j, virtual node v: ``mix(j, v)``;
- request key (``request_key``): h = 0; h = mix(h, b) for each of the request's first
  ``prefix_blocks`` prompt block hashes b in order, or h = mix(0, r) for a request r with no
  block hashes; then h = mix(h, tenant) when the tenant is part of the key.

The ring lives in preallocated buffers of N x V points (``ring_buffers``) and is rebuilt
(``build_ring``) only when the eligible set changes: a failure, a recovery.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)


@njit(cache=True, nogil=True)
def splitmix64(x):
    """SplitMix64's output function of a uint64: a bijective, well-mixed 64-bit hash."""
    z = np.uint64(x) + _GAMMA
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@njit(cache=True, nogil=True)
def mix(a, b):
    """Hash of the ordered pair (a, b) of uint64s."""
    return splitmix64(np.uint64(a) ^ splitmix64(b))


@njit(cache=True, nogil=True)
def request_key(block_hashes, start, end, request, tenant, prefix_blocks, by_tenant):
    """The ring key of a request whose prompt block hashes are ``block_hashes[start:end]``."""
    h = np.uint64(0)
    k = min(end - start, prefix_blocks)
    if k <= 0:
        h = mix(h, np.uint64(request))
    for b in range(start, start + k):
        h = mix(h, np.uint64(block_hashes[b]))
    if by_tenant:
        h = mix(h, np.uint64(tenant))
    return h


def ring_buffers(n_replicas: int, virtual_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Empty point and owner buffers large enough for every replica's points."""
    if n_replicas < 1 or virtual_nodes < 1:
        raise ValueError(f"a ring needs n_replicas >= 1 and virtual_nodes >= 1, got {n_replicas}, {virtual_nodes}")
    size = n_replicas * virtual_nodes
    return np.zeros(size, dtype=np.uint64), np.full(size, -1, dtype=np.int64)


@njit(cache=True, nogil=True)
def build_ring(eligible, virtual_nodes, points, owners):
    """Write the sorted ring of the eligible replicas into ``points``/``owners``; return its size.

    ``eligible`` is a bool per replica; the buffers hold at least len(eligible) x
    virtual_nodes entries (``ring_buffers``). Entries past the returned size are unused.
    """
    m = 0
    for j in range(len(eligible)):
        if eligible[j]:
            for v in range(virtual_nodes):
                points[m] = mix(np.uint64(j), np.uint64(v))
                owners[m] = j
                m += 1
    order = np.argsort(points[:m], kind="mergesort")  # stable: equal points keep the lower replica first
    sorted_points = points[:m][order]
    sorted_owners = owners[:m][order]
    points[:m] = sorted_points
    owners[:m] = sorted_owners
    return m


@njit(cache=True, nogil=True)
def ring_lookup(points, owners, size, key):
    """(primary, secondary) owners of ``key`` on a ring of ``size`` points.

    The secondary is -1 when the ring holds a single replica; both are -1 on an empty ring.
    """
    if size == 0:
        return -1, -1
    i = np.searchsorted(points[:size], np.uint64(key))  # first point >= key
    if i == size:
        i = 0
    primary = owners[i]
    for step in range(1, size):
        owner = owners[(i + step) % size]
        if owner != primary:
            return primary, owner
    return primary, -1
