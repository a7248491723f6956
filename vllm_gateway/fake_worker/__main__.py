"""`python -m vllm_gateway.fake_worker`: run one fake vLLM server from the shell."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from vllm_gateway.fake_worker.config import FAULT_NAMES, FakeWorkerConfig
from vllm_gateway.fake_worker.server import run_forever


def main(argv: list[str] | None = None) -> None:
    d = FakeWorkerConfig()
    ap = argparse.ArgumentParser(prog="python -m vllm_gateway.fake_worker", description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--model", action="append", help="served model name (repeat; first is base)")
    ap.add_argument("--lora", action="append", default=[], help="LoRA adapter name (repeat)")
    ap.add_argument("--ttft-ms", type=float, default=d.ttft_ms)
    ap.add_argument("--tpot-ms", type=float, default=d.tpot_ms)
    ap.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    ap.add_argument("--max-tokens", type=int, default=d.max_tokens)
    ap.add_argument("--fault", help=f"NAME or NAME=PARAM; one of {', '.join(FAULT_NAMES)}")
    ap.add_argument("--api-key")
    ap.add_argument("--legacy-metrics", action="store_true")
    args = ap.parse_args(argv)
    config = FakeWorkerConfig(
        models=tuple(args.model or d.models),
        lora_adapters=tuple(args.lora),
        ttft_ms=args.ttft_ms,
        tpot_ms=args.tpot_ms,
        max_num_seqs=args.max_num_seqs,
        max_tokens=args.max_tokens,
        fault=args.fault,
        api_key=args.api_key,
        legacy_metrics=args.legacy_metrics,
    )
    try:
        import uvloop  # the fake must not be a benchmark's bottleneck

        runner = uvloop.run
    except ImportError:  # pragma: no cover
        runner = asyncio.run
    with contextlib.suppress(KeyboardInterrupt):
        runner(run_forever(config, args.host, args.port))


if __name__ == "__main__":
    main()
