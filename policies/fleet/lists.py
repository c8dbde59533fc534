"""The typed lists ``fleet_kernel`` takes (each replica's ``engine.Statics`` and step-time
tables), built by cached kernels.

``numba.typed.List`` built from Python (``typed.List(items)``, ``append``, indexing)
compiles its methods with Numba's own uncached ``@njit``: about 1 s per item type on each
process's first call, every process, whatever ``servetune warmup`` cached. Built here,
a process loads them from the disk cache like every other kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

from numba import njit, typed


def typed_list(items: Sequence) -> typed.List:
    """A typed list of ``items`` (at least one, all of one Numba type); one signature per
    item type, whatever the count."""
    out = _list_of(items[0])
    for item in items[1:]:
        _append(out, item)
    return out


@njit(cache=True, nogil=True)
def _list_of(item):
    out = typed.List()
    out.append(item)
    return out


@njit(cache=True, nogil=True)
def _append(items, item):
    items.append(item)
