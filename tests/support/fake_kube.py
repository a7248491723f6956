"""A small fake Kubernetes API server on loopback: EndpointSlices, LIST and a chunked WATCH.

    api = FakeKubeApi(token="t")
    await api.start()
    api.put_slice("vllm-workers-abc", "vllm-workers", [endpoint("10.0.0.1")])   # ADDED
    api.delete_slice("vllm-workers-abc")                                        # DELETED
    api.drop_watches()          # cut every watch connection mid-stream
    api.push_raw(b"...")        # write bytes as they are to every watch
    api.compact()               # every resourceVersion seen so far is now too old (410)
    api.requests                # (kind, query) of each call: "list" or "watch"

Like the real one: one resourceVersion counter for the collection, a watch replays the
events after the version it is given (or answers an ERROR event with code 410 when that
version was compacted away), bookmarks on request, and `timeoutSeconds` ends a watch.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
from aiohttp import web

PATH = "/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
_DROP = object()


def endpoint(
    address: str, *, ready: bool | None = True, terminating: bool | None = None
) -> dict[str, Any]:
    """One EndpointSlice endpoint; None leaves the condition out."""
    conditions = {}
    if ready is not None:
        conditions["ready"] = ready
    if terminating is not None:
        conditions["terminating"] = terminating
    return {"addresses": [address], "conditions": conditions}


class FakeKubeApi:
    """EndpointSlices of one namespace, served over HTTP on 127.0.0.1."""

    def __init__(self, namespace: str = "vllm", token: str = "", port_name: str = "http") -> None:
        self.namespace = namespace
        self.token = token
        self.port_name = port_name
        self.port_number = 8000
        self.version = 100
        self.compacted = 0  # watches from a version older than this get 410
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.refuse = 0  # answer the next N calls with 500
        self.empty_lists = False  # LIST answers no item (a broken cache, say)
        self._watchers: set[asyncio.Queue[Any]] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(PATH.format(namespace=self.namespace), self._serve)
        # handler_cancellation: a watch whose client went away leaves `_watchers` at once.
        self._runner = web.AppRunner(app, shutdown_timeout=0.5, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self.drop_watches()
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Any) -> str:
        """Write a kubeconfig pointing at this server; return its path."""
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters:\n- name: fake\n  cluster:\n    server: {self.url}\n"
            f"contexts:\n- name: fake\n  context:\n    cluster: fake\n    user: me\n"
            f"    namespace: {self.namespace}\n"
            f'users:\n- name: me\n  user:\n    token: "{self.token}"\n'
        )
        return str(path)

    # --- changing the world ----------------------------------------------------------------

    def put_slice(self, name: str, service: str, endpoints: list[dict[str, Any]]) -> None:
        kind = "MODIFIED" if name in self.slices else "ADDED"
        self.version += 1
        obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "resourceVersion": str(self.version),
                "labels": {"kubernetes.io/service-name": service},
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": self.port_name, "port": self.port_number, "protocol": "TCP"}],
        }
        self.slices[name] = obj
        self._publish(kind, obj)

    def delete_slice(self, name: str) -> None:
        obj = dict(self.slices.pop(name))
        self.version += 1
        obj["metadata"] = {**obj["metadata"], "resourceVersion": str(self.version)}
        self._publish("DELETED", obj)

    def bookmark(self) -> None:
        self.version += 1
        obj = {"kind": "EndpointSlice", "metadata": {"resourceVersion": str(self.version)}}
        for queue in self._watchers:
            queue.put_nowait(("BOOKMARK", obj))

    def push_raw(self, data: bytes) -> None:
        """Write `data` as it is to every open watch (malformed answers)."""
        for queue in self._watchers:
            queue.put_nowait(("RAW", data))

    def compact(self) -> None:
        """Forget the history: a watch from any version seen so far gets 410 Gone."""
        self.version += 1
        self.compacted = self.version
        self.events.clear()

    def drop_watches(self) -> None:
        """Cut every open watch connection (no closing chunk: a dropped connection)."""
        for queue in self._watchers:
            queue.put_nowait(_DROP)

    def _publish(self, kind: str, obj: dict[str, Any]) -> None:
        self.events.append((self.version, kind, obj))
        for queue in self._watchers:
            queue.put_nowait((kind, obj))

    # --- serving ---------------------------------------------------------------------------

    async def _serve(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        watching = query.get("watch") in ("1", "true")
        self.requests.append(("watch" if watching else "list", query))
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "code": 401}, status=401)
        if self.refuse:
            self.refuse -= 1
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        service = query.get("labelSelector", "").removeprefix("kubernetes.io/service-name=")
        if not watching:
            items = [] if self.empty_lists else self._of(service, self.slices.values())
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": items,
                }
            )
        return await self._watch(request, service, int(query["resourceVersion"]))

    async def _watch(self, request: web.Request, service: str, since: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if since < self.compacted:
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            await resp.write(orjson.dumps({"type": "ERROR", "object": gone}) + b"\n")
            return resp
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for version, kind, obj in self.events:
            if version > since:
                queue.put_nowait((kind, obj))
        self._watchers.add(queue)
        try:
            async with asyncio.timeout(float(request.query.get("timeoutSeconds", "30"))):
                while True:
                    item = await queue.get()
                    if item is _DROP:
                        if request.transport is not None:
                            request.transport.abort()
                        return resp
                    kind, obj = item
                    if kind == "RAW":
                        await resp.write(obj)
                    elif kind == "BOOKMARK" or self._of(service, [obj]):
                        await resp.write(orjson.dumps({"type": kind, "object": obj}) + b"\n")
        except TimeoutError:
            return resp  # the server ends the watch, as timeoutSeconds asks
        finally:
            self._watchers.discard(queue)
            with contextlib.suppress(Exception):
                await resp.write_eof()

    @staticmethod
    def _of(service: str, slices: Any) -> list[dict[str, Any]]:
        return [
            s for s in slices if s["metadata"]["labels"]["kubernetes.io/service-name"] == service
        ]
