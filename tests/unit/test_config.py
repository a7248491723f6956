"""Configuration: precedence, coercion, and one clear message per mistake."""

from __future__ import annotations

import pytest

from vllm_gateway.config.gateway import GatewayConfig
from vllm_gateway.config.load import (
    check_worker_url,
    describe,
    load_config,
    normalize_url,
    worker_url_note,
)
from vllm_gateway.errors import ConfigError


def write(tmp_path, text: str):
    p = tmp_path / "gateway.toml"
    p.write_text(text)
    return p


def test_defaults_without_any_source():
    c = load_config(None, env={})
    assert c == GatewayConfig()
    assert c.host == "127.0.0.1" and c.port == 8000 and c.policy == "cache_aware"


def test_file_then_env_then_cli_precedence(tmp_path):
    path = write(
        tmp_path,
        """
port = 9000
policy = "round_robin"
[log]
format = "json"
level = "debug"
[[workers]]
url = "http://10.0.0.5:8000/"
models = ["llama"]
[[workers]]
url = "http://10.0.0.6:8000"
""",
    )
    c = load_config(
        path,
        env={"VLLM_GATEWAY_PORT": "9100", "VLLM_GATEWAY_LOG_LEVEL": "warning"},
        overrides={"port": 9200, "log": {"format": None}},
    )
    assert c.port == 9200  # CLI beats env beats file
    assert c.log.level == "warning"  # env beats file
    assert c.log.format == "json"  # a None override leaves the file's value
    assert c.policy == "round_robin"
    assert [w.url for w in c.workers] == ["http://10.0.0.5:8000/", "http://10.0.0.6:8000"]
    assert c.workers[0].models == ("llama",)


def test_env_workers_are_comma_separated_urls():
    c = load_config(None, env={"VLLM_GATEWAY_WORKERS": "http://a:1, http://b:2"})
    assert [w.url for w in c.workers] == ["http://a:1", "http://b:2"]


def test_config_path_from_env(tmp_path):
    path = write(tmp_path, "port = 7001\n")
    assert load_config(None, env={"VLLM_GATEWAY_CONFIG": str(path)}).port == 7001


def test_every_mistake_is_reported_once_in_one_pass(tmp_path):
    path = write(
        tmp_path,
        """
port = 70000
colour = "blue"
[log]
format = "xml"
[timeouts]
connect = -1
idle = "soon"
[[workers]]
url = "ftp://x"
[[workers]]
url = "http://a:1"
[[workers]]
url = "http://a:1/v1/"
[[discovery.dns]]
url = "vllm.local:8000"
""",
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, env={}, checks=lambda config: ["from above: seen"])
    problems = info.value.problems
    # Unreadable values, range checks, cross checks and the caller's checks: all at once.
    assert "colour: unknown setting" in problems
    assert "timeouts.idle: expected a number, got 'soon'" in problems
    assert any(p.startswith("port: must be at most 65535") for p in problems)
    assert any(p.startswith("log.format: must be one of auto, json, console") for p in problems)
    assert any(p.startswith("timeouts.connect: must be at least 0") for p in problems)
    assert any(p.startswith("workers[0].url:") and "http://" in p for p in problems)
    # A trailing /v1 names the same server: listed twice.
    assert any(p.startswith("workers[2].url:") and "twice" in p for p in problems)
    assert any(p.startswith("discovery.dns[0].url:") and "add http://" in p for p in problems)
    assert problems[-1] == "from above: seen"
    assert len(problems) == 9, problems


@pytest.mark.parametrize(
    ("url", "normalized", "problem"),
    [
        ("http://10.0.0.5:8000", "http://10.0.0.5:8000", None),
        (" http://10.0.0.5:8000/ ", "http://10.0.0.5:8000", None),
        ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000", None),
        ("https://h/v1/", "https://h", None),
        ("10.0.0.5:8000", None, "has no scheme: add http:// (http://10.0.0.5:8000)"),
        ("http://h:8000/v2", None, "has a path (/v2)"),
        ("http://h:8000/v1/models", None, "has a path (/v1/models)"),
        ("http://h:99999", None, "invalid port"),
        ("http://h?x=1", None, "without query or fragment"),
    ],
)
def test_worker_urls_normalized_or_refused(url, normalized, problem):
    found = check_worker_url(url)
    if problem is None:
        assert found is None and normalize_url(url) == normalized
        assert (worker_url_note(url) is not None) == url.strip().rstrip("/").endswith("/v1")
    else:
        assert found is not None and problem in found


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "port = = 1"), env={})
    with pytest.raises(ConfigError, match="No such file"):
        load_config(tmp_path / "missing.toml", env={})


def test_env_booleans_and_numbers():
    c = load_config(
        None, env={"VLLM_GATEWAY_LOG_ACCESS_LOG": "yes", "VLLM_GATEWAY_TIMEOUTS_IDLE": "2.5"}
    )
    assert c.log.access_log is True and c.timeouts.idle == 2.5
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config(None, env={"VLLM_GATEWAY_LOG_ACCESS_LOG": "maybe"})


def test_describe_lists_every_setting_with_env_name():
    rows = {r[0]: r for r in describe()}
    assert rows["port"][5] == "VLLM_GATEWAY_PORT"
    assert rows["log.format"][5] == "VLLM_GATEWAY_LOG_FORMAT"
    assert rows["log.format"][4] == "--log-format"
    assert rows["timeouts.idle"][3] == "seconds"
    assert "workers[].url" in rows


def test_per_model_policy_tables(tmp_path):
    from vllm_gateway.app import check_app_config

    path = write(
        tmp_path,
        """
policy = "power_of_two"
[models."meta-llama/Llama-3.1-8B-Instruct"]
policy = "prefix"
[models.small]
""",
    )
    c = load_config(path, env={})
    assert c.models["meta-llama/Llama-3.1-8B-Instruct"].policy == "prefix"
    assert c.models["small"].policy == ""  # the global policy
    check_app_config(c)
    bad = write(tmp_path, '[models.m]\npolicy = "fastest"\nspeed = 2\n')
    with pytest.raises(ConfigError) as e:
        load_config(bad, env={})
    assert e.value.problems == ["models.m.speed: unknown setting"]
    with pytest.raises(ConfigError) as e:
        check_app_config(load_config(write(tmp_path, '[models.m]\npolicy = "fastest"\n'), env={}))
    assert e.value.problems[0].startswith('models."m".policy: unknown policy')


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("10.0.0.2:8101", ("10.0.0.2", 8101)),
        ("gw-1.internal:0", ("gw-1.internal", 0)),
        ("[::1]:8101", ("::1", 8101)),
        (" host:1 ", ("host", 1)),
        ("host", "not HOST:PORT"),
        (":8101", "not HOST:PORT"),
        ("host:", "port must be a number"),
        ("host:65536", "port must be a number"),
        ("host:-1", "port must be a number"),
        ("::1:8101", "in brackets"),
        ("[::1:8101", "in brackets"),
        ("http://host:8101", "not a URL"),
        ("a/b:1", "an address or a DNS name"),
        ("ho st:1", "an address or a DNS name"),
        ("höst:1", "an address or a DNS name"),
        ("-bad-:1", "an address or a DNS name"),
        ("a..b:1", "an address or a DNS name"),
        ("x" * 64 + ".svc:1", "an address or a DNS name"),
        ("fqdn.example.:1", ("fqdn.example.", 1)),
        ("[abc]:1", "in brackets"),
        ("[::ffff:10.0.0.1]:2", ("::ffff:a00:1", 2)),
        ("h:\u0668\u0661", "port must be a number"),
        ("h:\u00b2", "port must be a number"),
    ],
)
def test_replica_addresses_parse_or_say_what_is_wrong(text, parsed):
    from vllm_gateway.config.replicas import parse_address

    if isinstance(parsed, tuple):
        assert parse_address(text) == parsed
    else:
        with pytest.raises(ValueError, match=parsed):
            parse_address(text)


def test_replicas_need_a_token_and_addresses_that_parse():
    token = "t" * 16
    assert load_config(env={}).replicas.enabled is False
    good = load_config(env={"VLLM_GATEWAY_REPLICAS_PEERS": "a:1,b:2"}, overrides={
        "replicas": {"listen": "0.0.0.0:8101", "token": token}})  # fmt: skip
    assert good.replicas.peers == ("a:1", "b:2") and good.replicas.enabled
    with pytest.raises(ConfigError) as e:
        load_config(env={}, overrides={"replicas": {
            "listen": "nowhere", "peers": ["a:1", "b:0", "c"], "token": "short"}})  # fmt: skip
    lines = str(e.value).splitlines()
    assert any("replicas.listen: 'nowhere' is not HOST:PORT" in line for line in lines)
    assert any("replicas.peers[1]: 'b:0' has port 0" in line for line in lines)
    assert any("replicas.peers[2]: 'c' is not HOST:PORT" in line for line in lines)
    assert any("replicas.token: set a shared secret of at least 16" in line for line in lines)
    with pytest.raises(ConfigError, match="at most 64"):
        load_config(env={}, overrides={"replicas": {
            "peers": [f"h:{i + 1}" for i in range(65)], "token": token}})  # fmt: skip
