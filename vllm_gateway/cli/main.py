"""The `vllm-gateway` command line: serve, check-config, hash-key, demo, chat, fake-worker.

Options default to None so that "not given" is distinguishable from a default: defaults
live in config.py alone, and a flag only overrides what the config file and environment say.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import click

from vllm_gateway import __version__
from vllm_gateway.cli.fleet import COMMANDS, CONTEXT
from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.load import load_config
from vllm_gateway.errors import ConfigError
from vllm_gateway.fake_worker.cli_options import cache_options, cache_settings


@click.group(context_settings=CONTEXT)
@click.version_option(__version__, prog_name="vllm-gateway")
def main() -> None:
    """One front door for many vLLM servers.

    Relays OpenAI requests to the workers (vLLM servers) that serve the requested model,
    streams answers back as they are generated, and sends each worker only as much as its
    own queue says it can take.

    \b
    Try it without a GPU:   vllm-gateway demo
    Run it for real:        vllm-gateway serve --worker http://10.0.0.5:8000 --worker ...
    """


def _load(config_path: str | None, overrides: dict[str, Any]) -> GatewayConfig:
    from vllm_gateway.app import app_config_problems

    try:
        return load_config(config_path, overrides=overrides, checks=app_config_problems)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@main.command(context_settings=CONTEXT)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="TOML configuration file. Env: VLLM_GATEWAY_CONFIG.",
)
@click.option("--host", help="Address to listen on.  [default: 127.0.0.1]")
@click.option("--port", type=int, help="Port to listen on.  [default: 8000]")
@click.option(
    "--worker",
    "workers",
    multiple=True,
    metavar="URL",
    help="A worker's base URL (repeatable); its models are learned from /v1/models.",
)
@click.option(
    "--policy",
    metavar="NAME",
    help="Dispatch policy for every model without its own: cache_aware (the default: "
    "where the prompt's prefix is cached, within a load bound), queue (least expected "
    "wait), least_inflight, power_of_two, session, prefix, and the load-blind round_robin "
    "and random; FastChat's shortest_queue and lottery are aliases.",
)
@click.option(
    "--processes",
    type=int,
    help="Gateway processes sharing the port (SO_REUSEPORT), e.g. one per core.  [default: 1]",
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    help="Log format.  [default: auto: console on a TTY, JSON lines otherwise]",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    help="Lowest level logged.  [default: info]",
)
@click.option(
    "--access-log/--no-access-log",
    default=None,
    help="One JSON line per finished request.  [default: off]",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    metavar="SECONDS",
    help="On SIGTERM, how long requests in flight may take to finish.  [default: 30]",
)
@click.option(
    "--replica-listen",
    metavar="HOST:PORT",
    help="Hear peer replicas' placements on this TCP port (its own, not the API's); needs "
    "VLLM_GATEWAY_REPLICAS_TOKEN, the replicas' shared secret.",
)
@click.option(
    "--peer",
    "peers",
    multiple=True,
    metavar="HOST:PORT",
    help="A peer replica's --replica-listen (repeatable): told where this gateway placed "
    "each prompt, so a conversation's turns find their history through either replica.",
)
def serve(
    config_path: str | None,
    host: str | None,
    port: int | None,
    workers: tuple[str, ...],
    policy: str | None,
    processes: int | None,
    log_format: str | None,
    log_level: str | None,
    access_log: bool | None,
    shutdown_timeout: float | None,
    replica_listen: str | None,
    peers: tuple[str, ...],
) -> None:
    """Run the gateway in front of the given workers.

    Settings come from, lowest precedence first: built-in defaults, the --config file,
    VLLM_GATEWAY_* environment variables, then these options. Every setting, with its
    default, TOML key and environment name: `vllm-gateway check-config --reference`.

    \b
    SIGHUP reloads the configuration (an invalid one is refused, the running one stays);
    SIGTERM stops gracefully: no new connections, requests in flight finish first.
    """
    overrides = {
        "host": host,
        "port": port,
        "workers": list(workers) or None,
        "policy": policy,
        "processes": processes,
        "log": {"format": log_format, "level": log_level, "access_log": access_log},
        "lifecycle": {"shutdown_timeout": shutdown_timeout},
        "replicas": {"listen": replica_listen, "peers": list(peers) or None},
    }
    config = _load(config_path, overrides)
    from vllm_gateway.process.supervisor import serve as serve_config

    # SIGHUP reloads from the same sources: the file, the environment, these options.
    sys.exit(serve_config(config, lambda: _reload(config_path, overrides)))


def _reload(config_path: str | None, overrides: dict[str, Any]) -> GatewayConfig:
    from vllm_gateway.app import app_config_problems

    return load_config(config_path, overrides=overrides, checks=app_config_problems)


@main.command("check-config", context_settings=CONTEXT)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="TOML configuration file. Env: VLLM_GATEWAY_CONFIG.",
)
@click.option(
    "--reference",
    is_flag=True,
    help="Print the reference of every setting instead (Markdown: key, type, default, "
    "unit, flag, environment name, meaning).",
)
def check_config(config_path: str | None, reference: bool) -> None:
    """Validate the configuration (file + environment) and print it as the gateway sees it.

    Exits 1 with one line per mistake when it is invalid, like `nginx -t`; every mistake is
    listed at once.
    """
    from vllm_gateway.config.load import effective_toml, worker_url_note

    if reference:
        from vllm_gateway.config.docs import render_reference

        click.echo(render_reference(), nl=False)
        return

    config = _load(config_path, {})
    for i, spec in enumerate(config.workers):
        if note := worker_url_note(spec.url):
            click.echo(f"warning: workers[{i}].url: {note}", err=True)
    click.echo(effective_toml(config), nl=False)


@main.command("hash-key", context_settings=CONTEXT)
@click.option(
    "--name", default="my-client", show_default=True, metavar="NAME", help="The key's name."
)
@click.option("--generate", is_flag=True, help="Make a new random key (printed once, to stderr).")
def hash_key_command(name: str, generate: bool) -> None:
    """Print the configuration table of a client API key: its SHA-256, never the key.

    The key is read from standard input (a hidden prompt on a terminal), so it never
    shows on a command line or in shell history. With --generate, a new random key goes to
    stderr and the table to stdout, so `... --generate >> gateway.toml` stores only the hash.

    \b
      vllm-gateway hash-key --name team-a              # asks for the key
      printf %s "$KEY" | vllm-gateway hash-key         # reads it from a pipe
      vllm-gateway hash-key --generate --name team-a   # makes a new one
    """
    from vllm_gateway.http.keys import generate_key, hash_key

    if not name or any(c in name for c in '"\\\n\r'):
        raise click.BadParameter("use letters, digits, dashes or dots", param_hint="--name")
    if generate:
        key = generate_key()
        click.echo(f"API key for {name} (give it to the client; it is not stored): {key}", err=True)
    elif sys.stdin.isatty():
        key = click.prompt("API key", hide_input=True)
    else:
        key = sys.stdin.read().strip()
    if not key:
        raise click.ClickException("no key given on standard input")
    click.echo(f'[auth.keys."{name}"]\nsha256 = "{hash_key(key)}"')
    click.echo("# max_concurrent = 0        # requests in flight at once; 0: no limit")
    click.echo("# requests_per_minute = 0   # 0: no limit")


@main.command(context_settings=CONTEXT)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="TOML configuration file, as for serve. Env: VLLM_GATEWAY_CONFIG.",
)
@click.option("--host", help="Address to listen on.  [default: 127.0.0.1]")
@click.option("--port", type=int, help="Gateway port.  [default: 8000]")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="warning",
    show_default=True,
    help="Lowest level logged (the demo is quiet by default).",
)
def demo(config_path: str | None, host: str | None, port: int | None, log_level: str) -> None:
    """Start two fake vLLM workers and a gateway in front of them (no GPU needed).

    The gateway reads the settings serve reads (--config, VLLM_GATEWAY_* variables, these
    options), with the fake workers added; without an admin.token, one is made for the
    demo. Prints ready-to-paste commands: curl, chat, Python, and draining a worker.
    Ctrl-C stops everything.
    """
    from vllm_gateway.cli.demo import run_demo

    run_demo(_load(config_path, {"host": host, "port": port}), log_level)


@main.command(context_settings=CONTEXT)
@click.option(
    "--gateway",
    default="http://127.0.0.1:8000",
    show_default=True,
    metavar="URL",
    help="The gateway's base URL.",
)
@click.option("--model", required=True, metavar="NAME", help="Model to ask.")
@click.option("--max-tokens", type=int, default=None, help="Longest answer, in tokens.")
@click.argument("prompt")
def chat(gateway: str, model: str, max_tokens: int | None, prompt: str) -> None:
    """Stream the answer to PROMPT to the terminal as it arrives (a smoke test)."""
    from vllm_gateway.cli.chat import stream_chat

    try:
        code = asyncio.run(stream_chat(gateway, model, prompt, max_tokens, sys.stdout))
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


@main.command("fake-worker", context_settings=CONTEXT)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8001, show_default=True, type=int, help="Port to listen on.")
@click.option(
    "--model",
    "models",
    multiple=True,
    default=("fake-model",),
    show_default=True,
    metavar="NAME",
    help="Served model name (repeatable; the first is the base model).",
)
@click.option(
    "--lora", "loras", multiple=True, metavar="NAME", help="A LoRA adapter name (repeatable)."
)
@click.option(
    "--ttft-ms",
    type=float,
    default=20.0,
    show_default=True,
    metavar="MS",
    help="Prefill time before the first token, in milliseconds.",
)
@click.option(
    "--tpot-ms",
    type=float,
    default=10.0,
    show_default=True,
    metavar="MS",
    help="Time per output token, in milliseconds.",
)
@click.option(
    "--max-num-seqs",
    type=int,
    default=64,
    show_default=True,
    help="Requests generated at once; the rest wait (continuous batching).",
)
@click.option(
    "--max-tokens",
    type=int,
    default=16,
    show_default=True,
    help="Answer length when the request gives no max_tokens.",
)
@click.option(
    "--fault",
    default=None,
    metavar="NAME[=PARAM]",
    help="A fault applied to every request: hang, stall_headers=S, "
    "stall_midstream=K, reset_midstream=K, close_midstream=K, status=CODE, drip=MS, "
    "malformed_sse, huge_event=BYTES. Per request: header X-Fake-Fault.",
)
@click.option("--api-key", default=None, help="Require this bearer token, like vLLM --api-key.")
@click.option(
    "--legacy-metrics",
    is_flag=True,
    default=False,
    help="Report vllm:gpu_cache_usage_perc (vLLM < 0.8) instead of kv_cache_usage_perc.",
)
@cache_options
def fake_worker(
    host: str,
    port: int,
    models: tuple[str, ...],
    loras: tuple[str, ...],
    ttft_ms: float,
    tpot_ms: float,
    max_num_seqs: int,
    max_tokens: int,
    fault: str | None,
    api_key: str | None,
    legacy_metrics: bool,
    **cache: Any,
) -> None:
    """Run a stand-in for a vLLM server: same wire format, /metrics, batching, prefix
    cache, faults.

    PORT 0 picks a free port; the line printed at start says which.
    """
    from vllm_gateway.fake_worker import FakeWorkerConfig, run_forever
    from vllm_gateway.http.server import new_event_loop

    try:
        config = FakeWorkerConfig(
            models=models,
            lora_adapters=loras,
            ttft_ms=ttft_ms,
            tpot_ms=tpot_ms,
            max_num_seqs=max_num_seqs,
            max_tokens=max_tokens,
            fault=fault,
            api_key=api_key,
            legacy_metrics=legacy_metrics,
            **cache_settings(**cache),
        )
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run_forever(config, host, port))


for _command in COMMANDS:  # register, workers ..., rollout
    main.add_command(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
