"""`vllm-gateway chat`: stream one chat answer to a terminal, an operator's smoke test."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, TextIO

import aiohttp
import orjson
from aiohttp_sse_client import client as sse_client


class ChatFailed(Exception):
    """The gateway refused the request, or the stream ended before `[DONE]`."""


class OneShotEventSource(sse_client.EventSource):
    """aiohttp-sse-client's EventSource, for one POST of a generation.

    Browser EventSource semantics reconnect when a stream ends; a generation cannot resume
    where it stopped, so a stream that ends early is reported instead of re-requested. A
    refused request keeps its OpenAI error message (the library would drop the body).
    """

    def __init__(self, url: str, session: aiohttp.ClientSession, **kwargs: Any) -> None:
        super().__init__(
            url,
            option={"method": "POST"},
            session=session,
            reconnection_time=timedelta(0),
            max_connect_retry=0,
            **kwargs,
        )
        self._opened = False

    async def connect(self, retry: int = 0) -> None:
        if self._opened:
            raise ChatFailed("the stream ended before [DONE]")
        self._opened = True
        response = await self._session.request(self._method, self._url, **self._kwargs)
        if response.status != 200 or response.content_type != "text/event-stream":
            text = (await response.read()).decode(errors="replace")
            response.release()
            try:
                message = orjson.loads(text)["error"]["message"]
            except (orjson.JSONDecodeError, KeyError, TypeError):
                message = text or response.reason
            raise ChatFailed(f"{response.status}: {message}")
        self._response = response
        await self._connected()


async def stream_chat(
    gateway: str, model: str, prompt: str, max_tokens: int | None, out: TextIO
) -> int:
    """Ask `model` through `gateway`, print tokens as they arrive; return an exit code."""
    body: dict[str, object] = {
        "model": model,
        "stream": True,
        "messages": [{"role": "user", "content": prompt}],
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    url = gateway.rstrip("/") + "/v1/chat/completions"
    try:
        async with (
            aiohttp.ClientSession() as session,
            OneShotEventSource(url, session, json=body) as events,
        ):
            async for event in events:
                if event.data == "[DONE]":
                    break
                doc = orjson.loads(event.data)
                if "error" in doc:
                    raise ChatFailed(doc["error"].get("message", "error event"))
                for choice in doc.get("choices", []):
                    out.write((choice.get("delta") or {}).get("content") or "")
                    out.flush()
    except ChatFailed as e:
        out.write(f"\nerror {e}\n")
        return 1
    except aiohttp.ClientError as e:
        out.write(f"error: cannot reach {gateway}: {e}\n")
        return 1
    out.write("\n")
    return 0
