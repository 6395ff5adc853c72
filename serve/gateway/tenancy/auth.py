"""Tenants' API keys as they are kept in Redis, shared by the admin commands (`dstool keys`, serve/keys.py) and the
gateway's guard (guard.py): the key format, its hash, the record of a key and of a tenant, the Redis names, and the
two Lua scripts that admit a request and charge its tokens atomically (every gateway worker and replica runs the
same script on the same Redis, so they enforce one limit).

A key is `dsk-ID-SECRET`: ID (12 hex digits) names its record, SECRET is 32 random bytes. Only the key's SHA-256
is kept; a presented key is checked by its hash, compared in constant time. Every name lives under one Redis Cluster
hash tag, so a script's keys share a slot.

Limits are token buckets refilled continuously: a bucket of N per minute holds at most N and gains N/60 a second.
A request takes one from each requests bucket (key and tenant). An inference of a key with a tokens limit or a
budget (its own or its tenant's) first reserves the most it may use (RESERVE: its prompt, estimated, and its
max_tokens for each choice) from each tokens bucket and budget, and is refused when they cannot hold it; its
tokens are then charged as they are known (beyond the reservation, if ever) and what it did not use is given back
(CHARGE). A budget counts a key's or tenant's tokens per UTC day or month.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

NS = "{dstool-auth}"  # one Redis Cluster slot for every name below
KEY_PATTERN = re.compile(r"dsk-([0-9a-f]{12})-([A-Za-z0-9_-]{43})")
USAGE_FIELDS = ("requests", "prompt_tokens", "completion_tokens", "cached_tokens", "cache_hits", "errors", "limited")


def new_key(ident: str | None = None) -> tuple[str, str]:
    """(key id, the whole key): a new key, or a new secret for key `ident`."""
    ident = ident or secrets.token_hex(6)
    return ident, f"dsk-{ident}-{secrets.token_urlsafe(32)}"


def parse_key(key: str) -> str | None:
    """The id of a well-formed key, else None (nothing else is looked up)."""
    m = KEY_PATTERN.fullmatch(key)
    return m.group(1) if m else None


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def same_hash(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def key_name(ident: str) -> str:
    return f"{NS}:key:{ident}"


def tenant_name(tenant: str) -> str:
    return f"{NS}:tenant:{tenant}"


KEYS_SET, TENANTS_SET = f"{NS}:keys", f"{NS}:tenants"


def bucket(who: str, ident: str, kind: str) -> str:
    """`who` is k (a key) or t (a tenant); `kind` rpm or tpm."""
    return f"{NS}:bucket:{who}:{ident}:{kind}"


def usage_name(who: str, ident: str) -> str:
    return f"{NS}:usage:{who}:{ident}"


def periods(now: float | None = None) -> tuple[str, str, int, int]:
    """(day id, month id, ms to the day's end, ms to the month's end), UTC."""
    now = time.time() if now is None else now
    second = int(now)
    if _periods[0] != second:
        _periods[:] = [second, _periods_of(second)]
    day, month, day_ms, month_ms = _periods[1]
    return day, month, day_ms, month_ms


_periods: list = [None, None]  # the last second asked, its periods


def _periods_of(now: float) -> tuple[str, str, int, int]:
    t = datetime.fromtimestamp(now, timezone.utc)
    day_end = (t + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    month_end = (t.replace(day=28) + timedelta(days=4)).replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    return (t.strftime("%Y%m%d"), t.strftime("%Y%m"), int((day_end - t).total_seconds() * 1000) + 1,
            int((month_end - t).total_seconds() * 1000) + 1)


def budget_names(who: str, ident: str, now: float | None = None) -> tuple[str, str]:
    day, month, _, _ = periods(now)
    return f"{NS}:budget:{who}:{ident}:d{day}", f"{NS}:budget:{who}:{ident}:m{month}"


def script_keys(ident: str, tenant: str, now: float | None = None) -> list[str]:
    """The names both scripts take, in their order."""
    day = periods(now)[0]
    names = _names.get((ident, tenant))
    if names is None or names[0] != day:
        if len(_names) > 4096:
            _names.clear()
        names = _names[(ident, tenant)] = (day, [
            key_name(ident), tenant_name(tenant), bucket("k", ident, "rpm"), bucket("k", ident, "tpm"),
            bucket("t", tenant, "rpm"), bucket("t", tenant, "tpm"), *budget_names("k", ident, now),
            *budget_names("t", tenant, now), usage_name("k", ident), usage_name("t", tenant)])
    return names[1]


_names: dict[tuple[str, str], tuple[str, list[str]]] = {}  # (key id, tenant) -> (day, the names that day)


@dataclass(frozen=True)
class Principal:
    """Who a request comes from: a key of a tenant, what it may use, and how its answers are cached."""

    tenant: str
    key_id: str
    models: frozenset[str] | None  # None: every model
    shared: bool  # its cached answers are in the shared scope, not its tenant's
    admin: bool
    metered: bool = False  # its key or tenant has a tokens-per-minute limit or a budget: inferences reserve tokens
    concurrency: int = 0  # its tenant's own cap of sequences generating at once (0: the gateway's)

    def allows(self, model: str) -> bool:
        """A key given a model family NAME may use NAME and its NAME_llm, NAME_generate, ... models; a LoRA adapter
        BASE:ADAPTER only when it is given that name itself (a key given BASE is not given its adapters)."""
        if self.models is None or model in self.models:
            return True
        if ":" in model:
            return False
        head, _, tail = model.rpartition("_")
        return head in self.models and tail in FAMILY_SUFFIXES

    def not_given(self, model: str) -> str | None:
        """Why this key may not use `model` (the refusal's message), or None when it may."""
        if self.allows(model):
            return None
        return f"this key (tenant '{self.tenant}') is not given the model '{model}' (`dstool keys create --models`)"

    def not_given_adapter(self, model: str, adapter) -> str | None:
        """Why this key may not run `model` (a family's NAME_llm, over KServe) with the LoRA adapter its request's
        `adapter` parameter names, or None when it may (no adapter named, or its BASE:ADAPTER given)."""
        if adapter in (None, "") or self.models is None or not model.endswith("_llm"):
            return None
        name = f"{model[:-len('_llm')]}:{adapter}"
        if isinstance(adapter, str) and self.allows(name):
            return None
        return f"this key (tenant '{self.tenant}') is not given the model '{name}' (`dstool keys create --models`)"

    def scope(self, model: str, shared_models: frozenset[str]) -> str:
        """The cache namespace of this principal's answers from `model`: its tenant's, or the shared one (an
        adapter's, BASE:ADAPTER, when that name is among the shared models)."""
        family = model.rpartition("_")[0] if ":" not in model and model.rpartition("_")[2] in FAMILY_SUFFIXES \
            else model
        return "" if self.shared or model in shared_models or family in shared_models else f"t={self.tenant}"


FAMILY_SUFFIXES = frozenset({"llm", "generate", "decoder", "tokenizer", "detokenizer"})
ADMIN = Principal("(admin)", "", None, False, True)  # the gateway's own token, in keys mode


# What the three scripts share: the server's clock in ms, and a bucket's level now (refilled at `limit` per minute
# from its last write; full when it has none).
LEVEL = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function level(name, limit)
  local v = redis.call('HMGET', name, 'l', 't')
  local l = tonumber(v[1])
  if not l then return limit end
  l = l + (now - tonumber(v[2])) * limit / 60000
  if l > limit then l = limit end
  return l
end
"""

# Admit requests: check the presented hash against the record (the key's current hash, or its previous one within
# a rotation's grace) and its state, then (ARGV[2] = N > 0: inferences) each limit, and grant up to N requests at
# once (a lease: at most 1 % of each requests limit, at least 1), taken from each requests bucket. Returns {status,
# ...}; see guard.Guard for how it is read.
ADMIT = LEVEL + """
local r = redis.call('HMGET', KEYS[1], 'hash', 'old_hash', 'old_until', 'revoked', 'expires_at', 'tenant',
                     'rpm', 'tpm', 'budget', 'per', 'models', 'scope', 'admin')
if not r[1] then return {'unknown'} end
if ARGV[1] ~= r[1] and not (r[2] and ARGV[1] == r[2] and now < tonumber(r[3])) then return {'unknown'} end
if r[6] ~= ARGV[3] then return {'unknown'} end
if r[4] == '1' then return {'revoked', r[6]} end
local exp = tonumber(r[5] or '0')
if exp > 0 and now >= exp then return {'expired', r[6]} end
local tr = redis.call('HMGET', KEYS[2], 'rpm', 'tpm', 'budget', 'per', 'concurrency')
local metered = '0'
for _, v in ipairs({r[8], r[9], tr[2], tr[3]}) do
  if tonumber(v or '0') > 0 then metered = '1' end
end
local info = {'ok', r[6], r[11] or '', r[12] or 'tenant', r[13] or '0', r[1], r[2] or '', '0', metered,
              tr[5] or '0'}
local want = tonumber(ARGV[2])
if want < 1 then return info end
local buckets = {{KEYS[3], tonumber(r[7] or '0'), 'requests', 'key'}, {KEYS[4], tonumber(r[8] or '0'), 'tokens', 'key'},
                 {KEYS[5], tonumber(tr[1] or '0'), 'requests', 'tenant'},
                 {KEYS[6], tonumber(tr[2] or '0'), 'tokens', 'tenant'}}
local levels = {}
local grant = want
for i, b in ipairs(buckets) do
  if b[2] > 0 then
    local l = level(b[1], b[2])
    levels[i] = l
    if (b[3] == 'requests' and l < 1) or (b[3] == 'tokens' and l <= 0) then
      redis.call('HINCRBY', KEYS[11], 'limited', 1)
      redis.call('HINCRBY', KEYS[12], 'limited', 1)
      local need = b[3] == 'requests' and 1 - l or -l
      return {'limited', b[3], b[4], string.format('%d', b[2]), string.format('%d', math.ceil(need * 60000 / b[2]) + 1),
              r[6]}
    end
    if b[3] == 'requests' then
      grant = math.min(grant, math.floor(l), math.max(1, math.floor(b[2] / 100)))
    end
  end
end
local budgets = {{tonumber(r[9] or '0'), r[10], KEYS[7], KEYS[8], 'key'},
                 {tonumber(tr[3] or '0'), tr[4], KEYS[9], KEYS[10], 'tenant'}}
for _, b in ipairs(budgets) do
  if b[1] > 0 then
    local used = tonumber(redis.call('GET', b[2] == 'month' and b[4] or b[3]) or '0')
    if used >= b[1] then
      redis.call('HINCRBY', KEYS[11], 'limited', 1)
      redis.call('HINCRBY', KEYS[12], 'limited', 1)
      return {'limited', 'budget', b[5], string.format('%d', b[1]), b[2] == 'month' and ARGV[5] or ARGV[4], r[6],
              b[2]}
    end
  end
end
info[8] = tostring(grant)
for i, b in ipairs(buckets) do
  if b[2] > 0 then
    local l = levels[i]
    if b[3] == 'requests' then l = l - grant end
    redis.call('HSET', b[1], 'l', tostring(l), 't', now)
    redis.call('PEXPIRE', b[1], 120000)
    table.insert(info, string.format('%s:%s:%d:%d:%d', b[3], b[4], b[2], math.floor(l),
                                     math.ceil((b[2] - l) * 60000 / b[2])))
  end
end
return info
"""

# Reserve tokens (ARGV[1]) for one inference before it runs: each tokens bucket must hold them and each budget have
# them left, or nothing is taken ({'limited', kind, who, limit, retry ms (-1: never), tenant, per, left}); else they
# are taken from every bucket and budget at once ({'ok'}). ARGV[2], ARGV[3]: ms to the day's and the month's end;
# ARGV[4], ARGV[5]: seconds the day's and the month's counters are kept.
RESERVE = LEVEL + """
local n = tonumber(ARGV[1])
local r = redis.call('HMGET', KEYS[1], 'tpm', 'budget', 'per', 'tenant')
local tr = redis.call('HMGET', KEYS[2], 'tpm', 'budget', 'per')
local buckets = {{KEYS[4], tonumber(r[1] or '0'), 'key'}, {KEYS[6], tonumber(tr[1] or '0'), 'tenant'}}
local levels = {}
for i, b in ipairs(buckets) do
  if b[2] > 0 then
    local l = level(b[1], b[2])
    levels[i] = l
    if l < n then
      local wait = n <= b[2] and math.ceil((n - l) * 60000 / b[2]) + 1 or -1
      return {'limited', 'tokens', b[3], string.format('%d', b[2]), string.format('%d', wait), r[4], '',
              string.format('%d', math.max(0, math.floor(l)))}
    end
  end
end
local budgets = {{tonumber(r[2] or '0'), r[3], KEYS[7], KEYS[8], 'key'}, {tonumber(tr[2] or '0'), tr[3], KEYS[9],
                 KEYS[10], 'tenant'}}
for _, b in ipairs(budgets) do
  if b[1] > 0 then
    local used = tonumber(redis.call('GET', b[2] == 'month' and b[4] or b[3]) or '0')
    if used + n > b[1] then
      return {'limited', 'budget', b[5], string.format('%d', b[1]), b[2] == 'month' and ARGV[3] or ARGV[2], r[4],
              b[2], string.format('%d', math.max(0, b[1] - used))}
    end
  end
end
for i, b in ipairs(buckets) do
  if b[2] > 0 then
    redis.call('HSET', b[1], 'l', tostring(levels[i] - n), 't', now)
    redis.call('PEXPIRE', b[1], 120000)
  end
end
for i, name in ipairs({KEYS[7], KEYS[8], KEYS[9], KEYS[10]}) do
  redis.call('INCRBY', name, n)
  redis.call('EXPIRE', name, (i % 2 == 1) and ARGV[4] or ARGV[5])
end
return {'ok'}
"""

# Charge tokens (ARGV[1]; negative: a reservation's unspent part given back) to the key's and tenant's tokens buckets
# and budgets (ARGV[2], ARGV[3]: seconds the day's and the month's counters are kept), and add the usage counters
# (ARGV[4:], field, amount, ...).
CHARGE = LEVEL + """
local n = tonumber(ARGV[1])
if n ~= 0 then
  local r = redis.call('HMGET', KEYS[1], 'tpm')
  local tr = redis.call('HMGET', KEYS[2], 'tpm')
  for _, b in ipairs({{KEYS[4], tonumber(r[1] or '0')}, {KEYS[6], tonumber(tr[1] or '0')}}) do
    if b[2] > 0 then
      local l = level(b[1], b[2])
      redis.call('HSET', b[1], 'l', tostring(math.min(b[2], l - n)), 't', now)
      redis.call('PEXPIRE', b[1], 60000 + math.ceil(60000 * math.max(0, n - l) / b[2]) + 60000)
    end
  end
  for i, name in ipairs({KEYS[7], KEYS[8], KEYS[9], KEYS[10]}) do
    if n > 0 or redis.call('EXISTS', name) == 1 then
      redis.call('INCRBY', name, n)
      redis.call('EXPIRE', name, (i % 2 == 1) and ARGV[2] or ARGV[3])
    end
  end
end
for i = 4, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[11], ARGV[i], ARGV[i + 1])
  redis.call('HINCRBY', KEYS[12], ARGV[i], ARGV[i + 1])
end
return 1
"""


def reset_text(ms: int) -> str:
    """A duration as OpenAI writes x-ratelimit-reset-*: 20ms, 1s, 6m0s."""
    if ms < 1000:
        return f"{ms}ms"
    s = ms / 1000
    if s < 60:
        return f"{s:.3g}s"
    return f"{int(s // 60)}m{int(s % 60)}s"
