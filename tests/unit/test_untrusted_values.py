"""Untrusted values, one function at a time: what workers report, what a config file says.

A worker's /v1/models ids and /metrics gauges, a config file's numbers, a reload that
would take everything away, a client path that reaches LoRA updates, the breaker's rule
for the last worker: each pinned with a table, and with hypothesis where the input space
is wide (bounded: a few dozen examples, well under a second each).
"""

from __future__ import annotations

import json
import math
import random

import click
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_gateway.cli.params import FINITE
from vllm_gateway.config.gateway import (
    AdminConfig,
    ApiKeyConfig,
    AuthConfig,
    DiscoveryConfig,
    DispatchConfig,
    DnsName,
    GatewayConfig,
    KubernetesService,
    WorkerSpec,
)
from vllm_gateway.config.load import load_config
from vllm_gateway.config.settings import MAX_SECONDS, MAX_WEIGHT
from vllm_gateway.control.body import get_number
from vllm_gateway.dispatch.aliases import check_alias
from vllm_gateway.dispatch.policies import make_policy
from vllm_gateway.dispatch.request_info import RequestInfo
from vllm_gateway.errors import BadRequest, ConfigError
from vllm_gateway.fleet.demand import MAX_DESIRED, desired_workers
from vllm_gateway.fleet.health import models_from_page
from vllm_gateway.fleet.scrape import MAX_REQUESTS, MetricNames, page_lines, parse_metrics
from vllm_gateway.http.routes import is_lora_update
from vllm_gateway.process.reload import check_reload
from vllm_gateway.workers import Worker

pytestmark = pytest.mark.timeout(60)

BOUNDED = settings(max_examples=50, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
NAMES = MetricNames(
    ["vllm:num_requests_running"], ["vllm:num_requests_waiting"], ["vllm:kv_cache_usage_perc"]
)


# --- /v1/models -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page", "models"),
    [
        (b'{"data":[{"id":"m"},{"id":"lora-1"}]}', ["m", "lora-1"]),
        (b'{"data":[{"id":"m"},{"object":"model"},3]}', ["m"]),  # entries without an id
        (b'{"data":[]}', []),
    ],
)
def test_a_model_page_gives_its_ids(page, models):
    assert models_from_page(page) == models


@pytest.mark.parametrize(
    "page",
    [
        b'{"data":[{"id":"m"},{"id":null}]}',
        b'{"data":[{"id":1}]}',
        b'{"data":[{"id":["x"]}]}',
        b'{"data":[{"id":""}]}',
        b'{"data":[{"id":"a\\nb"}]}',
        b'{"data":{"id":"m"}}',
        b"[1, 2]",
        b"not json",
        b'{"data":[' + b'{"id":"m"},' * 1000 + b'{"id":"m"}]}',
    ],
)
def test_a_bad_model_page_is_refused_whole(page):
    with pytest.raises(ValueError):
        models_from_page(page)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)


@BOUNDED
@given(ids=st.lists(json_values, max_size=6))
def test_any_model_page_gives_strings_or_a_refusal(ids):
    """Whatever the ids, the answer is a list of usable names (sortable, hashable) or a
    ValueError: never another exception."""
    page = json.dumps({"data": [{"id": i} for i in ids]}).encode()
    try:
        models = models_from_page(page)
    except ValueError:
        return
    assert all(isinstance(m, str) and m for m in models)
    assert len(sorted(set(models))) <= len(ids)  # sortable and hashable


# --- /metrics ---------------------------------------------------------------------------


def test_gauges_are_clamped():
    page = (
        "vllm:num_requests_running 1e308\n"
        "vllm:num_requests_running 1e308\n"
        "vllm:num_requests_waiting -5\n"
        "vllm:kv_cache_usage_perc 7\n"
    )
    stats = parse_metrics(page, NAMES)
    assert stats is not None
    assert (stats.running, stats.waiting, stats.kv_cache_usage) == (MAX_REQUESTS, 0.0, 1.0)


gauge_values = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    ["nan", "+Inf", "-Inf", "1e309", "-0", "0x10", "１"]
)


@BOUNDED
@given(
    running=st.lists(gauge_values, min_size=1, max_size=5),
    waiting=st.lists(gauge_values, min_size=1, max_size=5),
    kv=st.lists(gauge_values, max_size=5),
)
def test_any_gauge_values_give_bounded_stats(running, waiting, kv):
    lines = [f"vllm:num_requests_running {v}" for v in running]
    lines += [f"vllm:num_requests_waiting {v}" for v in waiting]
    lines += [f"vllm:kv_cache_usage_perc {v}" for v in kv]
    stats = parse_metrics("\n".join(lines), NAMES)
    if stats is None:
        return
    assert 0 <= stats.running <= MAX_REQUESTS and 0 <= stats.waiting <= MAX_REQUESTS
    assert stats.kv_cache_usage is None or 0 <= stats.kv_cache_usage <= 1
    demand = stats.running + stats.waiting
    got = desired_workers(demand, 1, target=0.1, down_fraction=0.5, minimum=0, maximum=None)
    assert 0 <= got <= MAX_DESIRED


@pytest.mark.parametrize("demand", [math.inf, 1e308, math.nan, -1.0])
@pytest.mark.parametrize("target", [1e-300, 0.1, 10.0])
def test_desired_workers_never_overflows(demand, target):
    got = desired_workers(demand, 2, target=target, down_fraction=0.5, minimum=1, maximum=None)
    assert 1 <= got <= MAX_DESIRED


# --- config values -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "toml",
    [
        "[timeouts]\nfirst_byte = nan\n",
        "[timeouts]\nidle = inf\n",
        "[timeouts]\ntotal = -inf\n",
        "[probe]\ninterval = nan\n",
        "[dispatch]\nstop_waiting = nan\n",
        '[[workers]]\nurl = "http://a:1"\nweight = nan\n',
        "[timeouts]\nidle = 1e300\n",
    ],
)
def test_non_finite_or_huge_numbers_are_refused(tmp_path, toml):
    path = tmp_path / "gateway.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path, env={})
    assert "finite" in str(e.value) or "at most" in str(e.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e400"])
def test_non_finite_numbers_from_the_environment_are_refused(value):
    with pytest.raises(ConfigError):
        load_config(None, env={"VLLM_GATEWAY_TIMEOUTS_FIRST_BYTE": value})


@BOUNDED
@given(
    section=st.sampled_from(["timeouts", "probe", "scrape", "retry", "breaker", "dispatch"]),
    value=st.floats() | st.integers(min_value=-(10**30), max_value=10**30) | st.text(max_size=8),
)
def test_any_number_either_loads_finite_and_bounded_or_is_refused(section, value):
    """Whatever goes into a numeric setting, a loaded config holds only finite numbers,
    durations under MAX_SECONDS; anything else is one ConfigError."""
    import dataclasses

    fields = [
        f.name
        for f in dataclasses.fields(getattr(GatewayConfig(), section))
        if f.type in ("float", "int")
    ]
    raw = {section: {name: value for name in fields}}
    try:
        config = load_config(None, env={}, overrides=raw)
    except ConfigError:
        return
    for f in dataclasses.fields(getattr(config, section)):
        number = getattr(getattr(config, section), f.name)
        if f.type in ("float", "int"):
            assert math.isfinite(number)
            if f.metadata.get("unit") == "seconds":
                assert number <= MAX_SECONDS


# --- reload guards --------------------------------------------------------------------------

FULL = GatewayConfig(
    workers=(WorkerSpec(url="http://a:1"),),
    auth=AuthConfig(keys={"k": ApiKeyConfig(sha256="0" * 64)}),
    admin=AdminConfig(token="t"),
)


def test_an_empty_config_on_reload_is_refused():
    problems = check_reload(FULL, GatewayConfig())
    assert len(problems) == 3
    assert [p.split(":")[0] for p in problems] == ["workers", "auth.keys", "admin.token"]


def test_an_empty_config_on_reload_is_refused_when_discovery_found_the_workers():
    """No static worker, every worker discovered (DNS, Kubernetes): an emptied file would
    stop discovery and retire the whole fleet all the same."""
    for discovery in (
        DiscoveryConfig(dns=(DnsName(url="http://vllm.svc:8000"),)),
        DiscoveryConfig(kubernetes=(KubernetesService(service="vllm"),)),
    ):
        problems = check_reload(GatewayConfig(discovery=discovery), GatewayConfig())
        assert [p.split(":")[0] for p in problems] == ["workers"], problems
        assert "reload.allow_no_workers" in problems[0]
        # Keeping one source of workers (or saying it is meant) is a reload like any other.
        assert check_reload(GatewayConfig(discovery=discovery), FULL) == []


def test_a_reload_that_means_it_may_empty_the_fleet(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(
        "[reload]\nallow_no_workers = true\nallow_no_keys = true\nallow_no_admin = true\n"
    )
    assert check_reload(FULL, load_config(path, env={})) == []
    assert check_reload(GatewayConfig(), GatewayConfig()) == []  # nothing to take away


# --- client paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "refused"),
    [
        ("/v1/load_lora_adapter", True),
        ("/v1/unload_lora_adapter", True),
        ("/v1/load_lora_adapter?x=1", True),
        ("/v1//load_lora_adapter/", True),
        ("/V1/Load_LoRA_Adapter", True),
        ("/v1/completions", False),
        ("/v1/load_lora_adapters", False),
    ],
)
def test_lora_update_paths(target, refused):
    assert is_lora_update(target) is refused


@BOUNDED
@given(
    lines=st.lists(
        st.text(
            alphabet=st.characters(
                # a page is bytes: no lone surrogates (they have no UTF-8); no line breaks
                blacklist_categories=("Cs",),
                blacklist_characters="\r\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
            ),
            max_size=40,
        ),
        max_size=30,
    ),
    piece=st.integers(min_value=1, max_value=64),
)
def test_a_page_read_in_pieces_has_the_same_lines(lines, piece):
    page = "\n".join(lines).encode()
    assert list(page_lines(page, piece)) == page.decode().splitlines()


# --- weights ------------------------------------------------------------------------------


def test_a_worker_weight_past_the_maximum_is_refused_in_the_config(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text(f'[[workers]]\nurl = "http://a:1"\nweight = {MAX_WEIGHT * 10:g}\n')
    with pytest.raises(ConfigError, match="at most"):
        load_config(path, env={})


@pytest.mark.parametrize("weight", [1e308, MAX_WEIGHT * 2, -1.0, True, "2"])
def test_an_alias_weight_past_the_bounds_is_refused(weight):
    problem = check_alias("llama", {"llama-v1": 1.0, "llama-v2": weight})
    assert problem is not None and "weight" in problem


def test_an_alias_weight_at_the_maximum_is_taken():
    assert check_alias("llama", {"llama-v1": 1.0, "llama-v2": MAX_WEIGHT}) is None


@pytest.mark.parametrize(
    ("doc", "ok"),
    [
        ({"weight": MAX_WEIGHT}, True),
        ({"weight": 0}, True),
        ({"weight": 1e308}, False),
        ({"weight": MAX_WEIGHT + 1}, False),
        ({"weight": -0.5}, False),
        ({"weight": "3"}, False),
        ({"weight": False}, False),
    ],
)
def test_an_admin_weight_is_a_number_within_bounds(doc, ok):
    if ok:
        assert get_number(doc, "weight", None, maximum=MAX_WEIGHT) == float(doc["weight"])
    else:
        with pytest.raises(BadRequest) as e:
            get_number(doc, "weight", None, maximum=MAX_WEIGHT)
        assert e.value.param == "weight"


@pytest.mark.parametrize("weights", [[1e308, 1.0, 1.0], [1e308, 1e308, 1.0], [math.inf, 1.0, 1.0]])
def test_the_preamble_plan_survives_any_weights(weights):
    """Weights are bounded where they come in; the plan's arithmetic holds anyway (a worker
    weighted 1e308 once overflowed it, failing every request with a popular preamble)."""
    ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",), weight=x) for i, x in enumerate(weights)]
    p = make_policy("cache_aware", random.Random(1), DispatchConfig())
    for i in range(300):
        system = {"role": "system", "content": f"system prompt {i % 3} " * 70}
        body = {"model": "m", "messages": [system, {"role": "user", "content": f"u{i}"}]}
        assert p.select(ws, RequestInfo("/v1/chat/completions", b"", "m", True, "r", {}, body))


@pytest.mark.parametrize("policy", ["session", "prefix"])
@pytest.mark.parametrize("weight", [1e-310, 5e-324, MAX_WEIGHT])
def test_affinity_policies_take_any_weight_in_bounds(policy, weight):
    """A weight of 1e-310 is in bounds (above 0); divided into the load it once made the
    load per unit of weight infinite, and the bound's ceil raised OverflowError."""
    ws = [Worker(f"http://10.0.0.{i}:8000", models=("m",), weight=weight) for i in range(3)]
    for i, w in enumerate(ws):
        w.inflight = 5 * i
    p = make_policy(policy, random.Random(1), DispatchConfig())
    for i in range(20):
        body = {"model": "m", "messages": [{"role": "user", "content": f"u{i}"}]}
        info = RequestInfo("/v1/chat/completions", b"", "m", True, f"r{i}", {}, body)
        assert p.select(ws, info) in ws


def test_a_null_number_is_refused_where_null_is_not_missing_and_minus_zero_is_zero():
    with pytest.raises(BadRequest):
        get_number({"weight": None}, "weight", 1.0, null=False)
    assert get_number({}, "weight", 1.0, null=False) == 1.0
    assert get_number({"queue_length": None}, "queue_length", None) is None  # (heartbeats)
    zero = get_number({"weight": -0.0}, "weight", None)
    assert zero == 0.0 and math.copysign(1.0, zero) == 1.0


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400", "x"])
def test_the_fleet_verbs_refuse_a_number_json_cannot_carry(value):
    with pytest.raises(click.BadParameter):
        FINITE.convert(value, None, None)
    assert FINITE.convert("2.5", None, None) == 2.5
