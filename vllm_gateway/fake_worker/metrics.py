"""A vLLM-shaped Prometheus /metrics page (V1 engine, v0.8+), with live values.

Written by hand rather than with prometheus_client so the fake stays dependency-free
and cheap; the output follows prometheus_client's text format (labels sorted, floats
as `1.0`, counters with `_total` and `_created`) so a parser written against a real
vLLM page reads this one too.
"""

from __future__ import annotations

import bisect
import gc
import os
import platform
import time
from dataclasses import dataclass

# vLLM V1's bucket bounds, in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


def _num(value: float) -> str:
    """Format like prometheus_client's floatToGoString: 3 -> 3.0, inf -> +Inf, 1.7e+09."""
    if value == float("inf"):
        return "+Inf"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + inner + "}"


class Histogram:
    """A cumulative-on-render Prometheus histogram: per-bucket counts, sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: dict[str, str]) -> list[str]:
        out = []
        cumulative = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            cumulative += count
            out.append(f"{name}_bucket{_labels({**labels, 'le': _num(bound)})} {_num(cumulative)}")
        out.append(f"{name}_count{_labels(labels)} {_num(cumulative)}")
        out.append(f"{name}_sum{_labels(labels)} {_num(self.sum)}")
        return out


@dataclass(frozen=True)
class CacheInfo:
    """The prefix cache as /metrics reports it: its config and its token counters."""

    block_size: int
    num_gpu_blocks: int | None
    queries: int  # prompt tokens looked up
    hits: int  # of which were cached

    def config_labels(self) -> dict[str, str]:
        """vllm:cache_config_info's labels, as strings.

        vLLM puts every CacheConfig field here, and the set changes between versions;
        these are the fields of the V1-shaped page in tests/data. What a reader of the
        page looks for is block_size, num_gpu_blocks and enable_prefix_caching.
        """
        return {
            "block_size": str(self.block_size),
            "cache_dtype": "auto",
            "calculate_kv_scales": "False",
            "enable_prefix_caching": "True",
            "engine": "0",
            "gpu_memory_utilization": "0.9",
            "is_attention_free": "False",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(self.num_gpu_blocks),
            "prefix_caching_hash_algo": "builtin",
            "swap_space": "4",
            "swap_space_bytes": str(4 * 1024**3),
        }


class EngineMetrics:
    """The engine-side numbers a vLLM /metrics page reports, fed by the fake's handlers."""

    def __init__(self, model_name: str, max_loras: int, legacy: bool) -> None:
        self.labels = {"engine": "0", "model_name": model_name}
        self.max_loras = max_loras
        self.legacy = legacy
        self.created = time.time()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def render(
        self,
        running: int,
        waiting: int,
        usage: float,
        cache: CacheInfo,
        running_loras: list[str],
        waiting_loras: list[str],
    ) -> str:
        """The whole page, with scheduler and cache numbers as they are right now.

        `usage` is the KV-cache usage gauge's value (0..1).
        """
        page = _Page(self.labels, self.created)
        # vLLM sets its info gauge once, at engine start; it comes first on its page.
        page.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
        page.out.append(f"vllm:cache_config_info{_labels(cache.config_labels())} 1.0")
        page.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                   running)  # fmt: skip
        page.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                   waiting)  # fmt: skip
        if self.legacy:
            page.gauge("vllm:gpu_cache_usage_perc",
                       "GPU KV-cache usage. 1 means 100 percent usage.", usage)  # fmt: skip
        else:
            page.gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                       usage)  # fmt: skip
            # V0 engines (the legacy page) reported a hit-rate gauge instead.
            page.counter("vllm:prefix_cache_queries",
                         "Prefix cache queries, in terms of number of queried tokens.",
                         {"": cache.queries})  # fmt: skip
            page.counter("vllm:prefix_cache_hits",
                         "Prefix cache hits, in terms of number of cached tokens.",
                         {"": cache.hits})  # fmt: skip
        page.family("vllm:lora_requests_info", "gauge", "Running stats on lora requests.")
        lora_labels = {
            "max_lora": str(self.max_loras),
            "running_lora_adapters": ",".join(running_loras),
            "waiting_lora_adapters": ",".join(waiting_loras),
        }
        page.out.append(f"vllm:lora_requests_info{_labels(lora_labels)} {_num(time.time())}")
        page.counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                     {"": 0})  # fmt: skip
        page.counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                     {"": self.prompt_tokens})  # fmt: skip
        page.counter("vllm:generation_tokens", "Number of generation tokens processed.",
                     {"": self.generation_tokens})  # fmt: skip
        page.counter("vllm:request_success", "Count of successfully processed requests.",
                     dict(self.finished), label="finished_reason")  # fmt: skip
        page.histogram("vllm:time_to_first_token_seconds",
                       "Histogram of time to first token in seconds.", self.ttft)  # fmt: skip
        page.histogram("vllm:time_per_output_token_seconds",
                       "Histogram of time per output token in seconds.", self.tpot)  # fmt: skip
        page.histogram("vllm:e2e_request_latency_seconds",
                       "Histogram of e2e request latency in seconds.", self.e2e)  # fmt: skip
        page.out.append("")
        return "\n".join(page.out)


class _Page:
    """Writes metric families in prometheus_client's text format, engine labels on each."""

    def __init__(self, labels: dict[str, str], created: float) -> None:
        self.labels = labels
        self.created = created
        self.out: list[str] = _process_lines()

    def family(self, name: str, kind: str, text: str) -> None:
        self.out.append(f"# HELP {name} {text}")
        self.out.append(f"# TYPE {name} {kind}")

    def gauge(self, name: str, text: str, value: float) -> None:
        self.family(name, "gauge", text)
        self.out.append(f"{name}{_labels(self.labels)} {_num(value)}")

    def _created(self, name: str, text: str, label_sets: list[dict[str, str]], when: float) -> None:
        # prometheus_client puts each counter's and histogram's creation time in a
        # gauge family of its own, right after it.
        self.family(f"{name}_created", "gauge", text)
        self.out.extend(f"{name}_created{_labels(ls)} {_num(when)}" for ls in label_sets)

    def counter(self, name: str, text: str, values: dict[str, float], label: str = "") -> None:
        self.family(f"{name}_total", "counter", text)
        label_sets = [{**self.labels, label: key} if label else self.labels for key in values]
        for labels, value in zip(label_sets, values.values(), strict=True):
            self.out.append(f"{name}_total{_labels(labels)} {_num(value)}")
        self._created(name, text, label_sets, self.created)

    def histogram(self, name: str, text: str, hist: Histogram) -> None:
        self.family(name, "histogram", text)
        self.out.extend(hist.lines(name, self.labels))
        self._created(name, text, [self.labels], hist.created)


_START_TIME = time.time()


def _process_lines() -> list[str]:
    """The python_/process_ families prometheus_client puts on every page."""
    out = ["# HELP python_gc_objects_collected_total Objects collected during gc",
           "# TYPE python_gc_objects_collected_total counter"]  # fmt: skip
    for gen, st in enumerate(gc.get_stats()):
        out.append(f'python_gc_objects_collected_total{{generation="{gen}"}} '
                   f"{_num(st['collected'])}")  # fmt: skip
    major, minor, patch = platform.python_version_tuple()
    impl = platform.python_implementation()
    out += ["# HELP python_info Python platform information",
            "# TYPE python_info gauge",
            f'python_info{{implementation="{impl}",major="{major}",minor="{minor}",'
            f'patchlevel="{patch}",version="{platform.python_version()}"}} 1.0']  # fmt: skip
    cpu = os.times()
    out += ["# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
            "# TYPE process_cpu_seconds_total counter",
            f"process_cpu_seconds_total {_num(cpu.user + cpu.system)}",
            "# HELP process_start_time_seconds Start time of the process since unix epoch "
            "in seconds.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {_num(round(_START_TIME, 2))}"]  # fmt: skip
    return out
