"""The fleet-control sections of the gateway's settings: the circuit breaker, the admin API,
registration, autoscaling, DNS and Kubernetes discovery (docs/fleet.md explains each).

Declared like every other section (config.py holds the rest, the whole `GatewayConfig` and
its loading): once, with default, unit and help, so the loader, the validator and the
generated docs/configuration.md read the same declarations.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_gateway.config.settings import setting


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """The passive circuit breaker: stop sending to a worker whose requests keep failing."""

    failures: int = setting(
        5,
        "Failed requests in a row (connect error, 5xx answer, broken or timed-out relay) "
        "that open a worker's circuit. 0 disables the breaker.",
        minimum=0,
    )
    open_seconds: float = setting(
        10.0,
        "How long an open circuit sends nothing before one trial request (half-open).",
        unit="seconds",
        minimum=0.01,
    )


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin API under /admin/ (workers, drain, aliases, scale signals)."""

    token: str = setting(
        "",
        "Bearer token the admin API requires. Empty: the admin API refuses every request.",
        secret=True,
    )
    drain_timeout: float = setting(
        600.0,
        "Longest a drain that waits for the worker to go idle waits, unless the request "
        "gives its own timeout.",
        unit="seconds",
        minimum=0.0,
    )


@dataclass(frozen=True, slots=True)
class ReloadConfig:
    """What a reload may take away. A truncated or emptied file is valid TOML that would
    remove every static worker, open the API and close the admin API, so each of those
    is refused on reload unless the new file says it is meant."""

    allow_no_workers: bool = setting(
        False,
        "Let a reload remove the last of the config file's workers and discovery tables "
        "(no `workers`, no `[[discovery.*]]`).",
    )
    allow_no_keys: bool = setting(
        False, "Let a reload remove the last client API key (the API opens to everyone)."
    )
    allow_no_admin: bool = setting(
        False, "Let a reload remove the admin token (the admin API turns off)."
    )


# Loopback and private networks (RFC 1918, RFC 4193). Not link-local: 169.254.169.254 is
# the cloud metadata service, the classic target of a request-forgery attack.
PRIVATE_NETWORKS = (
    "127.0.0.0/8",
    "::1/128",
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "fc00::/7",
)


@dataclass(frozen=True, slots=True)
class RegistrationConfig:
    """Workers joining by themselves: FastChat's /register_worker and heartbeats."""

    enabled: bool = setting(
        True, "Serve /register_worker, /receive_heart_beat and the other registration paths."
    )
    token: str = setting(
        "",
        "Bearer token a registering worker (or `vllm-gateway register`) must send. "
        "Empty: no token needed, but while the gateway listens beyond loopback only "
        "loopback clients may register (see open_without_token).",
        secret=True,
    )
    open_without_token: bool = setting(
        False,
        "Without a token, accept registrations from any client even when the gateway "
        "listens beyond loopback (anyone who reaches the port may then add a worker).",
    )
    allowed_networks: tuple[str, ...] = setting(
        PRIVATE_NETWORKS,
        "Networks (CIDR) a registered worker URL may point into. A host name must resolve "
        "into them, unless it is listed in allowed_hosts. Default: loopback and private.",
    )
    allowed_hosts: tuple[str, ...] = setting(
        (),
        "Host names accepted as registered workers without resolving them; `*.example` "
        "accepts every name under example.",
    )
    heartbeat_expiry: float = setting(
        90.0,
        "A registered worker that sent no heartbeat for this long is removed (FastChat's default).",
        unit="seconds",
        minimum=0.1,
    )


@dataclass(frozen=True, slots=True)
class ScaleRule:
    """How the autoscaler treats one model: a `[autoscale.models."NAME"]` table."""

    min_workers: int = setting(
        1,
        "Fewest workers the autoscaler keeps for the model. 0: scale from zero: the model "
        "is known with no worker, and its requests wait in the admission queue "
        "(`dispatch.max_queued`, `dispatch.max_queue_wait`) while one starts.",
        minimum=0,
    )
    max_workers: int = setting(4, "Most workers the autoscaler starts for the model.", minimum=1)
    target_per_worker: float = setting(
        0.0,
        "Demand one worker should carry; 0: `autoscale.target_per_worker`.",
        unit="requests",
        minimum=0.0,
    )
    scale_up_command: str = setting(
        "",
        "Shell command that starts one more worker, e.g. `systemctl start vllm@{index}`; "
        "{model}, {index} (the worker count after it) and {count} (before it) are filled in.",
    )
    scale_down_command: str = setting(
        "",
        "Shell command that stops one worker gracefully (its register agent drains it), "
        "e.g. `systemctl stop vllm@{index}`; {index} is the worker count before it.",
    )


@dataclass(frozen=True, slots=True)
class AutoscaleConfig:
    """Per-model demand, the desired worker count, and optional scale commands."""

    enabled: bool = setting(
        False,
        "Run the models' scale commands (in process 0 only). Off: demand and desired "
        "counts are still computed, for /admin/scale and /metrics (KEDA, an HPA).",
    )
    dry_run: bool = setting(False, "Log the scale commands instead of running them.")
    interval: float = setting(
        5.0, "Time between two evaluations of every model.", unit="seconds", minimum=0.05
    )
    target_per_worker: float = setting(
        32.0,
        "Demand (requests running and waiting in vLLM or in flight, plus those queued in "
        "the gateway) one worker should carry: desired workers = ceil(demand / this).",
        unit="requests",
        minimum=0.1,
    )
    scale_down_below: float = setting(
        0.7,
        "Hysteresis: a worker is taken away only when the demand fits on one fewer worker "
        "at this fraction of target_per_worker.",
        minimum=0.05,
        maximum=1.0,
    )
    queue_wait_up: float = setting(
        5.0,
        "A request waiting this long in the admission queue asks for one more worker, "
        "whatever the counts say. 0: off.",
        unit="seconds",
        minimum=0.0,
    )
    cooldown: float = setting(
        60.0,
        "After a scale command, no other one for that model for this long.",
        unit="seconds",
        minimum=0.0,
    )
    scale_up_window: float = setting(
        15.0,
        "Scale up only to the lowest desired count seen over this window, so one noisy "
        "reading (a burst between two scrapes) does not start a worker.",
        unit="seconds",
        minimum=0.0,
    )
    scale_down_window: float = setting(
        300.0,
        "Scale down only to the highest desired count seen over this window (as an HPA's "
        "stabilization window), so a lull does not flap the fleet.",
        unit="seconds",
        minimum=0.0,
    )
    startup_grace: float = setting(
        600.0,
        "Workers a scale-up command started count as present for this long while they "
        "load and register.",
        unit="seconds",
        minimum=0.0,
    )
    command_timeout: float = setting(
        120.0, "Longest a scale command may run.", unit="seconds", minimum=0.1
    )
    # setting() turns a dict default into a default_factory, so no instance shares it.
    models: dict[str, ScaleRule] = setting(  # noqa: RUF009
        {}, 'Per-model rules: `[autoscale.models."NAME"]` tables, keyed by model name.'
    )

    def scaled_from_zero(self) -> frozenset[str]:
        """Models whose rule lets them have no worker: their requests wait for one."""
        return frozenset(m for m, rule in self.models.items() if rule.min_workers == 0)


@dataclass(frozen=True, slots=True)
class DnsName:
    """A DNS name whose addresses are workers: a `[[discovery.dns]]` table."""

    url: str = setting(
        "",
        "Worker URL with a host name, e.g. http://vllm.default.svc.cluster.local:8000 (a "
        "Kubernetes headless Service): every address it resolves to is a worker.",
    )
    family: str = setting("any", "Address family to use.", choices=("any", "ipv4", "ipv6"))
    models: tuple[str, ...] = setting(
        (), "Model names pinned for these workers. Empty: learned from their /v1/models."
    )


@dataclass(frozen=True, slots=True)
class KubernetesService:
    """A Service whose ready endpoints are workers: a `[[discovery.kubernetes]]` table."""

    service: str = setting(
        "",
        "Name of the Service: its EndpointSlices (label kubernetes.io/service-name) are "
        "listed, then watched.",
    )
    namespace: str = setting(
        "", "The Service's namespace. Empty: the gateway pod's own, else the context's."
    )
    port: str = setting(
        "",
        "Name of the Service port the workers serve on (e.g. http). Empty: the slices' only port.",
    )
    scheme: str = setting("http", "Scheme of the worker URLs.", choices=("http", "https"))
    models: tuple[str, ...] = setting(
        (), "Model names pinned for these workers. Empty: learned from their /v1/models."
    )
    kubeconfig: str = setting(
        "",
        "Path of a kubeconfig file (its current context: server, CA, token or client "
        "certificate). Empty: the pod's service account (token and CA under "
        "/var/run/secrets/kubernetes.io/serviceaccount).",
    )


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Workers found outside the gateway: DNS names re-resolved on a period, Kubernetes
    Services' EndpointSlices watched."""

    interval: float = setting(
        10.0, "Time between two resolutions of each name.", unit="seconds", minimum=0.05
    )
    dns: tuple[DnsName, ...] = setting(
        (),
        "DNS names that resolve to workers: `[[discovery.dns]]` tables; URLs, "
        "comma-separated, in the environment.",
    )
    kubernetes: tuple[KubernetesService, ...] = setting(
        (),
        "Kubernetes Services whose EndpointSlices list workers: `[[discovery.kubernetes]]` "
        "tables (TOML only). A ready endpoint joins, a terminating one is drained at once, "
        "a deleted one is removed when idle (docs/fleet.md).",
    )


# A DNS-1123 label: what a Service and a namespace are named.
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def check_discovery(config: DiscoveryConfig) -> list[str]:
    """Mistakes in the [[discovery.kubernetes]] tables that their declarations cannot state."""
    problems = []
    for i, entry in enumerate(config.kubernetes):
        where = f"discovery.kubernetes[{i}]"
        if not _LABEL.fullmatch(entry.service):
            problems.append(f"{where}.service: {entry.service!r} is not a Service name")
        if entry.namespace and not _LABEL.fullmatch(entry.namespace):
            problems.append(f"{where}.namespace: {entry.namespace!r} is not a namespace name")
        if entry.port and not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?", entry.port):
            problems.append(f"{where}.port: {entry.port!r} is not a port name")
    return problems
