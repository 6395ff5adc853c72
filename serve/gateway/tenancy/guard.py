"""The gateway's guard in `--auth keys` mode: who a request comes from (a tenant's key, checked in Redis), whether
its limits admit it, and what it used.

One Redis round trip (auth.ADMIT) checks a key and takes requests from its buckets; a key seen for the first time
takes one more (its tenant). A key in heavy use is granted several requests at once (a lease: twice what its last
lease served, at most MAX_LEASE and 1 % of its requests limit), which this process admits without asking Redis for
LEASE_SECONDS; so a revoked key is refused by every replica within that, and unused requests of a lease are lost (a
key never gets more than its limit; a busy one may get up to a lease less). docs/tenants.md has the measurements.
Usage and tokens are charged in the background, coalesced per key and sent at most every FLUSH_SECONDS (auth.CHARGE);
charges Redis did not take are kept (one entry per key) and sent when it answers again.

Redis unreachable or frozen (each call bounded by --auth-redis-timeout, a key check tried twice, then Redis is
skipped for a back-off): a key validated in the last --auth-stale seconds is still admitted (--auth-fallback cached)
or every key is refused (refuse); limits then cannot be counted: requests pass (--limits-fail open) or are refused
with 503 (closed). A reservation or a charge is not repeated (it may have been taken).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from dstool.serve.gateway.tenancy import auth
from dstool.serve.gateway.tenancy.auth import Principal
from dstool.serve.gateway.tenancy.fairness import FairShare, Slot, TooManyWaiting
from dstool.serve.gateway.tensors import ITEM_SIZE, NUMPY_TYPES
from dstool.serve.gateway.triton_json import default_new_tokens
from dstool.serve.gateway.upstream import within

log = logging.getLogger("dstool.gateway")
FLUSH_SECONDS = 0.05
PERIODS = {"day": "daily", "month": "monthly"}
LEASE_SECONDS = 0.5  # a key validated in Redis is taken without asking again for this long
MAX_LEASE = 64  # requests granted by one Redis call at most (and 1 % of a requests limit at most: auth.ADMIT)


class Refused(Exception):
    """A request the guard does not admit: `status` 401 (key), 403 (not given), 429 (limit), 503 (Redis)."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error",
                 headers: list[tuple[str, str]] | None = None, tenant: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind
        self.headers = headers or []
        self.tenant = tenant
        self.left: int | None = None  # a token limit's: what it still holds


class RedisDown(Exception):
    pass


@dataclass
class Lease:
    """A key's last admission in Redis: who it is, and requests granted at once that are not used yet; good for
    LEASE_SECONDS (so a revoked key is refused within that), then Redis is asked again."""

    principal: Principal
    hash: str
    headers: list[tuple[str, str]]
    permits: int
    until: float
    validated: float
    used: int  # requests this lease admitted


@dataclass
class Charge:
    tenant: str
    tokens: int = 0
    counts: dict[str, int] = field(default_factory=dict)


UNKNOWN = "missing or wrong API key: pass a key from `dstool keys create` as 'Authorization: Bearer KEY'"


class Guard:
    def __init__(self, store, admin_token: str | None, fallback: str, stale: float, limits_fail: str, metrics,
                 concurrency: int = 8):
        self.store = store  # cache.RedisStore: its timeout and back-off
        self.admin = f"Bearer {admin_token}".encode() if admin_token else None
        self.fallback, self.stale, self.limits_fail = fallback, stale, limits_fail
        self.metrics = metrics
        self.tenant_of: dict[str, str] = {}  # key id -> tenant, for keys validated once (a key's tenant never changes)
        self.leases: dict[str, Lease] = {}  # key id -> its last admission (one per valid key: bounded)
        self.pending: dict[str, Charge] = {}  # key id -> what is not charged yet
        self._admit = store.client.register_script(auth.ADMIT)
        self._reserve = store.client.register_script(auth.RESERVE)
        self._charge = store.client.register_script(auth.CHARGE)
        self._flushing: asyncio.Task | None = None
        self.fair = FairShare(concurrency, metrics=metrics)  # tenants' turns on this process

    def well_formed(self, authorization: str) -> bool:
        """Whether a header may carry a key (checked before the body is read; the key itself is checked later)."""
        if self.admin is not None and hmac.compare_digest(_raw(authorization), self.admin):
            return True
        return authorization.startswith("Bearer ") and auth.parse_key(authorization[7:]) is not None

    async def _redis(self, make, again: bool = False):
        """The reply of the call `make()` makes; RedisDown when Redis cannot be reached in time (`again`: a call
        that may be repeated is tried once more first, so one slow answer is no outage), Refused (503) when it
        answers with an error (out of memory, a script error): that is no outage to fall back from."""
        from redis.exceptions import ResponseError
        from redis.exceptions import TimeoutError as RedisTimeout

        if not self.store.available:
            raise RedisDown()
        for attempt in range(2 if again else 1):
            try:
                reply = await within(make(), None)  # cancellable, whatever redis-py does with a cancellation
            except ResponseError as e:
                self.metrics.error("redis")
                raise Refused(503, f"Redis refused the key check: {e}", "unavailable", "server_error",
                              [("Retry-After", "1")]) from None
            except (RedisTimeout, asyncio.TimeoutError) as e:
                if attempt + 1 < (2 if again else 1):
                    continue
                self.store._failed(e)
                raise RedisDown() from None
            except Exception as e:  # a refused or broken connection: Redis is down
                self.store._failed(e)
                raise RedisDown() from None
            self.store._succeeded()
            return reply
        raise AssertionError("unreachable")

    def admit_now(self, authorization: str, inference: bool) -> tuple[Principal, list[tuple[str, str]]] | None:
        """`admit` without waiting: the principal and headers when this process can decide (the admin token, a
        lease), None when Redis must be asked; Refused for what is no key."""
        if self.admin is not None and hmac.compare_digest(_raw(authorization), self.admin):
            return auth.ADMIN, []
        ident = auth.parse_key(authorization[7:]) if authorization.startswith("Bearer ") else None
        if ident is None:
            self.metrics.error("unauthorized")
            raise Refused(401, UNKNOWN, "invalid_api_key")
        lease = self.leases.get(ident)
        if lease is not None and time.monotonic() < lease.until and \
                auth.same_hash(auth.key_hash(authorization[7:]), lease.hash):
            if not inference:
                return lease.principal, []
            if lease.permits > 0:
                lease.permits -= 1
                lease.used += 1
                self._admitted(lease.principal)
                return lease.principal, lease.headers
        return None

    async def admit(self, authorization: str, inference: bool) -> tuple[Principal, list[tuple[str, str]]]:
        """The principal of a request and its x-ratelimit-* headers; Refused when it is not admitted. `inference`:
        the request counts against the limits (metadata and health do not)."""
        decided = self.admit_now(authorization, inference)
        if decided is not None:
            return decided
        ident = auth.parse_key(authorization[7:])
        assert ident is not None  # admit_now refused anything else
        presented = auth.key_hash(authorization[7:])
        try:
            return await self._admit_in_redis(ident, presented, inference, self.leases.get(ident))
        except RedisDown:
            return self._admit_locally(ident, presented, inference)

    async def _admit_in_redis(self, ident: str, presented: str, inference: bool, lease: Lease | None):
        tenant = self.tenant_of.get(ident)
        if tenant is None:
            tenant = await self._redis(lambda: self.store.client.hget(auth.key_name(ident), "tenant"), again=True)
            if tenant is None:
                self.metrics.error("unauthorized")
                raise Refused(401, UNKNOWN, "invalid_api_key")
            tenant = tenant.decode() if isinstance(tenant, bytes) else str(tenant)
        _, _, day_ms, month_ms = auth.periods()
        # a lease of up to twice what the last one served (a key in heavy use asks Redis rarely, a quiet one each time)
        want = min(MAX_LEASE, max(1, 2 * lease.used)) if inference and lease is not None else int(inference)
        reply = await self._redis(lambda: self._admit(keys=auth.script_keys(ident, tenant),
                                                      args=[presented, want, tenant, day_ms, month_ms]), again=True)
        reply = [r.decode() if isinstance(r, bytes) else r for r in reply]
        status = reply[0]
        if status in ("unknown", "revoked", "expired"):
            self.leases.pop(ident, None)
            self.metrics.error("unauthorized")
            if status != "unknown":
                self.metrics.tenant(reply[1], status)
            raise Refused(401, UNKNOWN if status == "unknown" else f"this API key is {status}: ask for a new one "
                          "(`dstool keys create` or `dstool keys rotate`)", "invalid_api_key")
        if status == "limited":
            raise self._limited(reply)
        _, tenant, models, scope, admin, current, previous, granted, metered, concurrency = reply[:10]
        if not (auth.same_hash(presented, current) or auth.same_hash(presented, previous)):  # as the script found
            raise Refused(401, UNKNOWN, "invalid_api_key")
        principal = Principal(tenant, ident, frozenset(models.split(",")) if models else None, scope == "shared",
                              admin == "1", metered == "1", int(concurrency))
        self.tenant_of[ident] = tenant
        headers = _rate_headers(reply[10:])
        now = time.monotonic()
        kept = self.leases.get(ident)
        permits = max(0, int(granted) - 1) + (kept.permits if kept is not None and now < kept.until else 0)
        self.leases[ident] = Lease(principal, presented, headers, permits, now + LEASE_SECONDS, now,
                                   int(inference))
        if inference:
            self._admitted(principal)
        else:
            self.metrics.tenant(tenant, "checked")
        return principal, headers

    def _admitted(self, principal: Principal) -> None:
        self.metrics.tenant(principal.tenant, "admitted")
        self.charge(principal, requests=1)

    def _admit_locally(self, ident: str, presented: str, inference: bool):
        """Redis does not answer: a key validated within `stale` seconds (fallback cached), limits as configured."""
        known = self.leases.get(ident)
        if self.fallback == "refuse" or known is None or time.monotonic() - known.validated > self.stale or \
                not auth.same_hash(presented, known.hash):
            raise Refused(503, "API keys cannot be checked now (Redis does not answer): retry later", "unavailable",
                          "server_error", [("Retry-After", "1")])
        tenant = known.principal.tenant
        if inference and self.limits_fail == "closed":
            self.metrics.tenant(tenant, "unavailable")
            raise Refused(503, "rate limits cannot be counted now (Redis does not answer): retry later",
                          "unavailable", "server_error", [("Retry-After", "1")], tenant)
        if inference:
            self.metrics.tenant(tenant, "admitted_unchecked")
            self.charge(known.principal, requests=1)
        return known.principal, []

    def meter(self, principal: Principal) -> Meter:
        return Meter(self, principal)

    async def reserve(self, principal: Principal, tokens: int) -> bool:
        """Take `tokens` from the key's and tenant's tokens buckets and budgets before an inference runs: True when
        taken, False when nothing needs taking (no such limit, or Redis down and --limits-fail open); Refused (429)
        when they cannot hold it, (503) when Redis is down and --limits-fail closed."""
        if not principal.metered or tokens <= 0:
            return False
        _, _, day_ms, month_ms = auth.periods()
        day_s, month_s = _keep_seconds()
        try:
            reply = await self._redis(lambda: self._reserve(keys=auth.script_keys(principal.key_id, principal.tenant),
                                                            args=[tokens, day_ms, month_ms, day_s, month_s]))
        except RedisDown:
            if self.limits_fail == "closed":
                raise Refused(503, "token limits cannot be counted now (Redis does not answer): retry later",
                              "unavailable", "server_error", [("Retry-After", "1")], principal.tenant) from None
            return False
        reply = [r.decode() if isinstance(r, bytes) else r for r in reply]
        if reply[0] == "ok":
            return True
        raise self._too_many(reply, tokens)

    def _too_many(self, reply: list, tokens: int) -> Refused:
        """The refusal of a reservation the limits cannot hold (RESERVE's reply), with what they still hold."""
        refused = self._refusal_of(reply, tokens)
        refused.left = int(reply[7])
        return refused

    def _refusal_of(self, reply: list, tokens: int) -> Refused:
        kind, who, limit, retry_ms, tenant, per, left = reply[1], reply[2], int(reply[3]), int(reply[4]), *reply[5:8]
        self.metrics.tenant(tenant, "limited")
        owner = f"tenant '{tenant}'" if who == "tenant" else "this key"
        after = [] if retry_ms < 0 else [("Retry-After", str(max(1, math.ceil(retry_ms / 1000)))),
                                         ("retry-after-ms", str(retry_ms))]
        if kind == "budget":
            if tokens > limit:
                return Refused(429, f"Request too large for the {PERIODS.get(per, per)} token budget of {owner}: "
                                    f"limit {limit}, requested up to {tokens} tokens (the prompt and max_tokens for "
                                    "each choice): ask for fewer max_tokens", "insufficient_quota",
                               "insufficient_quota", [], tenant)
            return Refused(429, f"You exceeded your current quota: the {PERIODS.get(per, per)} token budget of {owner} "
                                f"({limit} tokens) has {left} left and this request may use up to {tokens}; it renews "
                                f"in {auth.reset_text(retry_ms)} (or ask for fewer max_tokens)", "insufficient_quota",
                           "insufficient_quota", after, tenant)
        if retry_ms < 0:
            return Refused(429, f"Request too large for tokens per minute (TPM) of {owner}: limit {limit}, requested "
                                f"up to {tokens} (the prompt and max_tokens for each choice): ask for fewer max_tokens",
                           "rate_limit_exceeded", "tokens", [], tenant)
        return Refused(429, f"Rate limit reached for tokens per minute (TPM) of {owner}: limit {limit}, used "
                            f"{limit - int(left)}, requested up to {tokens}. Please try again in "
                            f"{auth.reset_text(retry_ms)}.", "rate_limit_exceeded", "tokens",
                       [*after, ("x-ratelimit-limit-tokens", str(limit)), ("x-ratelimit-remaining-tokens", left),
                        ("x-ratelimit-reset-tokens", auth.reset_text(retry_ms))], tenant)

    def _limited(self, reply: list) -> Refused:
        kind, who, limit, retry_ms, tenant = reply[1], reply[2], int(float(reply[3])), int(float(reply[4])), reply[5]
        self.metrics.tenant(tenant, "limited")
        seconds = max(1, math.ceil(retry_ms / 1000))
        after = [("Retry-After", str(seconds)), ("retry-after-ms", str(retry_ms))]
        owner = f"tenant '{tenant}'" if who == "tenant" else "this key"
        if kind == "budget":
            per = reply[6]
            return Refused(429, f"You exceeded your current quota: the {PERIODS.get(per, per)} token budget of {owner} "
                                f"({limit} tokens) is spent; it renews in {auth.reset_text(retry_ms)}",
                           "insufficient_quota", "insufficient_quota", after, tenant)
        unit = "RPM" if kind == "requests" else "TPM"
        return Refused(429, f"Rate limit reached for {kind} per minute ({unit}) of {owner}: limit {limit}. "
                            f"Please try again in {auth.reset_text(retry_ms)}.", "rate_limit_exceeded", kind,
                       [*after, (f"x-ratelimit-limit-{kind}", str(limit)), (f"x-ratelimit-remaining-{kind}", "0"),
                        (f"x-ratelimit-reset-{kind}", auth.reset_text(retry_ms))], tenant)

    # ---- usage ---------------------------------------------------------------------------------------------
    def charge(self, principal: Principal, prompt: int = 0, completion: int = 0, cached: int = 0, hit: bool = False,
               error: bool = False, requests: int = 0, limits: int | None = None) -> None:
        """Count what a request used (tokens as they become known; call again for more); `limits`: the tokens to
        take from its buckets and budgets, when not prompt + completion (a Meter's reservation took them before)."""
        if not principal.key_id:
            return
        c = self.pending.get(principal.key_id)
        if c is None:
            c = self.pending[principal.key_id] = Charge(principal.tenant)
        c.tokens += prompt + completion if limits is None else limits
        for name, n in (("requests", requests), ("prompt_tokens", prompt), ("completion_tokens", completion),
                        ("cached_tokens", cached), ("cache_hits", int(hit)), ("errors", int(error))):
            if n:
                c.counts[name] = c.counts.get(name, 0) + n
        if prompt or completion or cached:
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
                names = auth.script_keys(ident, c.tenant)
                await self._redis(lambda names=names, args=args: self._charge(keys=names, args=args))
            except (RedisDown, Refused):
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


class Meter:
    """One inference of a key, from its start to its end: its turn among its tenant's inferences (`start`: places in
    the fair share, fairness.py), the most tokens it may use reserved before it runs (a 429 when the key's or
    tenant's tokens per minute or budget cannot hold it), its tokens charged as they come (`add`: usage, and the
    limits only beyond the reservation); `close` (once) gives back its places and the unspent reservation."""

    def __init__(self, guard: Guard, principal: Principal):
        self.guard, self.principal = guard, principal
        self.reserved = self.spent = 0
        self.closed = False
        self.slot: Slot | None = None

    async def start(self, places: int, tokens: int, least: int | None = None) -> int:
        """Wait for the tenant's turn for `places` sequences, then reserve `tokens` — or, with `least`, as many as
        the limits still hold if that is `least` or more (an answer without max_tokens: it gets what is left) —;
        Refused (closed) if they cannot be had. The tokens the answer may use."""
        try:
            self.slot = await self.guard.fair.acquire(self.principal.tenant, places, self.principal.concurrency)
        except TooManyWaiting as e:
            self.closed = True
            raise Refused(429, f"tenant '{self.principal.tenant}' has {e.waiting} sequences waiting on this gateway "
                               f"already (at most {e.cap} generate at once): retry later", "rate_limit_exceeded",
                          "requests", [("Retry-After", "1")], self.principal.tenant) from None
        try:
            try:
                if await self.guard.reserve(self.principal, tokens):
                    self.reserved += tokens
            except Refused as e:
                if least is None or e.left is None or e.left < least:
                    raise
                tokens = e.left
                if await self.guard.reserve(self.principal, tokens):
                    self.reserved += tokens
        except BaseException:
            self.close()
            raise
        return tokens

    def add(self, prompt: int = 0, completion: int = 0, cached: int = 0) -> None:
        over = max(0, self.spent - self.reserved)
        self.spent += prompt + completion
        self.guard.charge(self.principal, prompt, completion, cached, limits=max(0, self.spent - self.reserved) - over)

    def hit(self) -> None:
        self.guard.charge(self.principal, hit=True)

    def error(self) -> None:
        self.guard.charge(self.principal, error=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.slot is not None:
                self.slot.release()
            unspent = self.reserved - min(self.spent, self.reserved)
            if unspent:
                self.guard.charge(self.principal, limits=-unspent)


def estimated_tokens(text_bytes: int) -> int:
    """A prompt's tokens as reserved before the tokenizer has seen it: a token per 4 bytes (OpenAI's rule of thumb;
    what it really used is charged when known)."""
    return (text_bytes + 3) // 4


def _raw(header: str) -> bytes:
    """A header's bytes: an HTTP header as read (latin-1), gRPC metadata (any text) as UTF-8."""
    try:
        return header.encode("latin-1")
    except UnicodeEncodeError:
        return header.encode("utf-8", "surrogateescape")


COUNTED = ("output_ids", "prompt_tokens")  # a generation model's outputs that say its tokens


def tensor_tokens(request, result) -> tuple[int, int]:
    """(prompt, generated) tokens of a KServe inference, where its tensors say: the elements of an `input_ids` input
    (the tensor model), the values of a `prompt_tokens` output and the elements of an `output_ids` output
    (NAME_generate); the result's own `usage` when it has one (read off outputs the client did not ask for)."""
    if result.usage is not None:
        return result.usage
    prompt = sum(len(t.raw) // ITEM_SIZE.get(t.datatype, 8) for t in request.inputs if t.name == "input_ids")
    prompt += sum(int(v) for t in result.outputs if t.name == "prompt_tokens" and t.datatype in NUMPY_TYPES
                  for v in np.frombuffer(t.raw, NUMPY_TYPES[t.datatype]))
    made = sum(len(t.raw) // ITEM_SIZE.get(t.datatype, 8) for t in result.outputs if t.name == "output_ids")
    return prompt, made


def tensor_reservation(request, config: dict) -> int:
    """The most tokens a KServe inference may use, reserved for a tenant before it runs: its `input_ids`, its text
    (estimated) and, for a model that generates, its `max_new_tokens` (or the model's default)."""
    prompt = sum(len(t.raw) // ITEM_SIZE.get(t.datatype, 8) for t in request.inputs if t.name == "input_ids")
    text = sum(len(t.raw) for t in request.inputs if t.datatype == "BYTES")
    new = 0
    if any(i.get("name") == "max_new_tokens" for i in config.get("input") or []):
        asked = [t for t in request.inputs if t.name == "max_new_tokens" and t.datatype in NUMPY_TYPES and t.raw]
        new = sum(max(0, int(v)) for t in asked for v in np.frombuffer(t.raw, NUMPY_TYPES[t.datatype])) or \
            default_new_tokens(config)
    return prompt + estimated_tokens(text) + new


def _keep_seconds() -> tuple[int, int]:
    _, _, day_ms, month_ms = auth.periods()
    return day_ms // 1000 + 86400, month_ms // 1000 + 86400


def _rate_headers(buckets: list[str]) -> list[tuple[str, str]]:
    """x-ratelimit-* headers (OpenAI's) from the script's `kind:who:limit:remaining:reset_ms` entries: for each
    kind, the tighter of the key's and the tenant's."""
    tightest: dict[str, tuple[int, int, int]] = {}
    for entry in buckets:
        kind, _, limit, remaining, reset_ms = entry.split(":")
        row = (int(float(remaining)), int(float(limit)), int(float(reset_ms)))
        if kind not in tightest or row[0] < tightest[kind][0]:
            tightest[kind] = row
    headers = []
    for kind, (left, most, reset) in tightest.items():
        headers += [(f"x-ratelimit-limit-{kind}", str(most)), (f"x-ratelimit-remaining-{kind}", str(max(0, left))),
                    (f"x-ratelimit-reset-{kind}", auth.reset_text(reset))]
    return headers
