"""A defect in a streamed answer's source (anything but an upstream or connection error) ends that answer and its
connection, logged: before, the client waited for the rest of a chunked answer that never came."""

from __future__ import annotations

import asyncio
import logging
import types

from dstool.serve.gateway.transport import HttpConnection, HttpLimits, HttpResponse, StreamingResponse


class Frontend:
    def __init__(self):
        self.limits = HttpLimits()
        self.answering: set = set()
        self.connections: set = set()
        self.buffered = 0
        self.draining = False
        self.errors: list[str] = []
        self.metrics = types.SimpleNamespace(error=self.errors.append)
        self.unauthorized = "no"

    def authorized(self, path, headers):
        return True

    def handle(self, req):
        if req.path == "/ok":
            return HttpResponse(200, [b"fine"], [("Content-Type", "text/plain")])

        async def broken():
            yield b"data: 1\n\n"
            raise KeyError("a defect")

        async def answer():  # as the routes answer a stream: awaited
            return StreamingResponse(200, [("Content-Type", "text/event-stream")], broken(), None)

        return answer()


def test_a_stream_whose_source_fails_ends_and_is_logged(caplog):
    async def main():
        frontend = Frontend()
        server = await asyncio.get_running_loop().create_server(lambda: HttpConnection(frontend), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 5)  # to the connection's end, which must come
        writer.close()
        server.close()
        return answer, frontend.errors

    with caplog.at_level(logging.ERROR, "dstool.gateway"):
        answer, errors = asyncio.run(main())
    assert answer.startswith(b"HTTP/1.1 200") and b"data: 1" in answer and not answer.endswith(b"0\r\n\r\n")
    assert errors == ["stream"] and "KeyError" in caplog.text
