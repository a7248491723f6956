"""The fake worker's settings and the grammar of its faults (`NAME` or `NAME=PARAM`)."""

from __future__ import annotations

from dataclasses import dataclass

# Every fault name the fake understands, with the kind of parameter it takes and its
# default. `None` as a default means "forever" for the stalls and "no parameter" for
# the rest. A name outside this table is an error, so a typo in a test fails loudly.
_FAULTS: dict[str, tuple[type[int] | type[float] | None, float | None]] = {
    "hang": (None, None),  # read the request, never answer
    "stall_headers": (float, None),  # seconds before the status line; default forever
    "stall_midstream": (int, 0),  # after K SSE events, stall forever
    "reset_midstream": (int, 0),  # after K SSE events, abort the TCP connection (RST)
    "close_midstream": (int, 0),  # after K SSE events, end the response without [DONE]
    "status": (int, 500),  # answer this HTTP status with an OpenAI error body
    "drip": (float, 10.0),  # write the body a few bytes at a time, this many ms apart
    "malformed_sse": (None, None),  # events that are neither SSE nor JSON
    "huge_event": (int, 256 * 1024),  # one event whose text is this many bytes
}
FAULT_NAMES: tuple[str, ...] = tuple(_FAULTS)

# A header value that switches off the worker-wide fault for one request.
NO_FAULT = "none"


@dataclass(frozen=True)
class Fault:
    """One parsed fault: `name` from FAULT_NAMES and its numeric parameter (or None)."""

    name: str
    param: float | None = None

    def __str__(self) -> str:
        if self.param is None:
            return self.name
        value = int(self.param) if float(self.param).is_integer() else self.param
        return f"{self.name}={value}"


def parse_fault(text: str | None) -> Fault | None:
    """Parse `NAME` or `NAME=PARAM`; None, "" and "none" mean no fault.

    Raises ValueError for an unknown name or a parameter that is not a number.
    """
    if text is None:
        return None
    text = text.strip()
    if not text or text.lower() == NO_FAULT:
        return None
    name, sep, raw = text.partition("=")
    name = name.strip()
    if name not in _FAULTS:
        raise ValueError(f"unknown fault {name!r}; known: {', '.join(FAULT_NAMES)}")
    kind, default = _FAULTS[name]
    if not sep:
        return Fault(name, default)
    if kind is None:
        raise ValueError(f"fault {name!r} takes no parameter")
    try:
        param = kind(raw.strip())
    except ValueError:
        raise ValueError(f"fault {name!r} needs a {kind.__name__} parameter, got {raw!r}") from None
    if param < 0 or (name == "status" and not 400 <= param <= 599):
        raise ValueError(f"fault {name!r} parameter out of range: {raw!r}")
    return Fault(name, param)


@dataclass(frozen=True)
class FakeWorkerConfig:
    """How one fake vLLM server behaves. Times are in milliseconds."""

    # Served model names; the first is the base model (vLLM's --served-model-name).
    models: tuple[str, ...] = ("fake-model",)
    # Extra names listed in /v1/models with parent = the base model (vLLM's --lora-modules).
    lora_adapters: tuple[str, ...] = ()
    # Prefill time after a request is admitted to the batch, before its first token.
    ttft_ms: float = 20.0
    # Time per output token while running.
    tpot_ms: float = 10.0
    # At most this many requests generate at once; the rest wait FIFO.
    max_num_seqs: int = 64
    # Output length when the request gives no max_tokens.
    max_tokens: int = 16
    # A fault applied to every inference request (see FAULT_NAMES); None for a healthy worker.
    fault: str | None = None
    # Like vLLM --api-key: require "Authorization: Bearer <key>" on /v1/*.
    api_key: str | None = None
    # Expose vllm:gpu_cache_usage_perc (vLLM < 0.10) instead of vllm:kv_cache_usage_perc.
    legacy_metrics: bool = False
    embedding_dim: int = 8
    # Reported in /v1/models and /tokenize; not enforced.
    max_model_len: int = 4096
    # The prefix cache (see prefix_cache.py). Tokens per KV block; vLLM's default is 16.
    block_size: int = 16
    # KV blocks the worker holds (vLLM's num_gpu_blocks). None: no limit, nothing is
    # evicted, and vllm:kv_cache_usage_perc reports the batch's fill (running /
    # max_num_seqs) as the fake always did, since a full batch is what a gateway
    # reading that gauge wants to learn of a worker whose memory is not modelled.
    num_gpu_blocks: int | None = None
    # Admit a request whose prompt's blocks do not fit beside the running requests' (the
    # cache over-commits), where vLLM keeps it waiting until they do (the default).
    kv_overcommit: bool = False
    # Prefill compute per uncached prompt token, on top of ttft_ms, shared by the
    # worker's requests one after another (see prefill.py). 0: a prompt costs nothing.
    prefill_ms_per_token: float = 0.0
    # One JSON line on stderr per generating request as its prefill starts: its id,
    # prompt and uncached tokens, and the seconds since it arrived (engine.py).
    log_requests: bool = False

    def __post_init__(self) -> None:
        # Validate once, here, so a bad config fails at construction, not mid-test.
        if not self.models:
            raise ValueError("models must name at least one model")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.ttft_ms < 0 or self.tpot_ms < 0:
            raise ValueError("ttft_ms and tpot_ms must be >= 0")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError("num_gpu_blocks must be >= 1")
        if self.prefill_ms_per_token < 0:
            raise ValueError("prefill_ms_per_token must be >= 0")
        if self.embedding_dim < 1:
            raise ValueError("embedding_dim must be >= 1")
        parse_fault(self.fault)

    @property
    def base_model(self) -> str:
        return self.models[0]

    @property
    def served_names(self) -> frozenset[str]:
        """Every name a request's `model` may use: served models and LoRA adapters."""
        return frozenset(self.models) | frozenset(self.lora_adapters)
