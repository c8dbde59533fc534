"""The replica's named slots: each block of slots another module sizes ends where the next name starts."""

from policies import adapters, prefix_cache
from policies import kernel_state as ks


def test_sized_blocks_of_slots_neither_overlap_nor_leave_gaps():
    assert ks.PC_REQ + prefix_cache.N_REQ_ROWS == ks.SAMPLED_AT
    assert ks.SAMPLED_AT + 1 == ks.N_RI
    assert ks.PC_STATS + prefix_cache.N_STATS == ks.HAND_OFF
    assert ks.AD_STATE + adapters.N_STATE == ks.AD_BASE

