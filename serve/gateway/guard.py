"""The gateway's guard in `--auth keys` mode: who a request comes from (a tenant's key, checked in Redis on every
request, so a revoked key is refused at once by every replica), whether its limits admit it, and what it used.

One Redis round trip admits a request (auth.ADMIT); a key seen for the first time takes one more (its tenant).
Usage and tokens are charged in the background, coalesced per key and sent at most every FLUSH_SECONDS (auth.CHARGE);
charges Redis did not take are kept (one entry per key) and sent when it answers again.

Redis unreachable or frozen (each call bounded by --redis-timeout, then skipped for a back-off): a key validated in
the last --auth-stale seconds is still admitted (--auth-fallback cached) or every key is refused (refuse); limits
then cannot be counted: requests pass (--limits-fail open) or are refused with 503 (closed).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from dataclasses import dataclass, field

from dstool.serve.gateway import auth
from dstool.serve.gateway.auth import Principal

log = logging.getLogger("dstool.gateway")
FLUSH_SECONDS = 0.05


class Refused(Exception):
    """A request the guard does not admit: `status` 401 (key), 403 (not given), 429 (limit), 503 (Redis)."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error",
                 headers: list[tuple[str, str]] | None = None, tenant: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind
        self.headers = headers or []
        self.tenant = tenant


class RedisDown(Exception):
    pass


@dataclass
class Charge:
    tenant: str
    tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)


UNKNOWN = "missing or wrong API key: pass a key from `dstool keys create` as 'Authorization: Bearer KEY'"


class Guard:
    def __init__(self, store, admin_token: str | None, fallback: str, stale: float, limits_fail: str, metrics):
        self.store = store  # cache.RedisStore: its timeout and back-off
        self.admin = f"Bearer {admin_token}".encode() if admin_token else None
        self.fallback, self.stale, self.limits_fail = fallback, stale, limits_fail
        self.metrics = metrics
        self.tenant_of: dict[str, str] = {}  # key id -> tenant, for keys validated once (a key's tenant never changes)
        self.valid: dict[str, tuple[str, Principal, float]] = {}  # key id -> (hash, principal, when validated)
        self.pending: dict[str, Charge] = {}  # key id -> what is not charged yet
        self._admit = store.client.register_script(auth.ADMIT)
        self._charge = store.client.register_script(auth.CHARGE)
        self._flushing: asyncio.Task | None = None

    def well_formed(self, authorization: str) -> bool:
        """Whether a header may carry a key (checked before the body is read; the key itself is checked later)."""
        if self.admin is not None and authorization.encode("latin-1") == self.admin:
            return True
        return authorization.startswith("Bearer ") and auth.parse_key(authorization[7:]) is not None

    async def _redis(self, call):
        if not self.store.available:
            raise RedisDown()
        try:
            reply = await call
        except Exception as e:  # redis errors, timeouts, a closed connection alike
            self.store._failed(e)
            raise RedisDown() from None
        self.store._succeeded()
        return reply

    async def admit(self, authorization: str, inference: bool) -> tuple[Principal, list[tuple[str, str]]]:
        """The principal of a request and its x-ratelimit-* headers; Refused when it is not admitted. `inference`:
        the request counts against the limits (metadata and health do not)."""
        if self.admin is not None and hmac.compare_digest(authorization.encode("latin-1"), self.admin):
            return auth.ADMIN, []
        ident = auth.parse_key(authorization[7:]) if authorization.startswith("Bearer ") else None
        if ident is None:
            self.metrics.error("unauthorized")
            raise Refused(401, UNKNOWN, "invalid_api_key")
        presented = auth.key_hash(authorization[7:])
        try:
            return await self._admit_in_redis(ident, presented, inference)
        except RedisDown:
            return self._admit_locally(ident, presented, inference)

    async def _admit_in_redis(self, ident: str, presented: str, inference: bool):
        tenant = self.tenant_of.get(ident)
        if tenant is None:
            tenant = await self._redis(self.store.client.hget(auth.key_name(ident), "tenant"))
            if tenant is None:
                self.metrics.error("unauthorized")
                raise Refused(401, UNKNOWN, "invalid_api_key")
            tenant = tenant.decode() if isinstance(tenant, bytes) else str(tenant)
        _, _, day_ms, month_ms = auth.periods()
        reply = await self._redis(self._admit(keys=auth.script_keys(ident, tenant),
                                              args=[presented, int(inference), tenant, day_ms, month_ms]))
        reply = [r.decode() if isinstance(r, bytes) else r for r in reply]
        status = reply[0]
        if status in ("unknown", "revoked", "expired"):
            self.valid.pop(ident, None)
            self.metrics.error("unauthorized")
            if status != "unknown":
                self.metrics.tenant(reply[1], status)
            raise Refused(401, UNKNOWN if status == "unknown" else f"this API key is {status}: ask for a new one "
                          "(`dstool keys create` or `dstool keys rotate`)", "invalid_api_key")
        if status == "limited":
            raise self._limited(reply)
        _, tenant, models, scope, admin, current, previous = reply[:7]
        if not (auth.same_hash(presented, current) or auth.same_hash(presented, previous)):  # as the script found
            raise Refused(401, UNKNOWN, "invalid_api_key")
        principal = Principal(tenant, ident, frozenset(models.split(",")) if models else None, scope == "shared",
                              admin == "1")
        self.tenant_of[ident] = tenant
        self.valid[ident] = (presented, principal, time.monotonic())
        self.metrics.tenant(tenant, "admitted" if inference else "checked")
        return principal, _rate_headers(reply[7:])

    def _admit_locally(self, ident: str, presented: str, inference: bool):
        """Redis does not answer: a key validated within `stale` seconds (fallback cached), limits as configured."""
        known = self.valid.get(ident)
        if self.fallback == "refuse" or known is None or time.monotonic() - known[2] > self.stale or \
                not auth.same_hash(presented, known[0]):
            raise Refused(503, "API keys cannot be checked now (Redis does not answer): retry later", "unavailable",
                          "server_error", [("Retry-After", "1")])
        if inference and self.limits_fail == "closed":
            self.metrics.tenant(known[1].tenant, "unavailable")
            raise Refused(503, "rate limits cannot be counted now (Redis does not answer): retry later",
                          "unavailable", "server_error", [("Retry-After", "1")], known[1].tenant)
        self.metrics.tenant(known[1].tenant, "admitted_unchecked" if inference else "checked")
        return known[1], []

    def _limited(self, reply: list) -> Refused:
        kind, who, limit, retry_ms, tenant = reply[1], reply[2], int(float(reply[3])), int(reply[4]), reply[5]
        self.metrics.tenant(tenant, "limited")
        seconds = max(1, math.ceil(retry_ms / 1000))
        after = [("Retry-After", str(seconds)), ("retry-after-ms", str(retry_ms))]
        owner = f"tenant '{tenant}'" if who == "tenant" else "this key"
        if kind == "budget":
            per = reply[6]
            return Refused(429, f"You exceeded your current quota: the {per}ly token budget of {owner} "
                                f"({limit} tokens) is spent; it renews in {auth.reset_text(retry_ms)}",
                           "insufficient_quota", "insufficient_quota", after, tenant)
        unit = "RPM" if kind == "requests" else "TPM"
        return Refused(429, f"Rate limit reached for {kind} per minute ({unit}) of {owner}: limit {limit}. "
                            f"Please try again in {auth.reset_text(retry_ms)}.", "rate_limit_exceeded", kind,
                       [*after, (f"x-ratelimit-limit-{kind}", str(limit)), (f"x-ratelimit-remaining-{kind}", "0"),
                        (f"x-ratelimit-reset-{kind}", auth.reset_text(retry_ms))], tenant)

    # ---- usage ---------------------------------------------------------------------------------------------
    def charge(self, principal: Principal, prompt: int = 0, completion: int = 0, cached: int = 0, hit: bool = False,
               error: bool = False) -> None:
        """Count what a request used (tokens as they become known; call again for more)."""
        if not principal.key_id:
            return
        c = self.pending.get(principal.key_id)
        if c is None:
            c = self.pending[principal.key_id] = Charge(principal.tenant)
        c.tokens += prompt + completion
        for name, n in (("prompt_tokens", prompt), ("completion_tokens", completion), ("cached_tokens", cached),
                        ("cache_hits", int(hit)), ("errors", int(error))):
            if n:
                c.counts[name] = c.counts.get(name, 0) + n
        self.metrics.tokens(principal.tenant, prompt, completion, cached)
        if self._flushing is None:
            self._flushing = asyncio.ensure_future(self._flush_later())

    async def _flush_later(self) -> None:
        try:
            await asyncio.sleep(FLUSH_SECONDS)
            await self.flush()
        finally:
            self._flushing = None
            if self.pending:
                self._flushing = asyncio.ensure_future(self._flush_later())

    async def flush(self) -> None:
        """Send what is pending; what Redis does not take stays pending."""
        day_s, month_s = _keep_seconds()
        for ident in list(self.pending):
            c = self.pending.pop(ident)
            args: list[str | int] = [c.tokens, day_s, month_s]
            for name, n in c.counts.items():
                args += [name, n]
            try:
                await self._redis(self._charge(keys=auth.script_keys(ident, c.tenant), args=args))
            except RedisDown:
                again = self.pending.setdefault(ident, Charge(c.tenant))
                again.tokens += c.tokens
                for name, n in c.counts.items():
                    again.counts[name] = again.counts.get(name, 0) + n
                await asyncio.sleep(1.0)  # Redis is down: try again later
                return

    async def close(self, timeout: float = 2.0) -> None:
        if self._flushing is not None:
            self._flushing.cancel()
        try:
            await asyncio.wait_for(self.flush(), timeout)
        except asyncio.TimeoutError:
            log.warning("gateway: usage of %d keys could not be written to Redis before exit", len(self.pending))


def _keep_seconds() -> tuple[int, int]:
    _, _, day_ms, month_ms = auth.periods()
    return day_ms // 1000 + 86400, month_ms // 1000 + 86400


def _rate_headers(buckets: list[str]) -> list[tuple[str, str]]:
    """x-ratelimit-* headers (OpenAI's) from the script's `kind:who:limit:remaining:reset_ms` entries: for each
    kind, the tighter of the key's and the tenant's."""
    tightest: dict[str, tuple[int, int, int]] = {}
    for entry in buckets:
        kind, _, limit, remaining, reset_ms = entry.split(":")
        row = (int(remaining), int(float(limit)), int(reset_ms))
        if kind not in tightest or row[0] < tightest[kind][0]:
            tightest[kind] = row
    headers = []
    for kind, (left, most, reset) in tightest.items():
        headers += [(f"x-ratelimit-limit-{kind}", str(most)), (f"x-ratelimit-remaining-{kind}", str(max(0, left))),
                    (f"x-ratelimit-reset-{kind}", auth.reset_text(reset))]
    return headers
