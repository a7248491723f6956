"""The fleet commands of the CLI: `register` (the agent), `workers ...` (admin API), `rollout`.

They talk to a running gateway over HTTP: `workers` and `rollout` through the admin API
(token from --token or VLLM_GATEWAY_ADMIN_TOKEN), `register` through the registration API
(token from --token or VLLM_GATEWAY_REGISTRATION_TOKEN). Options without a value given
fall back to the defaults written once in agent.AgentSettings and rollout.RolloutPlan.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click
import orjson

from vllm_gateway.cli.params import FINITE

if TYPE_CHECKING:  # imported when a command runs, so `vllm-gateway --help` stays quick
    from vllm_gateway.cli.admin_client import AdminClient

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
DEFAULT_GATEWAY = "http://127.0.0.1:8000"

T = TypeVar("T")


def _given(**values: Any) -> dict[str, Any]:
    """The options the user gave (not None), for a dataclass whose defaults fill the rest."""
    return {k: v for k, v in values.items() if v is not None}


def _with_admin(gateway: str, token: str | None, call: Callable[[AdminClient], Awaitable[T]]) -> T:
    """Run `call` with a client of the gateway's admin API; its errors end the command."""
    from vllm_gateway.cli.admin_client import AdminClient, AdminError

    async def go() -> T:
        async with AdminClient(gateway, token) as admin:
            return await call(admin)

    try:
        return asyncio.run(go())
    except AdminError as e:
        raise click.ClickException(f"{gateway}: {e}") from None


def _admin_call(ctx: click.Context, call: Callable[[AdminClient], Awaitable[T]]) -> T:
    """`_with_admin` for the `workers` subcommands (their group holds gateway and token)."""
    return _with_admin(ctx.obj["gateway"], ctx.obj["token"], call)


def _gateway_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option(
        "--token",
        envvar="VLLM_GATEWAY_ADMIN_TOKEN",
        help="The gateway's admin.token.  [env: VLLM_GATEWAY_ADMIN_TOKEN]",
    )(f)
    return click.option(
        "--gateway",
        envvar="VLLM_GATEWAY_URL",
        metavar="URL",
        default=DEFAULT_GATEWAY,
        show_default=True,
        help="The gateway's base URL.  [env: VLLM_GATEWAY_URL]",
    )(f)


# --- register: the agent beside a vLLM server ---------------------------------------------


@click.command("register", context_settings=CONTEXT)
@click.option(
    "--gateway",
    "gateways",
    multiple=True,
    required=True,
    envvar="VLLM_GATEWAY_URL",
    metavar="URL",
    help="A gateway to register with (repeatable; env: space-separated).  [env: VLLM_GATEWAY_URL]",
)
@click.option(
    "--worker",
    required=True,
    envvar="VLLM_GATEWAY_WORKER_URL",
    metavar="URL",
    help="The vLLM server's base URL as the gateway should reach it.  "
    "[env: VLLM_GATEWAY_WORKER_URL]",
)
@click.option(
    "--token",
    envvar="VLLM_GATEWAY_REGISTRATION_TOKEN",
    help="The gateway's registration.token.  [env: VLLM_GATEWAY_REGISTRATION_TOKEN]",
)
@click.option(
    "--worker-api-key",
    envvar="VLLM_API_KEY",
    help="The vLLM server's --api-key, to read its /v1/models.  [env: VLLM_API_KEY]",
)
@click.option(
    "--heartbeat", type=FINITE, metavar="SECONDS", help="Between two heartbeats.  [default: 10]"
)
@click.option(
    "--drain-timeout",
    type=FINITE,
    metavar="SECONDS",
    help="On SIGTERM, longest wait for the worker to go idle.  [default: 600]",
)
@click.option(
    "--startup-timeout",
    type=FINITE,
    metavar="SECONDS",
    help="Longest wait for the worker's first healthy answer; 0: no limit.  [default: 0]",
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "json", "console"]),
    default="auto",
    show_default=True,
    help="Log format.",
)
def register(
    gateways: tuple[str, ...],
    worker: str,
    token: str | None,
    worker_api_key: str | None,
    heartbeat: float | None,
    drain_timeout: float | None,
    startup_timeout: float | None,
    log_format: str,
) -> None:
    """Keep a vLLM server registered with gateways; drain and deregister it on SIGTERM.

    Waits until WORKER answers /health, registers it, heartbeats with its queue length
    (from its /metrics), registers again when a gateway restarted. On SIGTERM or SIGINT it
    asks each gateway to drain the worker, waits until nothing is in flight on it, then
    deregisters it and exits 0. packaging/systemd/vllm-gateway-register@.service runs it.
    """
    from vllm_gateway import log as log_setup
    from vllm_gateway.cli.agent import AgentSettings, run_agent
    from vllm_gateway.config.load import check_worker_url, normalize_url

    for url in (*gateways, worker):
        if problem := check_worker_url(url):
            raise click.BadParameter(problem)
    settings = AgentSettings(
        gateways=tuple(normalize_url(g) for g in gateways),
        worker=normalize_url(worker),
        **_given(
            token=token,
            worker_api_key=worker_api_key,
            heartbeat=heartbeat,
            drain_timeout=drain_timeout,
            startup_timeout=startup_timeout,
        ),
    )
    log_setup.configure(log_format, "info")
    sys.exit(run_agent(settings))


# --- workers: the admin API ---------------------------------------------------------------


@click.group("workers", context_settings=CONTEXT)
@_gateway_options
@click.pass_context
def workers(ctx: click.Context, gateway: str, token: str | None) -> None:
    """List and change a running gateway's workers, aliases and scale signals (admin API)."""
    ctx.obj = {"gateway": gateway.rstrip("/"), "token": token}


def _echo_worker(w: dict[str, Any]) -> None:
    click.echo(
        f"{w['url']}  {w['state']}  circuit={w['circuit']}  inflight={w['inflight']}  "
        f"models={','.join(w['models']) or '-'}"
    )


@workers.command("list", context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print the admin API's JSON.")
@click.pass_context
def list_workers(ctx: click.Context, as_json: bool) -> None:
    """Every worker: state, circuit, in-flight, models, reported load, source."""
    rows = _admin_call(ctx, lambda a: a.workers())
    if as_json:
        click.echo(orjson.dumps(rows, option=orjson.OPT_INDENT_2).decode())
        return
    header = ("URL", "STATE", "CIRCUIT", "INFLIGHT", "RUNNING", "WAITING", "SOURCE", "MODELS")
    table = [header] + [
        (
            w["url"],
            w["state"],
            w["circuit"],
            str(w["inflight"]),
            _num(w.get("running")),
            _num(w.get("waiting")),
            w["source"],
            ",".join(w["models"]) or "-",
        )
        for w in rows
    ]
    _echo_table(table)


def _echo_table(table: list[tuple[str, ...]]) -> None:
    """Rows of cells in aligned columns (the first row is the header)."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    for r in table:
        click.echo("  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip())


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}"


@workers.command(context_settings=CONTEXT)
@click.argument("url")
@click.option(
    "--model", "models", multiple=True, metavar="NAME", help="Pin a model name (repeatable)."
)
@click.option("--weight", type=FINITE, help="Relative share of traffic.  [default: 1]")
@click.pass_context
def add(ctx: click.Context, url: str, models: tuple[str, ...], weight: float | None) -> None:
    """Add the worker at URL (it is probed at once)."""
    answer = _admin_call(ctx, lambda a: a.add(url, list(models), weight))
    click.echo(("added: " if answer["added"] else "already known: "), nl=False)
    _echo_worker(answer["worker"])


@workers.command(context_settings=CONTEXT)
@click.argument("url")
@click.option("--drain", is_flag=True, help="Drain first and wait until idle.")
@click.option(
    "--timeout",
    type=FINITE,
    metavar="SECONDS",
    help="Longest wait for idle.  [default: the gateway's admin.drain_timeout]",
)
@click.pass_context
def remove(ctx: click.Context, url: str, drain: bool, timeout: float | None) -> None:
    """Remove the worker at URL (requests in flight on it finish)."""
    answer = _admin_call(ctx, lambda a: a.remove(url, drain=drain, timeout=timeout))
    click.echo(f"removed: {url}" + ("" if answer["idle"] else " (it was not idle)"))


@workers.command(context_settings=CONTEXT)
@click.argument("url")
@click.option("--wait", is_flag=True, help="Wait until nothing is in flight on it.")
@click.option(
    "--timeout",
    type=FINITE,
    metavar="SECONDS",
    help="Longest wait.  [default: the gateway's admin.drain_timeout]",
)
@click.pass_context
def drain(ctx: click.Context, url: str, wait: bool, timeout: float | None) -> None:
    """Send the worker at URL no new requests; those in flight finish."""
    answer = _admin_call(ctx, lambda a: a.drain(url, wait=wait, timeout=timeout))
    _echo_worker(answer["worker"])
    if wait and not answer["idle"]:
        raise click.ClickException(f"not idle after {answer['waited_seconds']} s")


@workers.command(context_settings=CONTEXT)
@click.argument("url")
@click.pass_context
def undrain(ctx: click.Context, url: str) -> None:
    """Let a drained worker take requests again (after one passing probe)."""
    _echo_worker(_admin_call(ctx, lambda a: a.undrain(url))["worker"])


@workers.command(context_settings=CONTEXT)
@click.argument("url")
@click.argument("weight", type=FINITE)
@click.pass_context
def weight(ctx: click.Context, url: str, weight: float) -> None:
    """Set the worker's relative share of traffic."""
    _echo_worker(_admin_call(ctx, lambda a: a.set_weight(url, weight))["worker"])


@workers.command(context_settings=CONTEXT)
@click.argument("name", required=False)
@click.argument("targets", nargs=-1)
@click.option("--remove", "remove_it", is_flag=True, help="Remove the alias NAME.")
@click.pass_context
def alias(ctx: click.Context, name: str | None, targets: tuple[str, ...], remove_it: bool) -> None:
    """Show aliases, or set NAME to TARGET[=WEIGHT] ... (a weighted split).

    \b
    vllm-gateway workers alias                              # list
    vllm-gateway workers alias llama llama-v1=90 llama-v2=10
    vllm-gateway workers alias llama --remove
    """
    if name is None:
        shown = _admin_call(ctx, lambda a: a.aliases())
    elif remove_it:
        shown = _admin_call(ctx, lambda a: a.remove_alias(name))["aliases"]
    else:
        if not targets:
            raise click.UsageError("give at least one TARGET[=WEIGHT]")
        split: dict[str, float] = {}
        for t in targets:
            model, _, w = t.partition("=")
            try:
                split[model] = float(w) if w else 1.0
            except ValueError:
                raise click.BadParameter(f"{t!r}: the weight must be a number") from None
        shown = _admin_call(ctx, lambda a: a.set_alias(name, split))["aliases"]
    for alias_name, doc in shown.items():
        shares = ", ".join(f"{m} {100 * s:.0f}%" for m, s in doc["targets"].items())
        click.echo(f"{alias_name} -> {shares}  ({doc['source']})")


_SCALE_COLUMNS = (
    ("MODEL", None),
    ("WORKERS", "workers"),
    ("READY", "ready"),
    ("INFLIGHT", "inflight"),
    ("RUNNING", "running"),
    ("WAITING", "waiting"),
    ("QUEUED", "queued"),
    ("DEMAND", "demand"),
    ("DESIRED", "desired"),
    ("RECOMMENDED", "recommended"),
    ("MIN", "min_workers"),
    ("MAX", "max_workers"),
)


@workers.command(context_settings=CONTEXT)
@click.option("--json", "as_json", is_flag=True, help="Print the admin API's JSON.")
@click.pass_context
def scale(ctx: click.Context, as_json: bool) -> None:
    """Per-model demand and desired worker count (the autoscaler's signals), and the last
    scale commands run."""
    doc = _admin_call(ctx, lambda a: a.scale())
    if as_json:
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        return
    mode = "off" if not doc["enabled"] else "dry run" if doc["dry_run"] else "on"
    click.echo(f"autoscaler: {mode}; runs commands: {'yes' if doc['runs_commands'] else 'no'}")
    table: list[tuple[str, ...]] = [tuple(name for name, _ in _SCALE_COLUMNS)]
    for model, m in sorted(doc["models"].items()):
        table.append((model, *(_num(m.get(key)) for _, key in _SCALE_COLUMNS[1:])))
    _echo_table(table)
    if doc["events"]:
        click.echo("")
        events: list[tuple[str, ...]] = [("AT", "MODEL", "DIRECTION", "INDEX", "RESULT", "COMMAND")]
        for e in doc["events"]:
            at = time.strftime("%H:%M:%S", time.localtime(e["at"]))
            events.append(
                (at, e["model"], e["direction"], str(e["index"]), e["result"], e["command"])
            )
        _echo_table(events)


# --- rollout ------------------------------------------------------------------------------


@click.command("rollout", context_settings=CONTEXT)
@_gateway_options
@click.option(
    "--model", required=True, metavar="NAME", help="Replace the workers serving this model."
)
@click.option(
    "--to", "to_model", metavar="NAME", help="The replacements serve this model (a new version)."
)
@click.option(
    "--alias",
    metavar="NAME",
    help="Shift this alias (e.g. what clients ask for) from --model to --to as it goes.",
)
@click.option(
    "--command",
    metavar="COMMAND",
    help="Run after each worker is removed; {url} {host} {port} {index} {model} "
    "{to_model} are filled in, e.g. 'systemctl restart vllm@{index}'.",
)
@click.option(
    "--replacement",
    type=click.Choice(["same", "new"]),
    help="Where the replacement appears: at the same URL (re-added; the default with "
    "--command) or as a new worker that registers itself (the default without).",
)
@click.option(
    "--drain-timeout",
    type=FINITE,
    metavar="SECONDS",
    help="Longest wait for each worker to go idle.  [default: 600]",
)
@click.option(
    "--ready-timeout",
    type=FINITE,
    metavar="SECONDS",
    help="Longest wait for each replacement to be ready.  [default: 900]",
)
@click.option(
    "--poll", type=FINITE, metavar="SECONDS", help="Between looks at the gateway.  [default: 0.5]"
)
def rollout(
    gateway: str,
    token: str | None,
    model: str,
    to_model: str | None,
    alias: str | None,
    command: str | None,
    replacement: str | None,
    drain_timeout: float | None,
    ready_timeout: float | None,
    poll: float | None,
) -> None:
    """Replace the workers of a model one at a time: drain, wait idle, remove, run the
    command or wait for a replacement, shift traffic. Aborts cleanly (exit 1) when a
    replacement does not become ready; the workers not yet replaced keep serving."""
    from vllm_gateway.cli.rollout import Rollout, RolloutPlan

    if alias and not to_model:
        raise click.UsageError("--alias needs --to (the version traffic moves to)")
    plan = RolloutPlan(
        model=model,
        **_given(
            to_model=to_model,
            alias=alias,
            command=command,
            replacement=replacement,
            drain_timeout=drain_timeout,
            ready_timeout=ready_timeout,
            poll=poll,
        ),
    )

    result = _with_admin(gateway, token, lambda admin: Rollout(admin, plan, click.echo).run())
    sys.exit(0 if result.ok else 1)


COMMANDS = (register, workers, rollout)
