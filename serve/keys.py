"""`dstool keys`: tenants' API keys in the Redis the gateways share (the records of gateway/tenancy/auth.py). A key is
printed once, when it is made or rotated; Redis keeps its SHA-256 only."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from dstool.errors import UsageError
from dstool.serve.cache_url import CacheURL
from dstool.serve.gateway.tenancy import auth


def connect(url: CacheURL):
    """A synchronous redis-py client of a redis://, rediss://, unix:// or cluster URL; UsageError if it does not
    answer."""
    import redis
    from redis.cluster import ClusterNode, RedisCluster

    if url.kind == "cluster":
        client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes], username=url.username,
                              password=url.password, ssl=url.tls, ssl_ca_certs=url.ca_certs, socket_timeout=5)
    else:
        client = redis.from_url(url.text, socket_timeout=5, socket_connect_timeout=5)
    try:
        client.ping()
    except Exception as e:
        raise UsageError(f"Redis at {url.redacted()} does not answer ({type(e).__name__}: {e}): give the gateways' "
                         "Redis with --redis URL") from None
    return client


@dataclass
class KeyInfo:
    id: str
    tenant: str
    models: str
    rpm: int
    tpm: int
    budget_tokens: int
    per: str
    expires: str
    state: str
    cache_scope: str
    admin: bool
    created: str


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000)) if ms else "never"


def create(client, tenant: str, models: list[str], rpm: int, tpm: int, budget: int, per: str, expires_s: float,
           scope: str, admin: bool) -> tuple[str, str]:
    """A new key of `tenant`: (its id, the key, shown once)."""
    ident, key = auth.new_key()
    now = int(time.time() * 1000)
    record = {"tenant": tenant, "hash": auth.key_hash(key), "rpm": rpm, "tpm": tpm, "budget": budget, "per": per,
              "models": ",".join(models), "scope": scope, "admin": int(admin), "revoked": 0, "created": now,
              "expires_at": now + int(expires_s * 1000) if expires_s else 0}
    pipe = client.pipeline(transaction=False)
    pipe.hset(auth.key_name(ident), mapping=record)
    pipe.sadd(auth.KEYS_SET, ident)
    pipe.sadd(auth.TENANTS_SET, tenant)
    pipe.execute()
    return ident, key


def _fields(client, ident: str) -> dict[str, str]:
    return {_text(k): _text(v) for k, v in client.hgetall(auth.key_name(ident)).items()}


def _record(client, ident: str) -> dict[str, str]:
    record = _fields(client, ident)
    if not record:
        raise UsageError(f"no key with id '{ident}' (`dstool keys list` shows them)")
    return record


def revoke(client, ident: str) -> str:
    """Revoke a key at once (every gateway checks each request in Redis); its tenant."""
    record = _record(client, ident)
    client.hset(auth.key_name(ident), mapping={"revoked": 1})
    return record["tenant"]


def rotate(client, ident: str, grace_s: float) -> str:
    """A new secret for a key (the same id, tenant, limits and usage); the old one works `grace_s` more seconds."""
    record = _record(client, ident)
    if record.get("revoked") == "1":
        raise UsageError(f"key '{ident}' is revoked: create a new one")
    key = auth.new_key(ident)[1]
    client.hset(auth.key_name(ident), mapping={"hash": auth.key_hash(key), "old_hash": record["hash"],
                                               "old_until": int((time.time() + grace_s) * 1000)})
    return key


def set_limits(client, tenant: str, rpm: int, tpm: int, budget: int, per: str, concurrency: int = 0) -> None:
    """A tenant's own limits, over all its keys (0: none; concurrency 0: the gateway's)."""
    client.hset(auth.tenant_name(tenant), mapping={"rpm": rpm, "tpm": tpm, "budget": budget, "per": per,
                                                   "concurrency": concurrency})
    client.sadd(auth.TENANTS_SET, tenant)


def list_keys(client, tenant: str | None = None) -> list[KeyInfo]:
    rows = []
    now = time.time() * 1000
    for ident in sorted(_text(i) for i in client.smembers(auth.KEYS_SET)):
        r = _fields(client, ident)
        if not r or (tenant and r["tenant"] != tenant):
            continue
        expires = int(r.get("expires_at", "0"))
        state = "revoked" if r.get("revoked") == "1" else "expired" if expires and expires <= now else "active"
        rows.append(KeyInfo(ident, r["tenant"], r.get("models") or "*", int(r.get("rpm", 0)), int(r.get("tpm", 0)),
                            int(r.get("budget", 0)), r.get("per", ""), _when(expires), state,
                            r.get("scope", "tenant"), r.get("admin") == "1", _when(int(r.get("created", 0)))))
    return rows


def usage(client, tenant: str | None = None) -> list[dict]:
    """Each tenant's usage, then each key's: requests, tokens, cache hits, errors, limited; tokens today and this
    month."""
    rows = []
    tenants = sorted(_text(t) for t in client.smembers(auth.TENANTS_SET))
    keys = list_keys(client)
    for who, ident, owner in [("t", t, t) for t in tenants] + [("k", k.id, k.tenant) for k in keys]:
        if tenant and owner != tenant:
            continue
        counts = {_text(k): int(v) for k, v in client.hgetall(auth.usage_name(who, ident)).items()}
        day, month = auth.budget_names(who, ident)
        rows.append({"tenant": owner, "key": ident if who == "k" else "*",
                     **{f: counts.get(f, 0) for f in auth.USAGE_FIELDS},
                     "tokens_today": int(client.get(day) or 0), "tokens_month": int(client.get(month) or 0)})
    return rows


def as_dicts(rows: list[KeyInfo]) -> list[dict]:
    return [asdict(r) for r in rows]


def table(rows: list[dict]) -> str:
    """Rows as an aligned text table."""
    if not rows:
        return "(none)"
    columns = list(rows[0])
    cells = [[str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)
