"""The gateway's HTTP frontend (routing, request decoding, cache, rendering — everything but the HTTP server) as an
ASGI app, so that bench/cache.py can measure it under uvicorn and granian beside the gateway's own HTTP server.
The gateway configuration comes as JSON in $DSTOOL_BENCH_GATEWAY; its own ports are random and unused."""

from __future__ import annotations

import json
import os

from dstool.serve.config.gateway_config import GatewayConfig
from dstool.serve.gateway import Gateway
from dstool.serve.gateway.transport import HttpRequest, HttpResponse, StreamingResponse


class App:
    def __init__(self):
        self.gateway: Gateway | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    config = json.loads(os.environ["DSTOOL_BENCH_GATEWAY"])
                    self.gateway = Gateway(GatewayConfig(**{**config, "http_port": 0, "grpc_port": 0}))
                    await self.gateway.start()
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await self.gateway.stop()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["raw_path"].decode("latin-1")
        target = path + ("?" + scope["query_string"].decode("latin-1") if scope["query_string"] else "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        response = self.gateway.http_frontend.handle(HttpRequest(scope["method"], target, path, headers, body))
        if not isinstance(response, (HttpResponse, StreamingResponse)):
            response = await response
        raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
        await send({"type": "http.response.start", "status": response.status, "headers": raw_headers})
        if isinstance(response, StreamingResponse):
            async for part in response.body:
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        else:
            await send({"type": "http.response.body", "body": b"".join(response.chunks)})


app = App()
