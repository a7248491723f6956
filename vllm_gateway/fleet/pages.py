"""Reading a page a worker serves to the gateway itself (/v1/models, /metrics): capped, and
parsed off the event loop when large.

A worker's answers are untrusted input like a client's: a page of 300 MB read whole would
cost the gateway that much memory, and parsing it on the event loop would stall every
relay for as long. So

    body = await read_capped(response, limit)      # PageTooLarge beyond `limit` bytes
    value = await parse_off_loop(parse, body)      # in a thread when over OFF_LOOP_BYTES

`read_capped` refuses by the declared `Content-Length` before reading anything, and
otherwise stops reading as soon as the page passes the limit (the connection is then
closed, not reused: the rest of the page is never read).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import aiohttp

T = TypeVar("T")

# Pages over this many bytes are parsed in a thread: orjson reads about 1 MB/ms and the
# metrics parser about 50 MB/s, so below it a parse stays under ~5 ms on the loop, and
# above it the thread hop (~0.1 ms) is cheap beside the parse.
OFF_LOOP_BYTES = 256 * 1024


class PageTooLarge(ValueError):
    """A worker's page is longer than the limit the gateway reads."""


async def read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of `response`, or PageTooLarge once it passes `limit` bytes."""
    declared = response.content_length
    if declared is not None and declared > limit:
        response.close()  # never read: the connection cannot be reused
        raise PageTooLarge(f"the page is {declared} bytes; the limit is {limit}")
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        size += len(chunk)
        if size > limit:
            response.close()
            raise PageTooLarge(f"the page is over the {limit}-byte limit")
        parts.append(chunk)
    return b"".join(parts)


async def parse_off_loop(parse: Callable[[bytes], T], body: bytes) -> T:
    """`parse(body)`, in a worker thread when the body is large enough to stall the loop."""
    if len(body) <= OFF_LOOP_BYTES:
        return parse(body)
    return await asyncio.to_thread(parse, body)
