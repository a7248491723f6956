"""The aiohttp internals the gateway relies on, pinned: if an aiohttp upgrade changes one,
this fails here, by name, rather than as a puzzling failure somewhere else.

- `AppRunner._make_server` (the one private hook): `ClientRunner` overrides it to rebuild
  the server aiohttp made as a `ClientServer`, from the public attributes `request_handler`,
  `request_factory` and `handler_cancellation`;
- `RequestHandler(manager, loop=..., **kwargs)` and `RequestHandler.handle_error(request,
  status, exc, message)`, which `ClientProtocol` overrides; `writer.output_size`, which it
  reads;
- `web.Server.__call__` builds the protocol of each connection (`ClientServer` overrides it).
"""

from __future__ import annotations

import asyncio
import inspect

from aiohttp import web
from aiohttp.http_writer import StreamWriter
from aiohttp.web_protocol import RequestHandler

from vllm_gateway.http.client_protocol import ClientProtocol, ClientRunner, ClientServer
from vllm_gateway.http.guard import ConnectionLimit, HeadGuard


def test_app_runner_still_builds_its_server_in_make_server():
    hook = getattr(web.AppRunner, "_make_server", None)
    assert hook is not None and inspect.iscoroutinefunction(hook)
    assert list(inspect.signature(hook).parameters) == ["self"]
    assert "_make_server" in vars(web.BaseRunner)  # the abstract hook setup() calls
    assert "_make_server" in inspect.getsource(web.BaseRunner.setup)


def test_the_server_attributes_the_gateway_rebuilds_from_are_public():
    params = inspect.signature(web.Server.__init__).parameters
    assert {"handler", "request_factory", "handler_cancellation"} <= set(params)
    assert inspect.getsource(web.Server.__init__).count("self.request_factory") == 1
    for name in ("request_handler", "request_factory", "handler_cancellation"):
        assert f"self.{name} =" in inspect.getsource(web.Server.__init__), name


def test_request_handler_signatures_the_gateway_overrides():
    assert list(inspect.signature(RequestHandler.__init__).parameters)[:3] == [
        "self",
        "manager",
        "loop",
    ]
    params = list(inspect.signature(RequestHandler.handle_error).parameters)
    assert params == ["self", "request", "status", "exc", "message"]
    assert "output_size" in inspect.getsource(StreamWriter)


async def test_client_runner_serves_with_the_gateways_protocols():
    app = web.Application()
    runner = ClientRunner(app, limit=ConnectionLimit(5), handler_cancellation=True)
    await runner.setup()
    try:
        server = runner.server
        assert type(server) is ClientServer
        assert server.handler_cancellation is True
        assert server.request_handler is not None and server.request_factory is not None
        guard = server()
        assert isinstance(guard, HeadGuard) and type(guard.inner) is ClientProtocol
        assert isinstance(guard.inner, RequestHandler)
        assert asyncio.get_running_loop() is server.loop
    finally:
        await runner.cleanup()
