"""A bounded client for the two Kubernetes API calls discovery needs: LIST and WATCH.

    LIST   GET {path}?labelSelector=...&limit=500[&continue=...]   -> items, resourceVersion
    WATCH  GET {path}?labelSelector=...&watch=1&resourceVersion=RV&allowWatchBookmarks=true
           &timeoutSeconds=N  -> one JSON event per line: {"type": ..., "object": {...}}

The API server's answers are untrusted input like any other: every read is bounded in size
(a list body, one event line) and in time (connect, a whole list, the silence allowed on a
watch), and a body that is not the JSON expected is an `ApiError`, never a crash. A
resourceVersion too old to watch from (HTTP 410, or an ERROR event with code 410) is
`Gone`: the caller lists again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from vllm_gateway.fleet.discovery.kube_access import KubeAccess

MAX_LIST_BYTES = 32 * 1024 * 1024  # one page of a list
MAX_EVENT_BYTES = 4 * 1024 * 1024  # one watch event (an EndpointSlice holds <= 1000 endpoints)
MAX_PAGES = 100  # pages of 500 items: far beyond any Service
PAGE_SIZE = 500


@dataclass(frozen=True, slots=True)
class Timing:
    """How long each API call may take, and how the watch backs off (seconds)."""

    connect: float = 10.0
    list_timeout: float = 30.0  # a whole LIST page
    watch_seconds: int = 300  # asked of the server: it ends the watch then, we watch again
    silence: float = 360.0  # no byte for this long on a watch: the connection is dead
    backoff_min: float = 0.5  # after a failure; doubles up to backoff_max
    backoff_max: float = 30.0


class ApiError(Exception):
    """The API server refused, failed, or answered something that is not what we asked."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class Gone(ApiError):
    """410: the resourceVersion is too old to watch from; list again."""


class KubeClient:
    """LIST and WATCH of one collection on one API server."""

    def __init__(self, access: KubeAccess, session: aiohttp.ClientSession, timing: Timing) -> None:
        self.access = access
        self.session = session
        self.timing = timing
        self.ssl = access.ssl_context()

    async def list(self, path: str, selector: str) -> tuple[list[dict[str, Any]], str]:
        """Every item (all pages) and the list's resourceVersion, to watch from."""
        items: list[dict[str, Any]] = []
        params = {"labelSelector": selector, "limit": str(PAGE_SIZE)}
        for _ in range(MAX_PAGES):
            doc = await self._get_json(path, params)
            page = doc.get("items")
            meta = doc.get("metadata")
            if not isinstance(page, list) or not isinstance(meta, dict):
                raise ApiError("the list answer has no items or no metadata")
            items.extend(item for item in page if isinstance(item, dict))
            token = meta.get("continue")
            if not token or not isinstance(token, str):
                return items, _version(meta)
            params["continue"] = token
        raise ApiError(f"the list is longer than {MAX_PAGES} pages")

    async def watch(
        self, path: str, selector: str, version: str
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) per event from `version` on, until the server ends the watch."""
        params = {
            "labelSelector": selector,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.timing.watch_seconds),
        }
        timeout = aiohttp.ClientTimeout(
            total=None, connect=self.timing.connect, sock_read=self.timing.silence
        )
        async with self._get(path, params, timeout) as resp:
            await _check(resp)
            async for line in _lines(resp.content, MAX_EVENT_BYTES):
                event = _json(line)
                kind, obj = event.get("type"), event.get("object")
                if not isinstance(kind, str) or not isinstance(obj, dict):
                    raise ApiError("a watch event without type or object")
                if kind == "ERROR":
                    code = obj.get("code")
                    error = Gone if code == 410 else ApiError
                    raise error(f"watch error: {str(obj.get('message'))[:200]}", int(code or 0))
                yield kind, obj

    async def _get_json(self, path: str, params: Mapping[str, str]) -> dict[str, Any]:
        timeout = aiohttp.ClientTimeout(total=self.timing.list_timeout, connect=self.timing.connect)
        async with self._get(path, params, timeout) as resp:
            await _check(resp)
            declared = resp.content_length
            if declared is not None and declared > MAX_LIST_BYTES:
                raise ApiError(f"a list of {declared} bytes is over {MAX_LIST_BYTES}")
            body = bytearray()
            async for chunk in resp.content.iter_any():
                body += chunk
                if len(body) > MAX_LIST_BYTES:
                    raise ApiError(f"a list over {MAX_LIST_BYTES} bytes")
            return _json(bytes(body))

    def _get(
        self, path: str, params: Mapping[str, str], timeout: aiohttp.ClientTimeout
    ) -> AbstractAsyncContextManager[aiohttp.ClientResponse]:
        return self.session.get(
            self.access.server + path,
            params=params,
            headers={"Accept": "application/json", **self.access.headers()},
            ssl=self.ssl if self.ssl is not None else True,
            timeout=timeout,
            allow_redirects=False,
        )


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status == 200:
        return
    text = (await resp.content.read(2048)).decode("utf-8", "replace")
    error = Gone if resp.status == 410 else ApiError
    raise error(f"HTTP {resp.status}: {text[:200]}", resp.status)


async def _lines(stream: aiohttp.StreamReader, limit: int) -> AsyncIterator[bytes]:
    """Newline-terminated lines of `stream`, none longer than `limit` bytes."""
    buffer = bytearray()
    async for chunk in stream.iter_any():
        buffer += chunk
        while (end := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]
            if line.strip():
                yield line
        if len(buffer) > limit:
            raise ApiError(f"a watch event over {limit} bytes")
    if buffer.strip():
        yield bytes(buffer)


def _json(data: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ApiError("not a JSON object")
    return doc


def _version(meta: Mapping[str, Any]) -> str:
    """An object's resourceVersion: opaque, but a short string of digits in practice."""
    version = meta.get("resourceVersion")
    if not isinstance(version, str) or not version or len(version) > 64:
        raise ApiError("no usable resourceVersion")
    return version


def resource_version(obj: Mapping[str, Any]) -> str:
    """The resourceVersion in `obj.metadata`; ApiError when there is none."""
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        raise ApiError("an object without metadata")
    return _version(meta)
