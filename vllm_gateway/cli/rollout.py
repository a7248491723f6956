"""`vllm-gateway rollout`: replace the workers of a model one at a time, with no failed request.

For each worker that serves the model (in URL order, numbered from 1):

    1. drain it (no new requests) and wait until nothing is in flight on it;
    2. remove it from the gateway;
    3. run the operator's command, if any (placeholders {url} {host} {port} {index}
       {model} {to_model}), e.g. `systemctl restart vllm@{index}`; with `--replacement same`
       (the default with a command) the same URL is added back: the command restarted the
       server in place;
    4. wait for the replacement to be ready: the re-added URL, or a new worker that registers
       itself (`--replacement new`), serving the new model;
    5. shift traffic: with `--alias`, the alias's split follows the counts of ready old and
       new workers, so clients asking for the alias move over as capacity does.

It aborts cleanly, leaving the fleet serving, when a drain does not finish in time (the
worker is undrained, nothing else changes), the command fails, or a replacement is not
ready in time (the workers not yet replaced keep serving; rerun to resume). Progress is
printed as it goes (which worker, in-flight count while draining, replacement state), and
a summary at the end. Every gateway call goes through the admin API (AdminClient).
"""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vllm_gateway.cli.admin_client import AdminClient, AdminError


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """What to replace and how. Durations are in seconds."""

    model: str  # workers serving this model are replaced
    to_model: str | None = None  # the replacements serve this one (default: `model`)
    alias: str | None = None  # the alias whose split moves from `model` to `to_model`
    command: str | None = None  # run after each removal (placeholders above)
    replacement: str | None = None  # "same" (re-add the URL) or "new" (wait for one)
    drain_timeout: float = 600.0
    ready_timeout: float = 900.0  # a vLLM server may take minutes to load a model
    poll: float = 0.5  # between two looks at the gateway

    @property
    def target(self) -> str:
        return self.to_model or self.model

    @property
    def same_url(self) -> bool:
        if self.replacement is not None:
            return self.replacement == "same"
        return self.command is not None


@dataclass(slots=True)
class Step:
    """One worker's replacement, as the summary shows it."""

    index: int
    old: str
    inflight_at_drain: int = 0
    drain_seconds: float = 0.0
    new: str | None = None
    ready_seconds: float = 0.0
    problem: str | None = None


@dataclass(slots=True)
class RolloutResult:
    steps: list[Step] = field(default_factory=list)
    planned: int = 0
    aborted: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.aborted is None


class Abort(Exception):
    """The rollout stops here; the message says why and what state the fleet is in."""


class Rollout:
    """Runs a `RolloutPlan` against one gateway, reporting through `out`."""

    def __init__(
        self, admin: AdminClient, plan: RolloutPlan, out: Callable[[str], None] = print
    ) -> None:
        self.admin = admin
        self.plan = plan
        self.out = out

    async def run(self) -> RolloutResult:
        plan = self.plan
        result = RolloutResult()
        started = time.monotonic()
        workers = await self.admin.workers()
        known_at_start = {w["url"] for w in workers}
        old = sorted(
            w["url"]
            for w in workers
            if plan.model in w["models"]
            and (plan.to_model is None or plan.target not in w["models"])
        )
        result.planned = len(old)
        if not old:
            result.aborted = f"no worker serves {plan.model}"
            self.out(f"nothing to do: {result.aborted}")
            return result
        self.out(
            f"rollout of {plan.model}"
            + (f" -> {plan.to_model}" if plan.to_model else "")
            + f": {len(old)} worker(s) to replace, one at a time"
        )
        replaced: list[str] = []
        try:
            for i, url in enumerate(old, 1):
                step = Step(i, url)
                result.steps.append(step)
                self.out(f"[{i}/{len(old)}] {url}")
                await self._drain(step)
                await self.admin.remove(url)
                self.out("  removed")
                if plan.command:
                    await self._run_command(step)
                if plan.same_url:
                    await self.admin.add(url)
                excluded = known_at_start | set(replaced)
                if plan.same_url:
                    excluded.discard(url)
                step.new = await self._wait_replacement(step, excluded)
                replaced.append(step.new)
                await self._shift(len(old) - i, len(replaced))  # the last one: 100 % new
        except Abort as e:
            result.aborted = str(e)
        except AdminError as e:
            result.aborted = f"the gateway answered {e}"
        result.seconds = time.monotonic() - started
        self._summary(result)
        return result

    # --- the steps -----------------------------------------------------------------------

    async def _inflight(self, url: str) -> int | None:
        """In-flight requests on `url`, summed over the gateway's processes; None if gone."""
        for w in await self.admin.list_workers():
            if w["url"] == url:
                return int(w["inflight"])
        return None

    async def _drain(self, step: Step) -> None:
        answer = await self.admin.drain(step.old)
        started = time.monotonic()
        inflight = await self._inflight(step.old) or 0
        step.inflight_at_drain = max(inflight, int(answer["worker"]["inflight"]))
        self.out(f"  draining: {step.inflight_at_drain} in flight")
        shown = step.inflight_at_drain
        while inflight:
            if time.monotonic() - started > self.plan.drain_timeout:
                await self.admin.undrain(step.old)
                raise Abort(
                    f"{step.old} still had {inflight} in flight after "
                    f"{self.plan.drain_timeout:g} s; it was undrained and keeps serving"
                )
            await asyncio.sleep(self.plan.poll)
            inflight = await self._inflight(step.old) or 0
            if inflight != shown:
                self.out(f"  draining: {inflight} in flight")
                shown = inflight
        step.drain_seconds = time.monotonic() - started
        self.out(f"  idle after {step.drain_seconds:.1f} s")

    async def _run_command(self, step: Step) -> None:
        plan = self.plan
        parts = urlsplit(step.old)
        command = plan.command.format(  # type: ignore[union-attr]
            url=step.old,
            host=parts.hostname or "",
            port=parts.port or "",
            index=step.index,
            model=plan.model,
            to_model=plan.target,
        )
        self.out(f"  running: {command}")
        proc = await asyncio.create_subprocess_shell(
            command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
        assert proc.stdout is not None
        async for line in proc.stdout:
            if text := line.decode("utf-8", "replace").rstrip():
                self.out("  | " + text)
        code = await proc.wait()
        if code != 0:
            raise Abort(
                f"the command failed (exit {code}) for {step.old}, which is removed; "
                f"fix it and rerun to resume: {shlex.quote(command)}"
            )

    async def _wait_replacement(self, step: Step, excluded: set[str]) -> str:
        """Wait for a ready worker serving the target model, not one of `excluded`."""
        plan = self.plan
        started = time.monotonic()
        shown: tuple[str | None, str | None] = (None, None)
        while True:
            candidates = [
                w
                for w in await self.admin.workers()
                if w["url"] not in excluded
                and (not plan.same_url or w["url"] == step.old)
                and (plan.same_url or plan.target in w["models"])
            ]
            ready = [w for w in candidates if w["state"] == "ready" and plan.target in w["models"]]
            if ready:
                step.ready_seconds = time.monotonic() - started
                url = ready[0]["url"]
                self.out(f"  replacement {url} ready after {step.ready_seconds:.1f} s")
                return url
            now = (candidates[0]["url"], candidates[0]["state"]) if candidates else (None, None)
            if now != shown:
                shown = now
                what = f"{now[0]}: {now[1]}" if now[0] else "none yet"
                self.out(f"  waiting for the replacement: {what}")
            if time.monotonic() - started > plan.ready_timeout:
                raise Abort(
                    f"no replacement for {step.old} became ready serving {plan.target} "
                    f"within {plan.ready_timeout:g} s; the workers not yet replaced keep "
                    f"serving, rerun to resume"
                )
            await asyncio.sleep(plan.poll)

    async def _shift(self, old_left: int, new_ready: int) -> None:
        """Point the alias at old and new versions in proportion to their ready workers."""
        plan = self.plan
        if not plan.alias or plan.target == plan.model:
            return
        weights: dict[str, Any] = {plan.model: old_left} if old_left else {}
        weights[plan.target] = new_ready
        await self.admin.set_alias(plan.alias, weights)
        total = old_left + new_ready
        shares = ", ".join(f"{m} {100 * n / total:.0f}%" for m, n in weights.items())
        self.out(f"  traffic: {plan.alias} -> {shares}")

    def _summary(self, result: RolloutResult) -> None:
        self.out("")
        done = sum(1 for s in result.steps if s.new)
        self.out(
            f"summary: {done} of {result.planned} worker(s) replaced in {result.seconds:.1f} s"
        )
        for s in result.steps:
            new = s.new or "(none)"
            self.out(
                f"  {s.index}. {s.old} -> {new}  drained {s.inflight_at_drain} in flight in "
                f"{s.drain_seconds:.1f} s, replacement ready in {s.ready_seconds:.1f} s"
            )
        if result.aborted:
            self.out(f"ABORTED: {result.aborted}")
        else:
            self.out("done: every worker replaced")
