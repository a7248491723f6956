"""The `serve` process: configure logging, run the gateway until a signal, stop cleanly.

With `processes` > 1 this process becomes the supervisor of that many gateway processes
(supervisor.py); each of them runs `run_gateway` with its index.
"""

from __future__ import annotations

import asyncio

from vllm_gateway import log as logging_setup
from vllm_gateway.app import create_app
from vllm_gateway.config import GatewayConfig
from vllm_gateway.log import get_logger
from vllm_gateway.server import run_until_signal, start_server

log = get_logger("vllm_gateway.daemon")


def serve(config: GatewayConfig) -> int:
    """Run the gateway as configured (one process, or a supervisor of several)."""
    logging_setup.configure(config.log.format, config.log.level)
    if config.processes > 1:
        from vllm_gateway.supervisor import run_processes

        return run_processes(config)
    run_gateway(config)
    return 0


def run_gateway(
    config: GatewayConfig,
    *,
    process_index: int = 0,
    process_count: int = 1,
    control_dir: str | None = None,
) -> None:
    """Serve `config` in this process until SIGINT or SIGTERM."""
    logging_setup.configure(config.log.format, config.log.level)

    async def main(stop: asyncio.Event) -> None:
        app = create_app(
            config,
            process_index=process_index,
            process_count=process_count,
            control_dir=control_dir,
        )
        unix_path = None
        if process_count > 1 and control_dir is not None:
            from vllm_gateway.siblings import socket_path

            unix_path = socket_path(control_dir, process_index)
        server = await start_server(
            app, config.host, config.port, reuse_port=process_count > 1, unix_path=unix_path
        )
        log.info(
            "gateway listening",
            url=server.url,
            workers=len(config.workers),
            policy=config.policy,
            process=process_index,
        )
        await stop.wait()
        log.info("gateway stopping", process=process_index)
        await server.stop()
        log.info("gateway stopped", process=process_index)

    run_until_signal(main)
