"""The gateway on a real Redis Cluster (3 masters, 3 replicas, started here): keys spread over the masters' slots,
hits come from the cluster, a master killed under load fails no request (Triton answers while its slots move to
the promoted replica), and the cache works on every slot again afterwards; a redis:// URL of one node is found to
be a cluster; a burst of lookups beyond redis-py's default pool is answered."""

from __future__ import annotations

import asyncio

import numpy as np
from test_gateway import api_gateway, ids_for, infer, load

from gatewaylib import RedisClusterServers, wait_for


def test_keys_spread_over_the_cluster_and_a_master_failover_under_load_fails_no_request(server, session_tmp):
    cluster = RedisClusterServers(session_tmp / "redis-cluster")
    log = session_tmp / "gateway-cluster.log"
    # no in-process front cache: every hit is read from the cluster
    gw = api_gateway(server, log, cache=cluster.url, redis_timeout=0.2, memory_cache_bytes=1)
    try:
        assert "cache: Redis Cluster" in log.read_text()
        assert asyncio.run(_burst(cluster.url)) == (True, [0] * 2000)
        sequences = [ids_for(500 + i, 4 + i % 5) for i in range(90)]
        reference = {i: infer("grpc", server.grpc_url, s)[0] for i, s in enumerate(sequences)}
        for i, s in enumerate(sequences):
            assert np.array_equal(infer("grpc" if i % 2 else "http-binary", gw.grpc_url if i % 2 else gw.http_url,
                                        s)[0], reference[i])
        wait_for(lambda: sum(cluster.keys_per_master().values()) >= 90, "the 90 results to be stored", 10)
        spread = cluster.keys_per_master()
        assert len(spread) == 3 and all(n >= 10 for n in spread.values()), spread
        hits = gw.metric("dstool_gateway_cache_hits_total")

        victim = max(spread, key=spread.get)
        killed: list[int] = []
        results = asyncio.run(load(gw, sequences, 360, lambda done: done == 60 and not killed and (
            cluster.kill(victim), killed.append(victim)), concurrency=8))
        assert killed and len(results) == 360
        assert all(np.array_equal(logits, reference[i]) for i, logits in results)  # none lost, none wrong
        assert gw.metric("dstool_gateway_cache_hits_total") >= hits + 60  # hits before the kill came from Redis

        wait_for(lambda: cluster.healthy() and len(cluster.masters()) == 3, "a replica to take over", 30)
        fresh = [ids_for(2000 + k, 6) for k in range(30)]  # after the failover: stored on every slot, and hit
        for s in fresh:
            infer("grpc", gw.grpc_url, s)

        def all_hit() -> bool:
            before = gw.metric("dstool_gateway_cache_hits_total")
            for s in fresh:
                infer("grpc", gw.grpc_url, s)
            return gw.metric("dstool_gateway_cache_hits_total") == before + len(fresh)

        wait_for(all_hit, "every fresh result to be a hit from the cluster", 20)

        node = next(p for p in cluster.alive())
        log2 = session_tmp / "gateway-cluster-node.log"
        gw2 = api_gateway(server, log2, cache=f"redis://127.0.0.1:{node}/0", memory_cache_bytes=1)
        try:  # a plain redis:// URL of one node: found to be a cluster, and the entries are the same
            assert "cache: Redis Cluster" in log2.read_text()
            for s in fresh:
                infer("grpc", gw2.grpc_url, s)
            assert gw2.metric("dstool_gateway_cache_hits_total") == len(fresh)
        finally:
            gw2.stop()
    finally:
        gw.stop()
        cluster.stop()


async def _burst(url: str) -> tuple[bool, list]:
    """2,000 lookups at once, hundreds a master: more than redis-py's default 100 connections a node (the 101st
    failed, "Too many connections", and the gateway called that an outage); each answered, the cluster in use."""
    from dstool.serve.cache_url import CacheURL
    from dstool.serve.gateway.cache.store import RedisStore

    store = RedisStore(CacheURL.parse(url), timeout=2.0)
    try:
        assert await store.call("exists", "burst") == 0  # the slot map read, as a gateway's start reads it
        replies = await asyncio.gather(*(store.call("exists", f"burst{i}") for i in range(2000)))
        return store.available, list(replies)
    finally:
        await store.close()


def test_cluster_urls_are_checked():
    import pytest

    from dstool.serve.cache_url import CacheURL

    url = CacheURL.parse("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001")
    assert (url.kind, url.username, url.password, url.nodes) == ("cluster", None, "pw", (("10.0.0.1", 7000),
                                                                                       ("10.0.0.2", 7001)))
    assert url.redacted() == "redis+cluster://***@10.0.0.1:7000,10.0.0.2:7001" and "pw" not in url.redacted()
    tls = CacheURL.parse("rediss+cluster://h:7000/0")
    assert tls.kind == "cluster" and tls.tls and str(tls) == "rediss+cluster://h:7000/0"
    assert str(CacheURL.parse("redis://:pw@h:7001/0").as_cluster()) == "redis+cluster://:pw@h:7001"
    for bad, needle in (("redis+cluster://h:7000,h", "'h' is not HOST:PORT"),
                        ("redis+cluster://h:7000/2", "database 0"), ("redis+cluster://h:99999", "not HOST:PORT"),
                        ("cluster://h:1", "unknown scheme")):
        with pytest.raises(ValueError, match=needle):
            CacheURL.parse(bad)
