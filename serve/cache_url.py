"""The gateway's `--cache`, parsed once into a `CacheURL`: which store it names (Redis, a Redis Cluster, a Unix
socket, the in-process memory, or `auto`), how to reach it, and how to print it without its password
(`redacted()`). `auto` — the default wherever a cache is not given — is the one rule for "no cache given":
$DSTOOL_REDIS_URL or the local Redis, used if it answers, else the in-process cache (`chosen()`).

Config models take a `CacheURL` field as text (YAML, flags) and hand out the parsed value; it dumps as the text."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic_core import core_schema

from dstool.errors import UsageError

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
ENVIRONMENT = "DSTOOL_REDIS_URL"
SCHEMES = ("redis", "rediss", "redis+cluster", "rediss+cluster", "unix")
Kind = Literal["auto", "memory", "redis", "cluster", "unix"]


@dataclass(frozen=True)
class CacheURL:
    text: str
    kind: Kind
    nodes: tuple[tuple[str, int], ...] = ()  # a cluster's startup nodes
    username: str | None = None
    password: str | None = None

    cli_type: ClassVar[type] = str  # the flag takes the text; the config model parses it

    @classmethod
    def parse(cls, text: str) -> CacheURL:
        """ValueError naming what is wrong with `text`."""
        if text in ("auto", "memory"):
            return cls(text, text)  # type: ignore[arg-type]
        parts = urlsplit(text)
        if parts.scheme not in SCHEMES:
            raise ValueError(f"'{text}': unknown scheme '{parts.scheme}' (use redis://, rediss://, redis+cluster://, "
                             "unix://, memory or auto)")
        if parts.scheme.endswith("+cluster"):
            auth, _, hosts = parts.netloc.rpartition("@")
            user, _, password = auth.partition(":")
            nodes = []
            for node in hosts.split(","):
                host, _, port = node.strip().rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"'{text}': '{node}' is not HOST:PORT (a cluster URL lists nodes as "
                                     "HOST:PORT,HOST:PORT)")
                nodes.append((host.strip("[]"), int(port)))
            if parts.path.strip("/") not in ("", "0"):
                raise ValueError(f"'{text}': a Redis Cluster has database 0 only: drop '{parts.path}'")
            return cls(text, "cluster", tuple(nodes), unquote(user) or None, unquote(password) or None)
        if parts.scheme == "unix":
            if not parts.path:
                raise ValueError(f"'{text}' names no socket path")
            return cls(text, "unix")
        try:
            _ = parts.port  # urllib checks the port when it is read
        except ValueError:
            raise ValueError(f"'{text}': the port is not a number from 0 to 65535") from None
        if not parts.hostname:
            raise ValueError(f"'{text}' names no host")
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"'{text}': the database '{db}' is not a number")
        return cls(text, "redis")

    @property
    def is_redis(self) -> bool:
        return self.kind in ("redis", "cluster", "unix")

    @property
    def tls(self) -> bool:
        return self.text.startswith("rediss")

    @property
    def ca_certs(self) -> str | None:
        found = parse_qs(urlsplit(self.text).query).get("ssl_ca_certs")
        return found[0] if found else None

    def redacted(self) -> str:
        """The URL as it may be logged: no password."""
        if "@" not in self.text:
            return self.text
        scheme, rest = self.text.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"

    def as_cluster(self) -> CacheURL:
        """redis://[AUTH@]HOST:PORT[/0] of a cluster node as the cluster's URL, with that node to start from."""
        scheme, rest = self.text.split("://", 1)
        netloc, _, query = rest.partition("?")
        return CacheURL.parse(f"{scheme}+cluster://{netloc.split('/', 1)[0]}" + (f"?{query}" if query else ""))

    def chosen(self) -> tuple[CacheURL, bool]:
        """The store to use, and whether it was asked for by name (a Redis not asked for is used only if it
        answers). UsageError for a $DSTOOL_REDIS_URL that is no cache URL."""
        if self.kind != "auto":
            return self, True
        try:
            return CacheURL.parse(os.environ.get(ENVIRONMENT) or DEFAULT_REDIS), False
        except ValueError as e:
            raise UsageError(f"${ENVIRONMENT}: {e}") from None

    def __str__(self) -> str:
        return self.text

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler) -> core_schema.CoreSchema:
        def coerce(value):
            if isinstance(value, CacheURL):
                return value
            if not isinstance(value, str):
                raise ValueError(f"a cache URL is text (redis://..., memory or auto), got {value!r}")
            return cls.parse(value)

        return core_schema.no_info_before_validator_function(
            coerce, core_schema.is_instance_schema(cls),
            serialization=core_schema.plain_serializer_function_ser_schema(str))


AUTO = CacheURL("auto", "auto")
