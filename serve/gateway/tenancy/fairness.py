"""Fair share between tenants on one gateway process (--auth keys): each tenant has at most its cap of sequences
generating at once (a choice of an OpenAI request, a generate request, a request on a gRPC stream) — its own
`dstool keys limits --concurrency`, else --tenant-concurrency —, and a request over it waits its turn. A place that
frees goes to the waiting tenant furthest below its share (sequences in flight over its cap: the caps are the
weights), its oldest request first; so one tenant's flood neither fills the engine's batch nor queues ahead of
another tenant's request. Waiting is bounded (a 429 beyond), and a client that hangs up while waiting leaves the
queue."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field


class TooManyWaiting(Exception):
    """A tenant already has `waiting` sequences waiting on this gateway."""

    def __init__(self, waiting: int, cap: int):
        super().__init__(waiting)
        self.waiting, self.cap = waiting, cap


@dataclass(eq=False)
class Slot:
    """Places held by one request; `release` gives them back (once)."""

    fair: FairShare
    tenant: str
    places: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.fair._release(self)


@dataclass(eq=False)
class _Waiter:
    slot: Slot
    cap: int
    since: float = field(default_factory=time.monotonic)
    granted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class FairShare:
    def __init__(self, default_cap: int, waiting_per_cap: int = 16, metrics=None):
        self.default_cap, self.waiting_per_cap = default_cap, waiting_per_cap
        self.metrics = metrics
        self.running: dict[str, int] = {}
        self.waiting: dict[str, deque[_Waiter]] = {}

    def cap_of(self, own: int) -> int:
        return own if own > 0 else self.default_cap

    async def acquire(self, tenant: str, places: int, own_cap: int = 0) -> Slot:
        """`places` for one request of `tenant` (its cap `own_cap`, 0: the default), waiting its turn if need be;
        TooManyWaiting when too many of the tenant's requests wait already."""
        cap = self.cap_of(own_cap)
        slot = Slot(self, tenant, places)
        queue = self.waiting.get(tenant)
        if not queue and self._fits(tenant, places, cap):
            self._take(slot)
            return slot
        if queue is not None and sum(w.slot.places for w in queue) + places > cap * self.waiting_per_cap:
            raise TooManyWaiting(cap * self.waiting_per_cap, cap)
        waiter = _Waiter(slot, cap)
        self.waiting.setdefault(tenant, deque()).append(waiter)
        self._gauge(tenant)
        try:
            await waiter.granted
        except asyncio.CancelledError:  # the client gave up: out of the queue, or its places back if just granted
            if waiter.granted.done() and not waiter.granted.cancelled():
                slot.release()
            else:
                self._leave(waiter)
            raise
        return slot

    def _fits(self, tenant: str, places: int, cap: int) -> bool:
        running = self.running.get(tenant, 0)
        return running == 0 or running + places <= cap  # alone, a request larger than the cap still runs

    def _take(self, slot: Slot) -> None:
        self.running[slot.tenant] = self.running.get(slot.tenant, 0) + slot.places

    def _release(self, slot: Slot) -> None:
        left = self.running.get(slot.tenant, 0) - slot.places
        if left > 0:
            self.running[slot.tenant] = left
        else:
            self.running.pop(slot.tenant, None)
        self._grant()

    def _leave(self, waiter: _Waiter) -> None:
        queue = self.waiting.get(waiter.slot.tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self.waiting[waiter.slot.tenant]
            self._gauge(waiter.slot.tenant)
            self._grant()

    def _grant(self) -> None:
        """Hand freed places to waiting requests: the tenant furthest below its share first."""
        while True:
            ready = [(self.running.get(t, 0) / q[0].cap, q[0].since, t)
                     for t, q in self.waiting.items() if self._fits(t, q[0].slot.places, q[0].cap)]
            if not ready:
                return
            _, _, tenant = min(ready)
            waiter = self.waiting[tenant].popleft()
            if not self.waiting[tenant]:
                del self.waiting[tenant]
            self._gauge(tenant)
            self._take(waiter.slot)
            waiter.granted.set_result(None)

    def _gauge(self, tenant: str) -> None:
        if self.metrics is not None:
            self.metrics.waiting(tenant, sum(w.slot.places for w in self.waiting.get(tenant, ())))
