"""The gateway's fair share between tenants (serve/gateway/tenancy/fairness.py), on its own: caps per tenant, turns,
a client that gives up while waiting, the bound on waiting."""

from __future__ import annotations

import asyncio

import pytest

from dstool.serve.gateway.tenancy.fairness import FairShare, TooManyWaiting


def test_a_tenant_over_its_cap_waits_and_the_others_do_not():
    async def main():
        fair = FairShare(default_cap=2)
        a = [await fair.acquire("a", 1) for _ in range(2)]
        third = asyncio.ensure_future(fair.acquire("a", 1))  # over a's cap: waits
        b = await asyncio.wait_for(fair.acquire("b", 1), 1)  # b is not held up by a's queue
        await asyncio.sleep(0.01)
        assert not third.done()
        a[0].release()
        slot = await asyncio.wait_for(third, 1)
        assert fair.running == {"a": 2, "b": 1}
        for s in (a[1], slot, b):
            s.release()
            s.release()  # once only
        assert fair.running == {} and fair.waiting == {}

    asyncio.run(main())


def test_turns_go_in_order_and_a_request_larger_than_the_cap_runs_alone():
    async def main():
        fair = FairShare(default_cap=2)
        first = await fair.acquire("a", 2)
        big = asyncio.ensure_future(fair.acquire("a", 5))  # n=5 over a cap of 2: runs when a has nothing else
        small = asyncio.ensure_future(fair.acquire("a", 1))  # behind it: a tenant's requests keep their order
        await asyncio.sleep(0.01)
        assert not big.done() and not small.done()
        first.release()
        granted = await asyncio.wait_for(big, 1)
        await asyncio.sleep(0.01)
        assert not small.done() and fair.running == {"a": 5}
        granted.release()
        (await asyncio.wait_for(small, 1)).release()

    asyncio.run(main())


def test_a_client_that_gives_up_leaves_the_queue_and_waiting_is_bounded():
    async def main():
        fair = FairShare(default_cap=1, waiting_per_cap=2)
        held = await fair.acquire("a", 1)
        gone = asyncio.ensure_future(fair.acquire("a", 1))
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.sleep(0.01)
        assert fair.waiting == {}
        queued = [asyncio.ensure_future(fair.acquire("a", 1)) for _ in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(TooManyWaiting):
            await fair.acquire("a", 1)
        held.release()
        for q in queued:
            (await asyncio.wait_for(q, 1)).release()
        assert fair.running == {}

    asyncio.run(main())


def test_a_tenants_own_cap_is_its_weight():
    async def main():
        fair = FairShare(default_cap=1)
        big = [await asyncio.wait_for(fair.acquire("big", 1, own_cap=4), 1) for _ in range(4)]
        small = await fair.acquire("small", 1)
        blocked = asyncio.ensure_future(fair.acquire("small", 1))
        await asyncio.sleep(0.01)
        assert not blocked.done() and fair.running == {"big": 4, "small": 1}
        for s in (*big, small):
            s.release()
        (await asyncio.wait_for(blocked, 1)).release()

    asyncio.run(main())
