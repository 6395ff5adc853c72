"""The options of `dstool keys`: tenants' API keys in the gateways' Redis."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig, positional
from dstool.serve.cache_url import AUTO, CacheURL

TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a Redis name part and a metrics label
DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)([smhd])")
KEY_ACTIONS = {"create": {"tenant", "models", "rpm", "tpm", "budget_tokens", "per", "expires", "cache_scope", "admin"},
               "list": {"tenant", "format"}, "revoke": {"key_id"}, "rotate": {"key_id", "grace"},
               "usage": {"tenant", "format"}, "limits": {"tenant", "rpm", "tpm", "budget_tokens", "per", "concurrency"}}


def seconds(text: str) -> float:
    """A duration: 90s, 15m, 12h, 30d."""
    m = DURATION_RE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"'{text}' is not a duration: a number with s, m, h or d (e.g. 30d, 12h)")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


class KeysConfig(CommandConfig):
    """`dstool keys`: tenants' API keys for `dstool serve --auth keys`, kept (hashed) in the gateways' Redis."""

    action: Literal["create", "list", "revoke", "rotate", "usage", "limits"] = positional(
        "create (prints the new key once), list, revoke ID, rotate ID (prints the new secret once), usage, or limits "
        "(a tenant's own limits over all its keys)", metavar="ACTION")
    key_id: str | None = positional("the key's id (revoke, rotate; `dstool keys list` shows them)", None, "ID")
    redis: CacheURL = Field(AUTO, description="the gateways' Redis: redis://..., rediss://..., redis+cluster://... "
                            "(default: $DSTOOL_REDIS_URL or redis://127.0.0.1:6379/0, the serving cache's)",
                            json_schema_extra={"cli": {"metavar": "URL"}})
    tenant: str | None = Field(None, description="the tenant (create, limits; list and usage: only its rows)")
    models: str | None = Field(None, description="comma-separated models (or families, NAME for NAME_llm, ...; "
                               "BASE:ADAPTER for a LoRA adapter, which its base's name does not grant) the key may "
                               "use (default: all)", json_schema_extra={"cli": {"metavar": "M,..."}})
    rpm: int = Field(0, ge=0, le=10**12, description="requests per minute (0: no limit)")
    tpm: int = Field(0, ge=0, le=10**12, description="tokens per minute, prompt and generated (0: no limit)")
    budget_tokens: int = Field(0, ge=0, le=10**15, description="tokens per --per day or month (0: no budget)",
                               json_schema_extra={"cli": {"metavar": "N"}})
    per: Literal["day", "month"] | None = Field(None, description="the budget's period (UTC)")
    concurrency: int = Field(0, ge=0, le=10**6, description="limits: sequences the tenant may have generating at once "
                             "on each gateway process, and its weight in the fair share (0: the gateway's "
                             "--tenant-concurrency)")
    expires: str | None = Field(None, description="the key expires after this long: 90s, 15m, 12h, 30d",
                                json_schema_extra={"cli": {"metavar": "DURATION"}})
    cache_scope: Literal["tenant", "shared"] = Field("tenant", description="tenant: cached answers are this tenant's "
                                                     "alone; shared: the key reads and writes the scope every shared "
                                                     "key uses (see docs/tenants.md for the risk)")
    admin: bool = Field(False, description="the key may also load and unload models and LoRA adapters, use shared "
                        "memory, read /metrics and every model's statistics")
    grace: str = Field("0s", description="rotate: how long the old secret still works", json_schema_extra={
        "cli": {"metavar": "DURATION"}})
    format: Literal["table", "json"] = Field("table", description="how list and usage print")

    @field_validator("tenant")
    @classmethod
    def _tenant(cls, v: str | None) -> str | None:
        if v is not None and not TENANT_RE.fullmatch(v):
            raise ValueError(f"'{v}' is not a tenant name: 1-64 letters, digits, '.', '_' or '-', starting with a "
                             "letter or digit")
        return v

    @field_validator("expires", "grace")
    @classmethod
    def _duration(cls, v: str | None) -> str | None:
        if v is not None:
            seconds(v)
        return v

    @model_validator(mode="after")
    def _applies(self) -> KeysConfig:
        allowed = KEY_ACTIONS[self.action] | {"action", "redis"}
        given = sorted(self.model_fields_set - allowed)
        if given:
            name = given[0]
            shown = "ID" if name == "key_id" else "--" + name.replace("_", "-")
            raise ValueError(f"{shown} does not apply to `dstool keys {self.action}`")
        if self.action in ("create", "limits") and self.tenant is None:
            raise ValueError(f"`dstool keys {self.action}` needs --tenant NAME")
        if self.action in ("revoke", "rotate") and not self.key_id:
            raise ValueError(f"`dstool keys {self.action}` needs the key's ID (`dstool keys list` shows them)")
        if (self.budget_tokens > 0) != (self.per is not None):
            raise ValueError("--budget-tokens N goes with --per day or --per month")
        return self

    @field_validator("models")
    @classmethod
    def _models(cls, v: str | None) -> str | None:
        if v is not None and not [m for m in v.split(",") if m.strip()]:
            raise ValueError("names no model: give comma-separated model names, or leave --models out for all")
        return v

    def model_list(self) -> list[str]:
        return [m.strip() for m in (self.models or "").split(",") if m.strip()]
