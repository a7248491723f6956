"""The autoscaler: every `interval`, each model's demand and desired worker count, and
(optionally) the operator's scale commands to get there.

Signals are always computed, in every process: `Autoscaler.signals` (model -> ModelDemand,
see demand.py) is what /admin/scale shows and /metrics exports as gauges, so KEDA or a
Kubernetes HPA can act on them instead. With `autoscale.enabled`, and only in process 0 of
a multi-process gateway (one host, one set of commands), the models that have a rule run
its `scale_up_command` / `scale_down_command`, once per worker added or taken away:

    up from 2 to 3 workers:   scale_up_command with {index}=3, {count}=2
    down from 3 to 2 workers: scale_down_command with {index}=3, {count}=3

So that a bursty demand does not flap the fleet:
  - hysteresis in the desired count itself (demand.desired_workers);
  - scale up only to the lowest desired count seen over `scale_up_window`, and down only to
    the highest seen over `scale_down_window` (an HPA's stabilization windows); from zero
    workers, up at once (requests wait in the admission queue: scale from zero);
  - no command for a model within `cooldown` of its previous one;
  - workers a scale-up started count as present for `startup_grace` while they load and
    register (so the next evaluation does not start them again), and workers a scale-down
    stopped count as gone (their agent is draining them).

A scale-down command must stop the worker gracefully: under systemd, stopping vllm@N stops
vllm-gateway-register@N first, whose agent drains the worker and deregisters it. With
`dry_run` the commands are logged, not run.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_gateway.config.gateway import AutoscaleConfig, ScaleRule
from vllm_gateway.dispatch.admission import Admission
from vllm_gateway.fleet.demand import ModelDemand, desired_workers, measure
from vllm_gateway.fleet.periodic import Periodic
from vllm_gateway.log import get_logger
from vllm_gateway.workers import WorkerRegistry

log = get_logger("vllm_gateway.autoscale")

# Requests queued in the gateway for a model: (how many, seconds the oldest has waited).
QueueView = Callable[[str], tuple[int, float]]
# Scale events kept for /admin/scale.
EVENTS_KEPT = 50


def _no_queue(model: str) -> tuple[int, float]:
    return 0, 0.0


def admission_view(admission: Admission) -> QueueView:
    """The autoscaler's view of the admission queue: per model, how many wait and how long
    the longest-waiting one has (seconds)."""

    def queued(model: str) -> tuple[int, float]:
        queue = admission.queues.get(model)
        if queue is None or not queue.live:
            return 0, 0.0
        oldest = min(waiter.enqueued for waiter in queue)
        return queue.live, max(0.0, time.monotonic() - oldest)

    return queued


@dataclass(slots=True)
class Commanded:
    """The worker count the last scale command asked for, and when."""

    count: int
    at: float
    up: bool


@dataclass(slots=True)
class ScaleEvent:
    """One scale command, as /admin/scale lists it."""

    at: float  # Unix time
    model: str
    direction: str  # up | down
    index: int
    command: str
    result: str  # ok | exit N | timeout | dry_run | error: ...

    def as_dict(self) -> dict[str, Any]:
        return {
            "at": self.at,
            "model": self.model,
            "direction": self.direction,
            "index": self.index,
            "command": self.command,
            "result": self.result,
        }


class Autoscaler:
    """Computes every model's demand and desired count; runs the scale commands."""

    def __init__(
        self,
        registry: WorkerRegistry,
        config: AutoscaleConfig,
        *,
        process_index: int = 0,
        queued: QueueView = _no_queue,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.config = config
        self.process_index = process_index
        self.queued = queued
        self.clock = clock
        self.signals: dict[str, ModelDemand] = {}
        self.current: dict[str, int] = {}  # worker count the desired one is compared with
        self.recommended: dict[str, int] = {}  # desired before the scale-down window
        self.commanded: dict[str, Commanded] = {}
        self._history: dict[str, deque[tuple[float, int]]] = {}
        self._last_command: dict[str, float] = {}
        self.events: deque[ScaleEvent] = deque(maxlen=EVENTS_KEPT)
        self.commands_run = 0  # scale commands run (dry runs excluded); telemetry reads it
        self.command_failures = 0
        self._steps = Periodic(
            "autoscaler", self.step, lambda: self.config.interval, log, "autoscaler step failed"
        )

    @property
    def runs_commands(self) -> bool:
        return self.config.enabled and self.process_index == 0

    # --- evaluation (no I/O) ---------------------------------------------------------------

    def _rule(self, model: str) -> ScaleRule | None:
        return self.config.models.get(model)

    def evaluate(self) -> dict[str, tuple[int, int]]:
        """Measure every model; return {model: (current, desired)} for those to change."""
        now = self.clock()
        cfg = self.config
        models = set(self.registry.known_models()) | set(cfg.models)
        changes: dict[str, tuple[int, int]] = {}
        for model in sorted(models):
            queued, queue_wait = self.queued(model)
            d = measure(model, self.registry.serving(model), queued, queue_wait)
            rule = self._rule(model)
            current = self._current(model, d.workers, now)
            own_target = rule.target_per_worker if rule else 0.0
            raw = desired_workers(
                d.demand,
                current,
                target=own_target or cfg.target_per_worker,
                down_fraction=cfg.scale_down_below,
                minimum=rule.min_workers if rule else min(1, d.workers),
                maximum=rule.max_workers if rule else None,
                queue_wait=queue_wait,
                queue_wait_up=cfg.queue_wait_up,
            )
            d.desired = self._stabilize(model, raw, current, now)
            self.signals[model] = d
            self.current[model] = current
            self.recommended[model] = raw
            if d.desired != current:
                changes[model] = (current, d.desired)
        for model in [m for m in self.signals if m not in models]:  # forgotten models
            for table in (self.signals, self.current, self.recommended, self._history):
                table.pop(model, None)
        return changes

    def _current(self, model: str, registered: int, now: float) -> int:
        """The worker count to compare with: the registry's, corrected by recent commands."""
        commanded = self.commanded.get(model)
        if commanded is None:
            return registered
        arrived = registered >= commanded.count if commanded.up else registered <= commanded.count
        if arrived:  # the command took effect
            del self.commanded[model]
            return registered
        if now - commanded.at > self.config.startup_grace:
            del self.commanded[model]
            log.warning(
                "scale command did not take effect",
                model=model,
                commanded=commanded.count,
                registered=registered,
            )
            return registered
        if commanded.up:  # started workers still loading count as present
            return max(registered, commanded.count)
        return min(registered, commanded.count)  # stopped workers still draining are gone

    def _stabilize(self, model: str, raw: int, current: int, now: float) -> int:
        """Up to the lowest, down to the highest recommendation seen in the windows."""
        cfg = self.config
        history = self._history.setdefault(model, deque())
        history.append((now, raw))
        while history and now - history[0][0] > max(cfg.scale_up_window, cfg.scale_down_window):
            history.popleft()
        if raw > current == 0:
            return raw  # requests wait with no worker at all: no reading to distrust
        if raw > current and cfg.scale_up_window > 0:
            return max(current, min(r for t, r in history if now - t <= cfg.scale_up_window))
        if raw < current and cfg.scale_down_window > 0:
            return min(current, max(r for t, r in history if now - t <= cfg.scale_down_window))
        return raw

    # --- acting ----------------------------------------------------------------------------

    async def step(self) -> None:
        """One evaluation, then the commands it calls for (when this process runs them)."""
        changes = self.evaluate()
        if not self.runs_commands:
            return
        now = self.clock()
        for model, (current, desired) in changes.items():
            rule = self._rule(model)
            if rule is None:
                continue
            command = rule.scale_up_command if desired > current else rule.scale_down_command
            if not command:
                continue
            last = self._last_command.get(model)
            if last is not None and now - last < self.config.cooldown:
                continue
            await self._scale(model, rule, current, desired, command)

    async def _scale(
        self, model: str, rule: ScaleRule, current: int, desired: int, command: str
    ) -> None:
        up = desired > current
        d = self.signals[model]
        log.info(
            "scaling " + ("up" if up else "down"),
            model=model,
            workers=current,
            desired=desired,
            demand=round(d.demand, 2),
            queued=d.queued,
            dry_run=self.config.dry_run,
        )
        reached = current
        indexes = range(current + 1, desired + 1) if up else range(current, desired, -1)
        for index in indexes:
            count = index - 1 if up else index
            text = command.format(model=model, index=index, count=count)
            result = await self._run(text)
            self.events.append(
                ScaleEvent(time.time(), model, "up" if up else "down", index, text, result)
            )
            if result not in ("ok", "dry_run"):
                break
            reached = index if up else index - 1
        self._last_command[model] = self.clock()
        if reached != current:
            self.commanded[model] = Commanded(reached, self.clock(), up)
            self.current[model] = reached

    async def _run(self, command: str) -> str:
        """Run one scale command; its result as the events list shows it."""
        if self.config.dry_run:
            log.info("scale command (dry run)", command=command)
            return "dry_run"
        self.commands_run += 1
        try:
            proc = await asyncio.create_subprocess_shell(
                command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
        except OSError as e:
            self.command_failures += 1
            log.error("scale command could not start", command=command, error=str(e))
            return f"error: {e}"
        try:
            async with asyncio.timeout(self.config.command_timeout):
                output, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            self.command_failures += 1
            log.error("scale command timed out", command=command)
            return "timeout"
        if proc.returncode != 0:
            self.command_failures += 1
            log.error(
                "scale command failed",
                command=command,
                exit=proc.returncode,
                output=output[-2000:].decode("utf-8", "replace"),
            )
            return f"exit {proc.returncode}"
        log.info("scale command done", command=command)
        return "ok"

    # --- views and lifetime ----------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """What /admin/scale shows."""
        models: dict[str, Any] = {}
        for model, d in self.signals.items():
            rule = self._rule(model)
            doc: dict[str, Any] = d.as_dict()
            doc["current"] = self.current.get(model, d.workers)
            doc["recommended"] = self.recommended.get(model, d.desired)
            doc["min_workers"] = rule.min_workers if rule else None
            doc["max_workers"] = rule.max_workers if rule else None
            doc["has_commands"] = bool(rule and (rule.scale_up_command or rule.scale_down_command))
            models[model] = doc
        return {
            "enabled": self.config.enabled,
            "dry_run": self.config.dry_run,
            "runs_commands": self.runs_commands,
            "models": models,
            "events": [e.as_dict() for e in self.events],
        }

    async def start(self) -> None:
        self._steps.start()

    async def stop(self) -> None:
        await self._steps.stop()
