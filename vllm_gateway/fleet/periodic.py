"""Periodic: one background task that runs a step again and again, a pause apart, until stopped.

The gateway's background jobs (probes, scrapes, heartbeat expiry, DNS discovery, the
autoscaler) are each one of these, started and stopped from `create_app`'s cleanup_ctx:

    self._periodic = Periodic("prober", self.probe_all, lambda: self.config.interval,
                              log, "probe round failed")
    self._periodic.start()      # first step after the first pause
    ...
    await self._periodic.stop()

The pause is asked for before every step, so a reloaded interval applies from the next
one. A step that raises is logged with its traceback and the loop goes on: a bug in one
round must not end the job for good.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

import structlog

# A step may be a coroutine function or a plain one.
Step = Callable[[], Awaitable[object] | object]


class Periodic:
    """Runs `step()` in one task, `pause()` seconds after the previous step ended."""

    def __init__(
        self,
        name: str,
        step: Step,
        pause: Callable[[], float],
        log: structlog.stdlib.BoundLogger,
        failed: str,
    ) -> None:
        self.name = name  # the task's name
        self.step = step
        self.pause = pause
        self.log = log
        self.failed = failed  # the log event when a step raises
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.pause())
            try:
                result = self.step()
                if inspect.isawaitable(result):
                    await result
            except Exception:
                self.log.exception(self.failed)
