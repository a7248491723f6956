"""The gateway's settings: frozen dataclasses, loaded once from defaults, TOML, env and CLI.

Precedence, lowest first: the defaults written here, the TOML file (`--config`), environment
variables (`VLLM_GATEWAY_*`), then command-line options. Every key is declared once, with
its default, unit and help text: below, or for the fleet-control sections (breaker, admin,
registration, autoscale, discovery) in config/fleet.py, whose names this module exports
too (`[replicas]`: config/replicas.py). The loader, the validator and the generated
configuration reference (docs/configuration.md) all read those declarations, so they
cannot drift apart. Loading and cross-field validation live in config/load.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_gateway.config.fleet import (  # noqa: F401 - re-exported, see above
    PRIVATE_NETWORKS,
    AdminConfig,
    AutoscaleConfig,
    BreakerConfig,
    DiscoveryConfig,
    DnsName,
    KubernetesService,
    RegistrationConfig,
    ReloadConfig,
    ScaleRule,
)
from vllm_gateway.config.replicas import ReplicasConfig
from vllm_gateway.config.settings import MAX_WEIGHT, setting

# --- sections -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """A worker named in the config file (or by `--worker`)."""

    url: str = setting("", "Base URL of the worker's OpenAI server, e.g. http://10.0.0.5:8000.")
    models: tuple[str, ...] = setting(
        (),
        "Models this worker serves, known before the gateway first reaches it (a request "
        "for one waits or gets 503 with Retry-After while the worker is out, never 404); "
        "pinned: its /v1/models does not change them. Empty: learned from its /v1/models "
        "and remembered while it is out.",
    )
    weight: float = setting(1.0, "Relative share of traffic.", minimum=0.0, maximum=MAX_WEIGHT)
    max_num_seqs: int = setting(0, "Its batch size (vLLM --max-num-seqs); 0: learned.", minimum=0)


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Cross-origin requests from browser pages, named and defaulted as vLLM's flags
    (`--allowed-origins` ...) and answered as its server answers them (http/cors.py)."""

    allowed_origins: tuple[str, ...] = setting(
        ("*",),
        "Origins (scheme://host[:port]) whose pages may call the gateway; `*`: any. "
        "Empty: none (answers carry no Access-Control-Allow-Origin).",
    )
    allowed_methods: tuple[str, ...] = setting(
        ("*",), "Methods a preflight allows; `*`: DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT."
    )
    allowed_headers: tuple[str, ...] = setting(
        ("*",),
        "Request headers a preflight allows besides the CORS-safelisted ones; `*`: any "
        "(Authorization included).",
    )
    allow_credentials: bool = setting(
        False,
        "Let pages send cookies and HTTP credentials: answers then name the origin "
        "instead of `*` and say Access-Control-Allow-Credentials: true.",
    )


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Structured logging."""

    format: str = setting(
        "auto",
        "Log line format: json, console, or auto (console on a TTY, JSON lines otherwise).",
        choices=("auto", "json", "console"),
        cli="--log-format",
    )
    level: str = setting(
        "info",
        "Lowest level logged.",
        choices=("debug", "info", "warning", "error"),
        cli="--log-level",
    )
    access_log: bool = setting(
        False,
        "Log one JSON line per finished request (request_id, model, worker, status, timings).",
        cli="--access-log",
    )


@dataclass(frozen=True, slots=True)
class TimeoutConfig:
    """Limits on one relay attempt against a worker. 0 disables a limit."""

    connect: float = setting(
        5.0, "Opening a TCP connection to a worker.", unit="seconds", minimum=0.0
    )
    first_byte: float = setting(
        600.0,
        "From sending the request to the worker's response headers. A non-streaming "
        "answer arrives whole, so this bounds a whole generation.",
        unit="seconds",
        minimum=0.0,
    )
    idle: float = setting(
        300.0,
        "Longest one chunk of a response body may take: to come from the worker, and to go "
        "out to the client (a client that stops reading is let go after this long).",
        unit="seconds",
        minimum=0.0,
    )
    total: float = setting(
        0.0, "Whole request, from dispatch to the last byte.", unit="seconds", minimum=0.0
    )


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Limits on what one client connection may take and send (slow or oversized clients)."""

    header_timeout: float = setting(
        60.0,
        "Longest a client may take to send a request's line and headers, counted from the "
        "connection's start or its previous answer; the connection is then closed. An idle "
        "keep-alive connection is closed after this long too.",
        unit="seconds",
        minimum=0.1,
    )
    body_timeout: float = setting(
        60.0,
        "Longest a client may take to send a request body; a slower one gets 408. Also how "
        "long the rest of a body answered early (401, 413) is read and dropped before the "
        "connection closes.",
        unit="seconds",
        minimum=0.1,
    )
    max_header_bytes: int = setting(
        8190,
        "Longest request line or header line; a longer one gets 431.",
        unit="bytes",
        minimum=1024,
    )
    max_headers: int = setting(128, "Most header lines in one request; more get 431.", minimum=16)
    max_head_bytes: int = setting(
        64 * 1024,
        "Most bytes of one request's line and headers in all; a longer head gets 431 and the "
        "connection is closed. Bounds what a connection holds before its key is checked.",
        unit="bytes",
        minimum=4096,
    )
    max_connections: int = setting(
        20_000,
        "Most open client connections per gateway process (0: no limit); past it a new one "
        "gets 503 and is closed at once.",
        minimum=0,
    )
    front_path: bool = setting(
        True,
        "Serve relay requests with the gateway's own HTTP/1.1 protocol (front.py: about a "
        "third less CPU per request and memory per stream than aiohttp's server); false: "
        "aiohttp's server serves every request. Every other request goes to aiohttp either way.",
    )


@dataclass(frozen=True, slots=True)
class ApiKeyConfig:
    """One client API key, by name: `[auth.keys."NAME"]` (auth.py)."""

    sha256: str = setting(
        "",
        "SHA-256 of the key, in hex (`vllm-gateway hash-key` prints it); the key itself is "
        "never stored.",
        secret=True,
    )
    max_concurrent: int = setting(
        0, "Most requests this key may have in flight at once; 0: no limit.", minimum=0
    )
    requests_per_minute: float = setting(
        0.0,
        "Requests this key may start per minute, on average, with a burst of as many; 0: no limit.",
        unit="requests/minute",
        minimum=0.0,
    )


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Client API keys, and the credentials the gateway presents to workers."""

    # setting() turns a dict default into a default_factory, so no instance shares it.
    keys: dict[str, ApiKeyConfig] = setting(  # noqa: RUF009
        {},
        'Client API keys: `[auth.keys."NAME"]` tables. With none, the OpenAI API is open; '
        "with any, /v1/* and the model endpoints need `Authorization: Bearer <key>`.",
    )
    forward_authorization: bool = setting(
        False,
        "Pass the client's own Authorization header on to the worker (off: it stays at "
        "the gateway). Ignored when worker_api_key is set.",
    )
    worker_api_key: str = setting(
        "",
        "Bearer token sent to every worker (vLLM --api-key) on requests, probes and "
        "scrapes. Empty: none.",
        secret=True,
    )
    lora_updates: bool = setting(
        False,
        "Relay clients' POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off: 403; "
        "any client could otherwise load or unload a worker's adapters).",
    )


@dataclass(frozen=True, slots=True)
class RetryConfig:
    """Trying a request again on another worker. The rule (dispatch.py, docs/reliability.md):
    only when it provably never reached the worker's application, or the worker answered
    503/429; never once the client got a byte."""

    max_attempts: int = setting(
        3, "Workers tried for one request, the first one included.", minimum=1
    )
    backoff: float = setting(
        0.02,
        "Pause before the second attempt; it doubles with each further attempt, "
        "and each pause is drawn between half and all of that (jitter).",
        unit="seconds",
        minimum=0.0,
    )
    backoff_max: float = setting(
        0.5, "Longest pause between two attempts.", unit="seconds", minimum=0.0
    )


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """Background probes of each worker's /health and /v1/models."""

    interval: float = setting(
        5.0, "Time between two probes of one worker.", unit="seconds", minimum=0.05
    )
    timeout: float = setting(2.0, "Limit on one probe request.", unit="seconds", minimum=0.01)
    healthy_after: int = setting(
        1, "Consecutive passing probes that make a worker ready.", minimum=1
    )
    unhealthy_after: int = setting(
        2, "Consecutive failing probes that make a worker unhealthy.", minimum=1
    )
    startup_wait: float = setting(
        3.0,
        "At start, how long to wait for the first probe of every worker before serving.",
        unit="seconds",
        minimum=0.0,
    )
    max_models_bytes: int = setting(
        1 << 20,
        "Longest /v1/models (or /health) page read from a worker; a longer one fails the probe.",
        unit="bytes",
        minimum=1024,
        maximum=1 << 30,
    )


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    """Background scrapes of each worker's Prometheus /metrics (its own queue, as it reports).

    Metric names are lists because vLLM renames them between releases: the first name
    present on a worker's page is read.
    """

    interval: float = setting(
        0.25, "Time between two scrapes of one worker.", unit="seconds", minimum=0.02
    )
    timeout: float = setting(1.0, "Limit on one scrape request.", unit="seconds", minimum=0.01)
    max_page_bytes: int = setting(
        4 << 20,
        "Longest /metrics page read from a worker; a longer one fails the scrape.",
        unit="bytes",
        minimum=1024,
        maximum=1 << 30,
    )
    stale_after: float = setting(
        2.0,
        "A snapshot older than this is dropped; dispatch then counts only the gateway's "
        "own in-flight requests to that worker.",
        unit="seconds",
        minimum=0.05,
    )
    running_metrics: tuple[str, ...] = setting(
        ("vllm:num_requests_running",),
        "Gauge of requests in the worker's running batch, summed over engines.",
    )
    waiting_metrics: tuple[str, ...] = setting(
        ("vllm:num_requests_waiting",),
        "Gauge of requests waiting in the worker's own queue, summed over engines.",
    )
    kv_cache_metrics: tuple[str, ...] = setting(
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        "Gauge of KV-cache usage (0..1), averaged over engines; shown, not dispatched on.",
    )


@dataclass(frozen=True, slots=True)
class DispatchConfig:
    """How requests are spread over workers (docs/dispatch.md explains each knob)."""

    stop_waiting: float = setting(
        8.0,
        "Token buckets: a worker reporting this many requests waiting in its own queue "
        "gets no new ones; below it, each request it finishes earns "
        "(1 - waiting / stop_waiting) tokens.",
        unit="requests",
        minimum=1.0,
    )
    max_queued: int = setting(
        1000,
        "Admission queue: requests that may wait in the gateway per model for a worker "
        "with room; one more gets 429 (0: none wait).",
        unit="requests",
        minimum=0,
    )
    max_queue_wait: float = setting(
        30.0,
        "Admission queue: longest wait for a worker with room; then 503 (0: no limit).",
        unit="seconds",
        minimum=0.0,
    )

    load_bound: float = setting(
        1.25,
        "cache_aware, session, prefix: a worker keeps its affine requests only while its load "
        "is under this multiple of its fair share; then the next in line takes them.",
        minimum=1.0,
    )
    prefix_chars: int = setting(
        256,
        "prefix policy: leading characters of the prompt (or of the messages) that pick "
        "the worker, so requests sharing them reuse its prefix cache.",
        unit="characters",
        minimum=1,
    )


@dataclass(frozen=True, slots=True)
class LifecycleConfig:
    """Stopping the running gateway (SIGTERM) gracefully."""

    shutdown_timeout: float = setting(
        30.0,
        "On SIGTERM: how long in-flight requests and streams may take to finish once the "
        "gateway stops accepting connections; the rest are then ended (an SSE error event, "
        "or a 503 before any answer). Keep systemd's TimeoutStopSec above it.",
        unit="seconds",
        minimum=0.0,
        cli="--shutdown-timeout",
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Settings for one model name: a `[models."NAME"]` table."""

    policy: str = setting("", "Dispatch policy for this model; empty: the global `policy`.")


@dataclass(frozen=True, slots=True)
class TelemetryConfig:
    """The gateway's own metrics and status page (changes take effect at restart)."""

    metrics: bool = setting(True, "Serve Prometheus metrics at /metrics.")
    status_page: bool = setting(
        True, "Serve the live status page at / and /dashboard (its data is GET /stats)."
    )


# --- the whole configuration ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway reads at start (and again on reload)."""

    host: str = setting(
        "127.0.0.1",
        "Address to listen on. Loopback by default: say 0.0.0.0 to serve the network.",
        cli="--host",
    )
    port: int = setting(8000, "TCP port to listen on.", minimum=0, maximum=65535, cli="--port")
    policy: str = setting(
        "cache_aware",
        "Dispatch policy used for every model without its own (see docs/dispatch.md).",
        cli="--policy",
    )
    max_body_bytes: int = setting(
        32 * 1024 * 1024,
        "Largest request body accepted; larger ones get 413.",
        unit="bytes",
        minimum=1024,
    )
    processes: int = setting(
        1,
        "Gateway processes serving the port together (SO_REUSEPORT), each with its own "
        "pools, probes and dispatcher; control requests reach all of them, and each tells "
        "the others where cache_aware placed which prompt. One per core is a good start.",
        minimum=1,
        maximum=256,
        cli="--processes",
    )
    workers: tuple[WorkerSpec, ...] = setting(
        (),
        "Static workers: `[[workers]]` tables in TOML; URLs on the command line "
        "(`--worker`, repeatable) or comma-separated in the environment.",
        cli="--worker",
    )
    log: LogConfig = field(default_factory=LogConfig)
    timeouts: TimeoutConfig = field(default_factory=TimeoutConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    cors: CorsConfig = field(default_factory=CorsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    # setting() turns a dict default into a default_factory, so no instance shares it.
    models: dict[str, ModelConfig] = setting(  # noqa: RUF009
        {}, 'Per-model settings: `[models."NAME"]` tables in TOML, keyed by model name.'
    )
    aliases: dict[str, dict[str, float]] = setting(  # noqa: RUF009
        {},
        'Model aliases and weighted splits: `[aliases]` with `llama = { "llama-v1" = 90, '
        '"llama-v2" = 10 }` sends requests for llama to the two versions 90:10 '
        "(the body's model rewritten).",
    )
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    replicas: ReplicasConfig = field(default_factory=ReplicasConfig)
    reload: ReloadConfig = field(default_factory=ReloadConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
