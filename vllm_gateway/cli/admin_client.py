"""A client of the admin API, for `vllm-gateway workers ...`, `rollout` and tests.

    async with AdminClient("http://127.0.0.1:8000", token) as admin:
        await admin.drain("http://10.0.0.5:8000", wait=True, timeout=300)

Each method is one request; a non-2xx answer raises `AdminError` carrying the status and
the message of the gateway's OpenAI error body.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import aiohttp
import orjson

# A drain that waits holds its request open; the client allows this much beyond its timeout.
WAIT_MARGIN_SECONDS = 10.0
# A wait without a timeout of its own lasts the gateway's admin.drain_timeout, unknown here.
UNKNOWN_WAIT_SECONDS = 3600.0


def _wait(waits: bool, timeout: float | None) -> float:
    if not waits:
        return 0.0
    return (UNKNOWN_WAIT_SECONDS if timeout is None else timeout) + WAIT_MARGIN_SECONDS


class AdminError(Exception):
    """The gateway refused or failed an admin request."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class AdminClient:
    """One gateway's admin API."""

    def __init__(self, gateway: str, token: str | None, *, timeout: float = 30.0) -> None:
        self.gateway = gateway.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AdminClient:
        self._session = aiohttp.ClientSession(headers=self.headers)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self, method: str, path: str, body: dict[str, Any] | None = None, wait: float = 0.0
    ) -> dict[str, Any]:
        """One admin request; the decoded JSON answer, or AdminError."""
        assert self._session is not None, "use `async with AdminClient(...)`"
        timeout = aiohttp.ClientTimeout(total=self.timeout + wait)
        data = orjson.dumps(body) if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else None
        try:
            async with self._session.request(
                method, self.gateway + path, data=data, headers=headers, timeout=timeout
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise AdminError(0, f"cannot reach {self.gateway}: {e or type(e).__name__}") from None
        try:
            doc = orjson.loads(raw) if raw else {}
        except orjson.JSONDecodeError:
            doc = {"error": {"message": raw[:200].decode(errors="replace")}}
        if status >= 300:
            error = doc.get("error") if isinstance(doc, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(doc)
            raise AdminError(status, str(message))
        return doc

    # --- workers -----------------------------------------------------------------------

    async def workers(self) -> list[dict[str, Any]]:
        return (await self.request("GET", "/admin/workers"))["workers"]

    async def list_workers(self) -> list[dict[str, Any]]:
        """GET /list_workers: every worker, in-flight counts added up over the processes."""
        return (await self.request("GET", "/list_workers"))["workers"]

    async def add(
        self, url: str, models: list[str] | None = None, weight: float | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url}
        if models:
            body["models"] = models
        if weight is not None:
            body["weight"] = weight
        return await self.request("POST", "/admin/workers/add", body)

    async def remove(
        self, url: str, *, drain: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url, "drain": drain}
        if timeout is not None:
            body["timeout"] = timeout
        return await self.request("POST", "/admin/workers/remove", body, wait=_wait(drain, timeout))

    async def drain(
        self, url: str, *, wait: bool = False, timeout: float | None = None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"url": url, "wait": wait}
        if timeout is not None:
            body["timeout"] = timeout
        return await self.request("POST", "/admin/workers/drain", body, wait=_wait(wait, timeout))

    async def undrain(self, url: str) -> dict[str, Any]:
        return await self.request("POST", "/admin/workers/undrain", {"url": url})

    async def set_weight(self, url: str, weight: float) -> dict[str, Any]:
        return await self.request("POST", "/admin/workers/weight", {"url": url, "weight": weight})

    # --- aliases -----------------------------------------------------------------------

    async def aliases(self) -> dict[str, Any]:
        return (await self.request("GET", "/admin/aliases"))["aliases"]

    async def set_alias(self, name: str, targets: dict[str, float]) -> dict[str, Any]:
        return await self.request("POST", "/admin/aliases/set", {"name": name, "targets": targets})

    async def remove_alias(self, name: str) -> dict[str, Any]:
        return await self.request("POST", "/admin/aliases/remove", {"name": name})

    # --- scale -------------------------------------------------------------------------

    async def scale(self) -> dict[str, Any]:
        return await self.request("GET", "/admin/scale")
