"""The `serve` process: run the gateway, reload it on SIGHUP, stop it gracefully on SIGTERM.

    SIGHUP           reload the configuration from the sources read at start (file, env, CLI).
                     A configuration that fails validation is refused with the reasons
                     logged, and the running one stays. Connections are never dropped.
    SIGTERM, SIGINT  stop accepting connections, let in-flight requests and streams finish
                     for up to `lifecycle.shutdown_timeout`, end the rest cleanly, exit 0.
                     A second SIGTERM/SIGINT ends the wait at once.

Signals are handled on the event loop (never in the middle of a request's code). systemd
hears about each step through `sd_notify`: READY=1 once listening with workers probed,
RELOADING=1 / READY=1 around a reload, STOPPING=1 at the start of a stop, and WATCHDOG=1
while the loop runs.

With `processes` > 1, supervisor.py runs this in that many processes and becomes their
supervisor: it passes SIGHUP and SIGTERM on to each of them, and speaks to systemd for all
of them (READY once every process is ready, and again once every process reloaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import time
from collections.abc import Callable, Mapping

from vllm_gateway import log as logging_setup
from vllm_gateway.app import GATEWAY, create_app
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.errors import CannotListen, ConfigError
from vllm_gateway.http.server import RunningServer, new_event_loop, start_server
from vllm_gateway.log import get_logger
from vllm_gateway.process.reload import apply_config
from vllm_gateway.process.sd_notify import Notifier
from vllm_gateway.workers import WorkerState

log = get_logger("vllm_gateway.daemon")

# After the grace, requests still running are cancelled; this bounds their clean ending.
CLOSE_REST_SECONDS = 5.0
# The exit code of a gateway that could not listen on a port (supervisor.py stops then).
CANNOT_LISTEN = 3


def raise_open_files_limit() -> None:
    """Let this process hold as many connections as the service manager allows: raise the
    soft open-file limit to the hard one (each stream holds two sockets)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run_gateway(
    config: GatewayConfig,
    load: Callable[[], GatewayConfig] | None = None,
    *,
    process_index: int = 0,
    process_count: int = 1,
    control_dir: str | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Serve `config` in this process until SIGTERM or SIGINT, reloading on SIGHUP; the
    exit code (`CANNOT_LISTEN`: a port could not be listened on, said in the log).

    `process_index` of `process_count`: which of the `serve --processes N` processes this is
    (their private sockets live in `control_dir`)."""
    logging_setup.configure(config.log.format, config.log.level)
    raise_open_files_limit()
    notifier = Notifier(env, process=process_index if process_count > 1 else None)
    daemon = Daemon(config, load, notifier, process_index, process_count, control_dir)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        try:
            runner.run(daemon.run())
        except CannotListen as e:  # (the API's port, or the replicas' feed's)
            log.error(
                "cannot listen",
                error=str(e),
                hint="another process holds the port (a vLLM server listens on 8000 by "
                "default, as the gateway does): give the gateway another --port, or "
                "--replica-listen; or the address is not this host's",
            )
            return CANNOT_LISTEN
    return 0


class Daemon:
    """One gateway process's life: start, reload on request, stop gracefully."""

    def __init__(
        self,
        config: GatewayConfig,
        load: Callable[[], GatewayConfig] | None,
        notifier: Notifier,
        process_index: int = 0,
        process_count: int = 1,
        control_dir: str | None = None,
    ) -> None:
        self.config = config
        self.load = load
        self.notifier = notifier
        self.process_index = process_index
        self.process_count = process_count
        self.control_dir = control_dir
        self.signals: asyncio.Queue[int] = asyncio.Queue()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.signals.put_nowait, sig)
        config = self.config
        app = create_app(
            config,
            process_index=self.process_index,
            process_count=self.process_count,
            control_dir=self.control_dir,
        )
        unix_path = None
        if self.process_count > 1 and self.control_dir is not None:
            from vllm_gateway.process.siblings import socket_path

            unix_path = socket_path(self.control_dir, self.process_index)
        server = await start_server(
            app,
            config.host,
            config.port,
            reuse_port=self.process_count > 1,
            unix_path=unix_path,
            shutdown_timeout=CLOSE_REST_SECONDS,
            client=config.client,
        )
        log.info(
            "gateway listening",
            url=server.url,
            workers=len(config.workers),
            policy=config.policy,
            process=self.process_index,
        )
        if self.process_index == 0 and not (config.workers or config.discovery.dns):
            warn_no_worker(config)
        self.notifier.ready(self._summary(server))
        watchdog = asyncio.create_task(self.notifier.watchdog(), name="sd-watchdog")
        try:
            while await self.signals.get() == signal.SIGHUP:
                await self.reload(server)
            await self.stop(server)
        finally:
            watchdog.cancel()

    async def reload(self, server: RunningServer) -> bool:
        """Re-read and apply the configuration; keep the running one when it is invalid."""
        gateway = server.app[GATEWAY]
        self.notifier.reloading()
        log.info("reloading configuration")
        try:
            if self.load is None:
                raise ConfigError(["this gateway was started without a configuration source"])
            new = self.load()
            changes = apply_config(server.app, new)
        except Exception as e:  # whatever went wrong, the running configuration stays
            gateway.reloads.failed += 1
            gateway.reloads.last_ok = False
            problems = e.problems if isinstance(e, ConfigError) else [f"{type(e).__name__}: {e}"]
            log.error(
                "configuration reload refused; the running configuration stays",
                problems=problems,
            )
            self.notifier.ready(f"reload refused: {problems[0]}; {self._summary(server)}")
            return False
        gateway.reloads.succeeded += 1
        gateway.reloads.last_ok = True
        gateway.reloads.last_success = time.time()
        if any(w.state is WorkerState.JOINING for w in gateway.registry):
            # New workers: probe now (bounded like at start) so READY means they were seen.
            wait = gateway.config.probe.startup_wait
            if wait > 0:
                try:
                    async with asyncio.timeout(wait):
                        await gateway.prober.probe_all()
                except TimeoutError:
                    pass
        log.info("configuration reloaded", changes=changes or ["nothing changed"])
        self.notifier.ready(self._summary(server))
        return True

    async def stop(self, server: RunningServer) -> None:
        """Stop listening, let requests finish within the grace, end the rest, close."""
        gateway = server.app[GATEWAY]
        active = gateway.routes.active
        grace = gateway.config.lifecycle.shutdown_timeout
        self.notifier.stopping()
        log.info(
            "gateway stopping",
            in_flight=len(active),
            grace_seconds=grace,
            process=self.process_index,
        )
        await server.stop_listening()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while active and (remaining := deadline - loop.time()) > 0:
            try:
                sig = await asyncio.wait_for(self.signals.get(), min(remaining, 0.05))
            except TimeoutError:
                continue
            if sig != signal.SIGHUP:
                log.warning("second stop signal: ending the shutdown grace now")
                break
            log.warning("reload ignored: the gateway is stopping")
        if active:
            log.warning("shutdown grace over; ending the requests still running", left=len(active))
            gateway.relay.closing = True
            for task in list(active):
                task.cancel()
            end = loop.time() + CLOSE_REST_SECONDS
            while active and loop.time() < end:
                await asyncio.sleep(0.01)
        await server.stop()
        log.info("gateway stopped", process=self.process_index)

    @staticmethod
    def _summary(server: RunningServer) -> str:
        registry = server.app[GATEWAY].registry
        ready = sum(1 for w in registry if w.available)
        return f"serving on {server.url}; {ready} of {len(registry)} workers ready"


def warn_no_worker(config: GatewayConfig) -> None:
    """Say so when the gateway starts with no worker, and how to give it one: until one
    joins, every model request is answered 404."""
    log.warning(
        "no worker configured: no model is served until one joins; add one with "
        "--worker URL, [[workers]] in the config file or VLLM_GATEWAY_WORKERS, or let workers "
        "join: `vllm-gateway register` beside each vLLM server"
        + (" (registration is on)" if config.registration.enabled else " (registration is off)")
        + ", [[discovery.dns]], or `vllm-gateway workers add URL` (admin API)"
    )
