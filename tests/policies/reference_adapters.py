"""Plain-Python twin of ``policies.adapters``: the LoRA adapter pool stated the obvious way
(sets and dicts of last-use times), to check the kernel's arrays against."""

from __future__ import annotations

RESIDENT, FROM_HOST, FROM_DISK = 0, 1, 2


class RefAdapterPool:
    """GPU slots and a host cache over adapters 0..n-1; ``policy`` "lru" or "fifo"."""

    def __init__(self, adapters: int, slots: int, host_slots: int, policy: str, preload: bool = False):
        self.slots, self.host_slots, self.policy = slots, host_slots, policy
        self.running = [0] * adapters
        self.gpu: dict[int, int] = {}  # adapter -> last use (lru) or load time (fifo)
        self.host: dict[int, int] = dict.fromkeys(range(adapters), 0) if preload else {}  # adapter -> last use
        self.clock = 0

    def distinct_running(self) -> int:
        return sum(1 for count in self.running if count > 0)

    def can_join(self, a: int) -> bool:
        return a < 0 or self.running[a] > 0 or self.distinct_running() < self.slots

    def _oldest(self, stamps: dict[int, int], allowed) -> int:
        return min((stamp, a) for a, stamp in stamps.items() if allowed(a))[1]

    def acquire(self, a: int) -> int:
        assert self.can_join(a)
        self.clock += 1
        self.running[a] += 1
        kind = RESIDENT
        if a not in self.gpu:
            if len(self.gpu) >= self.slots:
                del self.gpu[self._oldest(self.gpu, lambda b: self.running[b] == 0)]
            kind = FROM_HOST
            if a not in self.host:
                kind = FROM_DISK
                if len(self.host) >= self.host_slots:
                    del self.host[self._oldest(self.host, lambda b: self.running[b] == 0 and b not in self.gpu)]
            self.gpu[a] = self.clock
        elif self.policy == "lru":
            self.gpu[a] = self.clock
        self.host[a] = self.clock
        return kind

    def release(self, a: int) -> None:
        self.clock += 1
        self.running[a] -= 1
        assert self.running[a] >= 0
        if self.policy == "lru":
            self.gpu[a] = self.clock
        self.host[a] = self.clock
