"""The access log: one structured line per finished request, switchable, JSON or console."""

from __future__ import annotations

import io
import json
import logging

import openai
import pytest
import structlog

from tests.conftest import wait_until
from vllm_gateway import log as logging_setup
from vllm_gateway.app import REGISTRY
from vllm_gateway.config.gateway import LogConfig

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def log_stream():
    """Configure logging into a buffer (as `serve` does into stderr); undo it afterwards."""
    buffers: list[io.StringIO] = []

    def configure(format: str = "json", level: str = "warning") -> io.StringIO:
        buf = io.StringIO()
        logging_setup.configure(format, level, stream=buf)
        buffers.append(buf)
        return buf

    yield configure
    logging.getLogger().handlers.clear()
    structlog.reset_defaults()
    logging_setup._json_stream = None


def access_lines(buf: io.StringIO) -> list[dict]:
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    return [e for e in lines if e.get("event") == "request"]


async def test_one_json_line_per_finished_request(fake_worker, gateway, client, http, log_stream):
    # Level warning: the access log is written anyway, once switched on.
    buf = log_stream("json", "warning")
    w = await fake_worker(models="m", tpot_ms=20, ttft_ms=1)
    gw = await gateway([w], log=LogConfig(access_log=True))
    c = client(gw)
    await c.completions.create(
        model="m", prompt="x", max_tokens=2, extra_headers={"X-Request-Id": "abc-1"}
    )
    stream = await c.completions.create(model="m", prompt="x", max_tokens=3, stream=True)
    async for _ in stream:
        pass
    with pytest.raises(openai.NotFoundError):
        await c.completions.create(model="nope", prompt="x")
    # A client that leaves mid-stream.
    r = await http.post(
        gw.url + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 500, "stream": True},
    )
    await r.content.readany()
    r.close()
    await wait_until(lambda: gw.app[REGISTRY].get(w.url).inflight == 0)
    await wait_until(lambda: len(access_lines(buf)) == 4)

    first, streamed, rejected, gone = access_lines(buf)
    assert first["request_id"] == "abc-1"
    assert first["model"] == "m" and first["worker"] == w.url and first["path"] == "/v1/completions"
    assert first["status"] == 200 and first["outcome"] == "ok" and first["stream"] is False
    assert first["bytes"] > 0 and 0 < first["ttfb"] <= first["duration"]
    assert first["waited"] == 0.0  # a worker had room: no time in the admission queue
    assert first["placed"] == "only"  # cache_aware (the default), one worker to choose from
    assert first["level"] == "info" and first["timestamp"].endswith("Z")
    assert streamed["stream"] is True and streamed["outcome"] == "ok"
    # Three tokens at 20 ms: the answer ends well after its first byte.
    assert streamed["duration"] - streamed["ttfb"] > 0.02
    assert rejected["status"] == 404 and rejected["code"] == "model_not_found"
    assert rejected["outcome"] == "rejected" and "worker" not in rejected
    assert gone["outcome"] == "client_gone" and gone["status"] == 200


async def test_off_by_default_and_console_format(fake_worker, gateway, client, log_stream):
    buf = log_stream("json", "info")
    w = await fake_worker(models="m")
    gw = await gateway([w])
    await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    assert access_lines(buf) == []

    buf = log_stream("console", "warning")  # written whatever the level, here too
    gw = await gateway([w], log=LogConfig(access_log=True))
    await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    text = buf.getvalue()
    assert "request" in text and "outcome=ok" in text and f"worker={w.url}" in text
