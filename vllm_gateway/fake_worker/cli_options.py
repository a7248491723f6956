"""The fake worker's prefix-cache options for `vllm-gateway fake-worker`, as one decorator
(and `--log-requests`, the log of what each request found cached).

Options default to None so the defaults live in one place, FakeWorkerConfig; the help
text shows them from there. `cache_settings(**given)` keeps only the options given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from vllm_gateway.fake_worker.config import FakeWorkerConfig

F = TypeVar("F", bound=Callable[..., Any])

_DEFAULTS = FakeWorkerConfig()

# option name -> (click type, metavar, help); the parameter is the config field's name.
_OPTIONS: dict[str, tuple[Any, str, str]] = {
    "--block-size": (
        click.IntRange(min=1),
        "TOKENS",
        f"Tokens per KV-cache block, as vLLM's --block-size. [default: {_DEFAULTS.block_size}]",
    ),
    "--num-gpu-blocks": (
        click.IntRange(min=1),
        "N",
        "KV-cache capacity in blocks; unused cached blocks are evicted LRU, full "
        "blocks of answers are cached too, and a request whose prompt's blocks do not "
        "fit beside the running requests' waits, as vLLM V1 does. [default: no limit; "
        "answers are then not cached and vllm:kv_cache_usage_perc reports the batch's fill]",
    ),
    "--kv-overcommit": (
        bool,
        "",
        "Admit a request whose prompt's blocks do not fit beside the running requests' "
        "(the cache over-commits) rather than keep it waiting, as vLLM does. [default: off]",
    ),
    "--prefill-ms-per-token": (
        click.FloatRange(min=0),
        "MS",
        "Prefill time per uncached prompt token, on top of --ttft-ms; the worker's "
        f"prefills run one after another. [default: {_DEFAULTS.prefill_ms_per_token:g}]",
    ),
    "--log-requests": (
        bool,
        "",
        "Write one JSON line per completion, chat or responses request to stderr as its "
        "prefill starts: the caller's X-Request-Id, prompt and uncached tokens, and the "
        "seconds since it arrived (waiting for a batch slot, KV blocks and others' "
        "prefills): where a gateway's placements cost prefill. [default: off]",
    ),
}


def cache_options(command: F) -> F:
    """Add the prefix-cache options to a click command."""
    for flag, (kind, metavar, text) in reversed(_OPTIONS.items()):
        if kind is bool:  # a flag: None when not given, so the config's default holds
            command = click.option(flag, is_flag=True, default=None, help=text)(command)
        else:
            command = click.option(flag, type=kind, default=None, metavar=metavar, help=text)(
                command
            )
    return command


def cache_settings(**given: Any) -> dict[str, Any]:
    """The FakeWorkerConfig fields among `given` that were set on the command line."""
    names = {flag[2:].replace("-", "_") for flag in _OPTIONS}
    return {k: v for k, v in given.items() if k in names and v is not None}
