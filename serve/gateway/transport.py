"""The gateway's HTTP/1.1 server: an asyncio.Protocol on httptools' parser (one `HttpConnection` per client),
the request and response types, and the limits that bound what one client may ask (`HttpLimits`, all options of
the gateway). It guards itself as a well-kept server does: the token is checked before a body is read, headers, URL
and bodies are bounded, slow or silent clients are timed out, pipelined requests are answered in order, and a
shutdown drains. What answers a request, and in which API's shape an error is worded, is the frontend it is given
(`Frontend`: http.HttpFrontend); this module knows no protocol above HTTP. Why a server of our own
rather than uvicorn or granian: docs/cache.md, "The HTTP server" (measured there).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, NoReturn, Protocol

import httptools

from dstool.serve.gateway.metrics import Metrics
from dstool.serve.gateway.upstream import UpstreamTimeout, UpstreamUnavailable, within

if TYPE_CHECKING:
    from dstool.serve.gateway.tenancy.auth import Principal

# After refusing a request: for how long, and how much of, what the client still sends is read and dropped.
LINGER_SECONDS, LINGER_BYTES = 2.0, 8 << 20

log = logging.getLogger("dstool.gateway")


@dataclass(frozen=True)
class HttpLimits:
    """What one client may ask of the server (defaults like nginx's and uvicorn's; all gateway options)."""

    max_request_bytes: int = 64 << 20
    max_generate_bytes: int = 4 << 20
    max_url_bytes: int = 8192
    max_header_bytes: int = 8192
    max_headers_bytes: int = 65536
    max_headers: int = 100
    header_timeout: float = 15.0
    body_timeout: float = 30.0
    keepalive_timeout: float = 5.0
    max_connections: int = 1024
    max_buffered_bytes: int = 256 << 20
    write_timeout: float = 30.0


@dataclass(slots=True)
class HttpRequest:
    method: str
    target: str  # path and query, as sent
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    principal: Principal | None = None  # who asks (--auth keys), once the guard admitted the request
    hit: bool = False  # answered from the cache (set by the route)
    tokens: tuple[int, int] = (0, 0)  # prompt and generated tokens a tensor request carried (set by the route)


@dataclass(slots=True)
class HttpResponse:
    status: int
    chunks: list[bytes]
    headers: list[tuple[str, str]] = field(default_factory=list)

    def encode(self, keep_alive: bool) -> list[bytes]:
        length = sum(map(len, self.chunks))
        head = [f"HTTP/1.1 {self.status} {_phrase(self.status)}\r\nContent-Length: {length}\r\n"]
        head += [f"{k}: {v}\r\n" for k, v in self.headers]
        if not keep_alive:
            head.append("Connection: close\r\n")
        head.append("\r\n")
        return ["".join(head).encode("latin-1"), *self.chunks]


EVENT_STREAM = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]  # server-sent events


@dataclass(slots=True)
class StreamingResponse:
    """A response whose body arrives in parts (server-sent events), sent with chunked transfer encoding."""

    status: int
    headers: list[tuple[str, str]]
    body: AsyncIterator[bytes]
    close: Callable[[], None] | None = None  # called once the answer ends, however it ends (the client gone too)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def opts_out(req: HttpRequest) -> bool:
    """Whether the client asked not to be answered from the cache (Cache-Control: no-cache or no-store)."""
    cache_control = req.headers.get("cache-control", "")
    return "no-store" in cache_control or "no-cache" in cache_control



Response = HttpResponse | StreamingResponse


class _Stop(Exception):
    """Raised from a parser callback once the request is refused: nothing after it is parsed."""


@dataclass(slots=True)
class _Refusal:
    """A refused request's answer, waiting in the connection's queue behind the answers before it."""

    status: int
    message: str


_REQUEST_LINE = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) [!-~]+ HTTP/[0-9]\.[0-9]\r?\n")  # RFC 9112 3


def _parse_error(e: httptools.HttpParserError, start: bytes) -> tuple[int, str]:
    """The answer to a request httptools cannot parse (RFC 9110/9112): 501 for a well-formed request-line whose
    method httptools does not know (`start` holds the request's first bytes, where known), 505 for an HTTP version
    it does not speak, else 400."""
    if isinstance(e, httptools.HttpParserInvalidMethodError) and (m := _REQUEST_LINE.match(start)):
        return 501, f"method {m.group(1)[:32].decode()!r} is not implemented"
    if str(e) == "Invalid HTTP version":
        return 505, "HTTP version not supported: the gateway speaks HTTP/1.0 and 1.1"
    return 400, f"malformed HTTP request: {e}"


_ABSOLUTE = re.compile(r"https?://[^/?#]*", re.IGNORECASE)


def _origin_form(target: str) -> str | None:
    """The path (and query) a request names: as sent, or taken out of an absolute URL; None for anything else
    (`*`, an authority), which no route of Triton's takes."""
    if target.startswith("/"):
        return target
    m = _ABSOLUTE.match(target)
    if m is None:
        return None
    return target[m.end():] if target[m.end():m.end() + 1] == "/" else "/" + target[m.end():]


class Frontend(Protocol):
    """What answers the requests of a connection (http.HttpFrontend): it routes them, says who may send a body, and
    words an error in the shape of the API a request speaks; the state the connections share lives on it."""

    limits: HttpLimits
    metrics: Metrics
    unauthorized: str
    connections: set[HttpConnection]
    answering: set[asyncio.Future]
    buffered: int
    draining: bool

    def authorized(self, path: str, headers: dict[str, str]) -> bool: ...

    def handle(self, req: HttpRequest) -> Response | Awaitable[Response]: ...

    def error(self, status: int, message: str, path: str, headers: dict[str, str]) -> HttpResponse: ...


class HttpConnection(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive; pipelined requests are answered in order. Each phase has a
    deadline (headers, body, idle), and a request that breaks a limit is answered in its turn (after the answers of
    the requests before it; nothing after it is read) and the connection closed. A client
    that hangs up cancels the request it was waiting for (and with it the work upstream); a streamed answer is
    written no faster than the client reads it (the transport's buffer bounds what waits here), and a client that
    reads nothing for `write_timeout` seconds has its stream ended."""

    def __init__(self, frontend: Frontend):
        self.frontend = frontend
        self.limits = frontend.limits
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        # requests not answered yet (with their bodies' share of --max-buffered-bytes), and a refusal
        self.queue: deque[tuple[HttpRequest, bool, int] | _Refusal] = deque()
        self.busy = False
        self.timer: asyncio.TimerHandle | None = None
        self.lingering, self.lingered = False, 0
        self.started = 0  # requests begun on this connection
        self.task: asyncio.Future | None = None  # the request being answered, when it waits
        self.writable = asyncio.Event()  # cleared while the transport's write buffer is over its high-water mark
        self.writable.set()
        self._begin_request()

    # ---- lifecycle and timeouts --------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        front = self.frontend
        if front.draining or len(front.connections) >= self.limits.max_connections:
            self._refuse(503, "the gateway is shutting down" if front.draining else
                         f"the gateway holds {self.limits.max_connections} connections: retry later")
            return
        front.connections.add(self)
        self._arm(self.limits.header_timeout, 408, "request headers not received in time")

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._disarm()
        self._release()
        self.frontend.connections.discard(self)
        self.writable.set()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # nobody is waiting for this answer any more: stop computing it

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def eof_received(self) -> bool:
        """The client closed its side: it is gone, as nginx and uvicorn take it (a socket closed whole and one only
        shut for writing look the same until an answer is written, which for a long generation may be minutes). The
        transport closes (answers already written are flushed) and the request in flight is cancelled."""
        return False

    def _arm(self, seconds: float, status: int | None, message: str = "") -> None:
        """Answer `status` and close (or just close, for an idle connection) unless the phase ends in time."""
        self._disarm()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._timed_out, status, message)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timed_out(self, status: int | None, message: str) -> None:
        self.timer = None
        if status is None:
            self._close()
        else:
            self.frontend.metrics.error("bad_request")
            self._refuse_in_turn(status, message)

    def idle(self) -> bool:
        return not self.busy and not self.queue and self.head_bytes == 0

    # ---- parsing ---------------------------------------------------------------------------------------
    def _begin_request(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.header_name = b""
        self.body: list[bytes] = []
        self.size = 0
        self.head_bytes = 0
        self.headers_done = False
        self.error: tuple[int, str] | None = None
        self.reserved = 0
        self.limit = self.limits.max_request_bytes  # this request's body limit

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        if self.lingering:  # what a refused client still sends is read and dropped, so it sees the answer
            self.lingered += len(data)
            if self.lingered > LINGER_BYTES and not self.queue:  # (not before the answers the refusal waits for)
                self._close()
            return
        in_head, started = not self.headers_done, self.started
        if in_head and self.head_bytes == 0 and not self.busy:
            self._arm(self.limits.header_timeout, 408, "request headers not received in time")
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # Triton answers an Upgrade request as a plain one: so does the gateway (then closes)
        except httptools.HttpParserError as e:  # a callback's _Stop too (it set the error)
            if self.error is None:
                self.error = _parse_error(e, data if in_head and self.head_bytes == 0 and
                                          self.started == started + 1 else b"")
        if in_head and not self.headers_done and self.started == started:  # still in the same request's head
            self.head_bytes += len(data)
            if self.head_bytes > self.limits.max_headers_bytes + self.limits.max_url_bytes and self.error is None:
                self.error = (431, f"request headers exceed {self.limits.max_headers_bytes} bytes")
        if self.error is not None:
            self._refuse_in_turn(*self.error)

    def _fail(self, status: int, message: str) -> NoReturn:
        """Refuse the request being parsed: nothing after it is read (_Stop ends the parser's pass)."""
        self.error = (status, message)
        raise _Stop()

    def _refuse_in_turn(self, status: int, message: str) -> None:
        """Answer a refused request once every request before it on the connection is answered (pipelined answers
        keep their order), then close; meanwhile what the client sends is dropped."""
        self._disarm()
        self.lingering = True
        if self.busy or self.queue:
            self.queue.append(_Refusal(status, message))
        else:
            self._refuse(status, message)

    def on_message_begin(self) -> None:
        self._begin_request()
        self.started += 1

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > self.limits.max_url_bytes:
            self._fail(414, f"request target exceeds {self.limits.max_url_bytes} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= self.limits.max_headers:
            self._fail(431, f"more than {self.limits.max_headers} request headers")
        if len(name) + len(value) > self.limits.max_header_bytes:
            self._fail(431, f"a request header exceeds {self.limits.max_header_bytes} bytes")
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.headers_done = True
        target = _origin_form(self.url.decode("latin-1"))
        if target is None and self.parser.get_method() == b"CONNECT":
            self._fail(501, "CONNECT is not implemented: the gateway is no proxy")
        if target is None:
            self._fail(400, "the request target must be a path (/v2/...) or an absolute http URL")
        codings = [c.strip().lower() for c in self.headers.get("transfer-encoding", "").split(",") if c.strip()]
        if any(c != "chunked" for c in codings):  # (llhttp has checked that chunked comes last)
            self._fail(501, f"Transfer-Encoding {self.headers['transfer-encoding']!r} is not implemented (only "
                            "chunked is)")
        self.url = target.encode("latin-1")
        front = self.frontend
        path = target.split("?", 1)[0]
        if path.startswith("/v1/") or path.endswith(("/generate", "/generate_stream")):
            self.limit = min(self.limit, self.limits.max_generate_bytes)
        limit = self.limit
        try:
            length = int(self.headers.get("content-length", "0"))
        except ValueError:
            self._fail(400, "Content-Length is not an integer")
        if not front.authorized(target.split("?", 1)[0], self.headers):  # before any byte of the body is read
            front.metrics.error("unauthorized")
            self._fail(401, front.unauthorized)
        elif length > limit:
            front.metrics.error("bad_request")
            self._fail(413, f"request body exceeds the gateway's limit of {limit} bytes")
        elif not self._reserve(length):
            self._fail(503, "the gateway holds too many request bodies at once: retry later")
        elif self.headers.get("expect", "").lower() == "100-continue" and self.transport is not None and \
                not self.busy and not self.queue:  # (behind other answers, the body comes when it comes)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if length or self.headers.get("transfer-encoding"):
            self._arm(self.limits.body_timeout, 408, "request body not received in time")
        else:
            self._disarm()

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limit:
            self._fail(413, f"request body exceeds the gateway's limit of {self.limit} bytes")
        elif self.size > self.reserved and not self._reserve(self.size - self.reserved):
            self._fail(503, "the gateway holds too many request bodies at once: retry later")
        self.body.append(body)
        self._arm(self.limits.body_timeout, 408, "request body not received in time")

    def on_message_complete(self) -> None:
        self._disarm()
        target = self.url.decode("latin-1")
        req = HttpRequest(self.parser.get_method().decode(), target, target.split("?", 1)[0], self.headers,
                          b"".join(self.body))
        self.body = []
        keep_alive = self.parser.should_keep_alive() and not self.parser.should_upgrade()
        self.headers_done, self.head_bytes = False, 0  # the next request starts in its head
        held, self.reserved = self.reserved, 0  # its body's share goes with the request, given back once answered
        if self.busy:
            self.queue.append((req, keep_alive, held))
            if len(self.queue) > 32 and self.transport is not None:
                self.transport.pause_reading()
        else:
            self._dispatch(req, keep_alive, held)

    def _reserve(self, nbytes: int) -> bool:
        front = self.frontend
        if front.buffered + nbytes > self.limits.max_buffered_bytes:
            return False
        front.buffered += nbytes
        self.reserved += nbytes
        return True

    def _release(self) -> None:
        """Give back the share of --max-buffered-bytes of the body being read and of the requests left unanswered
        (the request being answered gives back its own)."""
        self.frontend.buffered -= self.reserved + sum(item[2] for item in self.queue if not isinstance(item, _Refusal))
        self.reserved = 0
        self.queue.clear()

    # ---- answering -----------------------------------------------------------------------------------------
    def _dispatch(self, req: HttpRequest, keep_alive: bool, held: int) -> None:
        try:
            response = self.frontend.handle(req)
        except Exception as e:  # a bug must not take the connection's other requests with it
            response = self._defect(e, req)
        if isinstance(response, HttpResponse):
            self.frontend.buffered -= held
            self._write(response, keep_alive)
        else:
            self.busy = True
            self.task = asyncio.ensure_future(self._finish(response, keep_alive, req, held))
            self.frontend.answering.add(self.task)  # the loop holds tasks weakly: a cancelled one must still run
            self.task.add_done_callback(self.frontend.answering.discard)

    def _defect(self, e: Exception, req: HttpRequest) -> HttpResponse:
        return self.frontend.error(500, f"gateway error: {type(e).__name__}: {e}", req.path, req.headers)

    async def _finish(self, pending, keep_alive: bool, req: HttpRequest, held: int) -> None:
        try:
            response = await pending
        except Exception as e:
            response = self._defect(e, req)
        finally:
            self.frontend.buffered -= held  # (also when a hang-up cancels the answer)
        if isinstance(response, StreamingResponse):
            await self._stream(response, keep_alive)
        else:
            self._write(response, keep_alive)
        self.busy = False
        while self.queue and not self.busy and self.transport is not None:
            item = self.queue.popleft()
            if isinstance(item, _Refusal):  # the requests before it are answered: its turn, then the close
                self._refuse(item.status, item.message)
            else:
                self._dispatch(*item)
        if self.transport is not None and not self.queue:
            self.transport.resume_reading()  # (a refused client's too: what it sends is read and dropped)
            if not self.busy and not self.lingering:
                self._arm(self.limits.keepalive_timeout, None)

    def _write(self, response: HttpResponse, keep_alive: bool) -> None:
        if self.transport is None:
            return
        keep_alive = keep_alive and not self.frontend.draining
        self.transport.writelines(response.encode(keep_alive))
        self._after_response(keep_alive)

    async def _stream(self, response: StreamingResponse, keep_alive: bool) -> None:
        keep_alive = keep_alive and not self.frontend.draining
        body, whole = response.body, True
        try:
            if self.transport is None:  # the client went as its answer began: nobody will read it
                return
            head = [f"HTTP/1.1 {response.status} {_phrase(response.status)}\r\nTransfer-Encoding: chunked\r\n"]
            head += [f"{k}: {v}\r\n" for k, v in response.headers]
            if not keep_alive:
                head.append("Connection: close\r\n")
            self.transport.write("".join(head + ["\r\n"]).encode("latin-1"))
            async for chunk in body:
                if self.transport is None:
                    break
                if chunk:
                    self.transport.writelines([f"{len(chunk):x}\r\n".encode(), chunk, b"\r\n"])
                if not self.writable.is_set():  # the client reads slower than the answer comes: wait for it
                    try:
                        await within(self.writable.wait(), self.limits.write_timeout)
                    except asyncio.TimeoutError:
                        self.frontend.metrics.error("slow_client")
                        self._close()
                        break
        except (UpstreamUnavailable, UpstreamTimeout, ConnectionError):
            keep_alive = whole = False  # the stream broke off: the client sees the connection end, as from Triton
        except Exception as e:  # noqa: BLE001 (a defect in a stream's source ends that stream, said, never hangs)
            log.error(f"gateway: a streamed answer failed ({type(e).__name__}: {e}); its connection is closed")
            self.frontend.metrics.error("stream")
            keep_alive = whole = False
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()  # an answer cut short stops its source (and the work behind it) now
            if response.close is not None:
                response.close()
        if self.transport is not None:
            if whole:  # the last chunk, also before a close (Connection: close, or draining)
                self.transport.write(b"0\r\n\r\n")
            self._after_response(keep_alive)

    def _after_response(self, keep_alive: bool) -> None:
        if not keep_alive:
            self._close()
        elif not self.busy and not self.queue:
            self._arm(self.limits.keepalive_timeout, None)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the gateway will not read further, and close the connection once the client has had
        time to read the answer (what it still sends meanwhile is dropped unread, as nginx's lingering close does:
        a client that writes its whole body before reading still gets the 413 or 401)."""
        if self.transport is None:
            return
        target = _origin_form(self.url.decode("latin-1")) or ""
        refusal = self.frontend.error(status, message, target.split("?", 1)[0], self.headers)
        self.transport.writelines(refusal.encode(keep_alive=False))
        self._release()
        self.frontend.connections.discard(self)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.lingering, self.lingered = True, 0
        self._arm(LINGER_SECONDS, None)

    def _close(self) -> None:
        self._disarm()
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self._release()
        self.frontend.connections.discard(self)
