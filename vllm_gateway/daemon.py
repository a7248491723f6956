"""The `serve` process: configure logging, run the gateway until a signal, stop cleanly."""

from __future__ import annotations

import asyncio

from vllm_gateway import log as logging_setup
from vllm_gateway.app import create_app
from vllm_gateway.config import GatewayConfig
from vllm_gateway.log import get_logger
from vllm_gateway.server import run_until_signal, start_server

log = get_logger("vllm_gateway.daemon")


def run_gateway(config: GatewayConfig) -> None:
    """Serve `config` in this process until SIGINT or SIGTERM."""
    logging_setup.configure(config.log.format, config.log.level)

    async def main(stop: asyncio.Event) -> None:
        server = await start_server(create_app(config), config.host, config.port)
        log.info(
            "gateway listening", url=server.url, workers=len(config.workers), policy=config.policy
        )
        await stop.wait()
        log.info("gateway stopping")
        await server.stop()
        log.info("gateway stopped")

    run_until_signal(main)
