"""Keeping the processes of one gateway (`serve --processes N`) in agreement.

Each process has its own registry, pools, probes and dispatcher, and the kernel spreads
client connections among them (SO_REUSEPORT). What one process is told, all must know:
every state-changing control request (POST/PUT/PATCH/DELETE under /admin/, and the
FastChat registration endpoints) that a process receives from a client is handled there
and also re-sent, as is, to every sibling over its private unix socket, marked with the
`X-Gateway-Sibling` header so that a sibling handles it locally and never fans it out
again. This is generic over paths: a new control endpoint needs nothing here.

`GET /list_workers` and `GET /admin/workers` answer the same whichever process serves
them: the process asks its siblings for their own view and adds up the per-process
counters (in-flight, completed, failed); worker set, states and models are the serving
process's own, which the fan-out keeps equal (probes run in every process, so a state
may differ for one probe period). A control answer speaks for the whole gateway too
(`merge_control_answers`): a drain that waited is `idle` only if every process saw the
worker idle, since each process has its own requests in flight.

The unix sockets live in a directory only the gateway's user can enter; the sibling
header is honoured only on them, never from a TCP client.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from vllm_gateway.control.access import LOCAL_PEER_HEADER, local_peer
from vllm_gateway.log import get_logger

log = get_logger("vllm_gateway.siblings")

SIBLING_HEADER = "X-Gateway-Sibling"
CONTROL_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CONTROL_PREFIXES = ("/admin/",)
# FastChat's registration paths, and the two the `vllm-gateway register` agent adds
# (registration.py serves them).
CONTROL_PATHS = frozenset(
    {
        "/register_worker",
        "/receive_heart_beat",
        "/refresh_all_workers",
        "/drain_worker",
        "/unregister_worker",
    }
)
# Counters the worker lists add up across processes (each process counts its own requests).
SUMMED_FIELDS = ("inflight", "completed", "failed")
# Worker lists that answer for the whole gateway whichever process serves them.
MERGED_LISTS = frozenset({"/list_workers", "/admin/workers"})
# Longest wait for a sibling to handle a control request (a drain may wait for idle).
SIBLING_TIMEOUT_SECONDS = 600.0
# Not re-sent as the client sent them: framing, and what only the gateway may say.
_DROPPED = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "keep-alive",
        SIBLING_HEADER.lower(),
        LOCAL_PEER_HEADER.lower(),
    }
)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json_object(body: bytes | None) -> dict | None:
    try:
        doc = orjson.loads(body or b"")
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) else None


def _add_counters(mine: dict, theirs: dict) -> None:
    for field in SUMMED_FIELDS:
        if isinstance(theirs.get(field), int) and isinstance(mine.get(field), int):
            mine[field] += theirs[field]


def merge_worker_lists(doc: dict, others: list[dict]) -> None:
    """Add the other processes' counters into `doc["workers"]` (a worker list answer)."""
    by_url = {w["url"]: w for w in doc.get("workers", []) if isinstance(w, dict)}
    for other in others:
        for w in other.get("workers", []):
            mine = by_url.get(w.get("url")) if isinstance(w, dict) else None
            if mine is not None:
                _add_counters(mine, w)


def merge_control_answers(doc: dict, others: list[dict | None]) -> None:
    """Make a control answer speak for the whole gateway, not the process that answered.

    `idle` (a drain that waited, a removal after a drain) is true only if every process
    answered idle; a sibling that failed (None) counts as not idle, since nobody knows what
    it still has in flight. `waited_seconds` is the longest wait; the worker's counters are
    added up."""
    if "idle" in doc:
        doc["idle"] = doc["idle"] is True and all(
            o is not None and o.get("idle") is True for o in others
        )
    if isinstance(doc.get("waited_seconds"), int | float):
        for o in others:
            if o is not None and isinstance(o.get("waited_seconds"), int | float):
                doc["waited_seconds"] = max(doc["waited_seconds"], o["waited_seconds"])
    if isinstance(doc.get("worker"), dict):
        for o in others:
            if o is not None and isinstance(o.get("worker"), dict):
                _add_counters(doc["worker"], o["worker"])


def socket_path(control_dir: str, index: int) -> str:
    """The private unix socket of process `index`."""
    return os.path.join(control_dir, f"process-{index}.sock")


def is_control(method: str, path: str) -> bool:
    """Does this request change state that every process must share?"""
    return method in CONTROL_METHODS and (
        path in CONTROL_PATHS or path.startswith(CONTROL_PREFIXES)
    )


def _from_sibling(request: web.Request) -> bool:
    if SIBLING_HEADER not in request.headers:
        return False
    transport = request.transport
    # Only a request that came over a unix socket may claim to come from a sibling.
    return transport is not None and isinstance(transport.get_extra_info("sockname"), str)


class Siblings:
    """This process's view of the other processes of the gateway."""

    def __init__(self, index: int, count: int, control_dir: str) -> None:
        self.index = index
        self.count = count
        self.control_dir = control_dir
        self.path = socket_path(control_dir, index)
        self._sessions: list[aiohttp.ClientSession] = []

    async def open(self) -> None:
        for i in range(self.count):
            if i == self.index:
                continue
            self._sessions.append(
                aiohttp.ClientSession(
                    base_url="http://gateway-sibling",
                    connector=aiohttp.UnixConnector(socket_path(self.control_dir, i)),
                    timeout=aiohttp.ClientTimeout(total=SIBLING_TIMEOUT_SECONDS, connect=5),
                    auto_decompress=False,
                )
            )

    async def close(self) -> None:
        for s in self._sessions:
            await s.close()
        self._sessions.clear()

    async def _send(
        self, session: aiohttp.ClientSession, method: str, path: str, headers, body: bytes
    ) -> tuple[int, bytes] | None:
        try:
            async with session.request(method, path, headers=headers, data=body) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            log.warning("sibling unreachable", path=path, error=f"{type(e).__name__}: {e}")
            return None

    async def broadcast(self, request: web.Request, body: bytes) -> list[tuple[int, bytes] | None]:
        """Re-send `request` (with `body`) to every sibling; their answers, None if failed."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED}
        headers[SIBLING_HEADER] = str(self.index)
        # The sibling judges the client's address as this process did (access.local_peer).
        headers[LOCAL_PEER_HEADER] = "1" if local_peer(request) else "0"
        return await asyncio.gather(
            *(self._send(s, request.method, request.path_qs, headers, body) for s in self._sessions)
        )

    @staticmethod
    def asked_by_sibling(request: web.Request) -> bool:
        """Is this request a sibling asking for this process's own view?"""
        return _from_sibling(request)

    async def collect(self, request: web.Request) -> list[bytes]:
        """Each sibling's own answer (body) to this GET; siblings that failed are left out."""
        answers = await self.broadcast(request, b"")
        return [a[1] for a in answers if a is not None and a[0] == 200]

    def middleware(self) -> Callable:
        """The aiohttp middleware: fan control requests out, merge what processes count."""

        @web.middleware
        async def siblings_middleware(request: web.Request, handler: Handler):
            method = request.method
            path = request.path
            if method == "GET":
                if path in MERGED_LISTS and not _from_sibling(request):
                    return await self._merged_list(request, handler)
                return await handler(request)
            if not is_control(method, path) or _from_sibling(request):
                return await handler(request)
            body = await request.read()  # cached: the handler reads it again
            local, answers = await asyncio.gather(handler(request), self.broadcast(request, body))
            doc = _answer_doc(local)
            if doc is None:
                return local
            others = [
                _json_object(a[1]) if a is not None and a[0] == 200 else None for a in answers
            ]
            merge_control_answers(doc, others)
            return web.json_response(doc, status=local.status, dumps=_dumps)

        return siblings_middleware

    async def _merged_list(self, request: web.Request, handler: Handler):
        local, others = await asyncio.gather(handler(request), self.collect(request))
        doc = _answer_doc(local)
        if doc is None:
            return local
        merge_worker_lists(doc, [d for d in map(_json_object, others) if d is not None])
        doc["processes"] = self.count
        return web.json_response(doc, dumps=_dumps)


def _answer_doc(response: web.StreamResponse) -> dict | None:
    """The JSON object of a handler's 200 answer; None for anything else (left as it is)."""
    if not isinstance(response, web.Response) or response.status != 200:
        return None
    return _json_object(response.body)  # type: ignore[arg-type]


def _dumps(doc: object) -> str:
    return orjson.dumps(doc).decode()
