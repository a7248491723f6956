"""Security: where the gateway listens, client API keys and their limits, which credentials
reach workers, and that no key or token ever appears in a log line.

Each test proves rows of docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal
import sys

import openai
import orjson
import pytest
from click.testing import CliRunner

from tests.conftest import FAST_PROBES, wait_until
from tests.support.processes import GatewayProcess, free_port
from vllm_gateway.app import GATEWAY, REGISTRY
from vllm_gateway.cli.main import main
from vllm_gateway.config.gateway import ApiKeyConfig, AuthConfig, GatewayConfig
from vllm_gateway.config.load import load_config
from vllm_gateway.control import access
from vllm_gateway.errors import ConcurrencyLimited, RateLimited
from vllm_gateway.http.keys import ClientKey, ClientKeys, generate_key, hash_key

pytestmark = pytest.mark.timeout(60)

KEY_A = "sk-gw-test-key-a-0123456789"
KEY_B = "sk-gw-test-key-b-9876543210"


def keyed(**limits: float) -> AuthConfig:
    """Two client keys, `a` with the given limits."""
    return AuthConfig(
        keys={
            "a": ApiKeyConfig(sha256=hash_key(KEY_A), **limits),  # type: ignore[arg-type]
            "b": ApiKeyConfig(sha256=hash_key(KEY_B)),
        }
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def completions(worker) -> list:
    return [r for r in worker.stats.requests if r.path == "/v1/completions"]


# --- where the gateway listens --------------------------------------------------------------


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp writes them) with a socket listening on port."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.rpartition(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.add(address)
    return found


async def test_binds_loopback_unless_told_otherwise(tmp_path, fake_worker):
    assert GatewayConfig().host == "127.0.0.1"
    w = await fake_worker(models="m")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "vllm_gateway",
        "serve",
        "--port",
        str(port),
        "--worker",
        w.url,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        async with asyncio.timeout(20):
            while b"gateway listening" not in await proc.stderr.readline():
                pass
        # 127.0.0.1 only, as /proc/net/tcp writes it: not 0.0.0.0, not any other address.
        assert listening_addresses(port) == {"0100007F"}
    finally:
        proc.kill()
        await proc.wait()


# --- client API keys ---------------------------------------------------------------------------


async def test_api_keys_are_required_when_configured(fake_worker, gateway, client, http):
    w = await fake_worker(models="m")
    gw = await gateway([w], auth=keyed())
    url = gw.url + "/v1/completions"
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    for headers, reason in (
        ({}, "didn't provide an API key"),
        (bearer("sk-wrong"), "Incorrect API key"),
        ({"Authorization": KEY_A}, "didn't provide"),  # not a bearer token
        (bearer(KEY_A + "x"), "Incorrect API key"),
        (bearer(KEY_A.upper()), "Incorrect API key"),
    ):
        async with http.post(url, json=body, headers=headers) as r:
            assert r.status == 401
            err = (await r.json())["error"]
            assert err["code"] == "invalid_api_key" and reason in err["message"]
    async with http.get(gw.url + "/v1/models") as r:
        assert r.status == 401
    async with http.get(gw.url + "/health") as r:
        assert r.status == 200  # load balancers' health checks need no key
    assert completions(w) == []  # nothing unauthenticated reached the worker

    with pytest.raises(openai.AuthenticationError):
        await client(gw).completions.create(model="m", prompt="x", max_tokens=1)
    for key in (KEY_A, KEY_B):
        answer = await client(gw, api_key=key).completions.create(
            model="m", prompt="x", max_tokens=1
        )
        assert answer.choices[0].text == " w0"
    models = await client(gw, api_key=KEY_B).models.list()
    assert [m.id for m in models.data] == ["m"]
    assert len(completions(w)) == 2
    assert all("Authorization" not in r.headers for r in completions(w))
    assert gw.app[GATEWAY].keys.unauthorized == 7


async def test_concurrency_limit_per_key(fake_worker, gateway, client, http):
    w = await fake_worker(models="m", tpot_ms=20)
    gw = await gateway([w], auth=keyed(max_concurrent=2))
    url = gw.url + "/v1/completions"
    body = {"model": "m", "prompt": "x", "max_tokens": 30, "stream": True}
    streams = [await http.post(url, json=body, headers=bearer(KEY_A)) for _ in range(2)]
    try:
        async with http.post(url, json=body, headers=bearer(KEY_A)) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "1"
            assert (await r.json())["error"]["code"] == "concurrency_limit_exceeded"
        # Another key is not held back by `a`'s limit.
        async with http.post(url, json=body, headers=bearer(KEY_B)) as r:
            assert r.status == 200
            await r.read()
    finally:
        for s in streams:
            await s.read()  # the streams end...
            s.release()
    keys = gw.app[GATEWAY].keys
    await wait_until(lambda: keys.keys[0].inflight == 0, timeout=3)
    # ...and their slots are the key's again.
    answer = await client(gw, api_key=KEY_A).completions.create(model="m", prompt="x")
    assert answer.choices
    assert keys.rate_limited == 1


async def test_requests_per_minute_per_key(fake_worker, gateway, client):
    w = await fake_worker(models="m")
    gw = await gateway([w], auth=keyed(requests_per_minute=3))
    a = client(gw, api_key=KEY_A)
    for _ in range(3):  # a burst of as many as the limit
        await a.completions.create(model="m", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as info:
        await a.completions.create(model="m", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "rate_limit_exceeded"
    # One token comes back every 20 s: the client is told to wait about that long.
    assert 15 <= int(info.value.response.headers["Retry-After"]) <= 20
    await client(gw, api_key=KEY_B).completions.create(model="m", prompt="x", max_tokens=1)
    assert len(completions(w)) == 4


def test_token_bucket_refills_at_the_configured_rate():
    key = ClientKey("k", ApiKeyConfig(sha256="0" * 64, requests_per_minute=60), now=0.0)
    for _ in range(60):
        key.admit(0.0)
        key.inflight -= 1
    with pytest.raises(RateLimited) as info:
        key.admit(0.5)
    assert info.value.retry_after == 1.0  # half a token back after 0.5 s: one more second
    key.admit(1.0)  # one per second
    key.inflight -= 1
    with pytest.raises(RateLimited):
        key.admit(1.5)
    key.admit(1000.0)  # refilled to the burst, not beyond
    assert key.tokens == 59.0
    limited = ClientKey("c", ApiKeyConfig(sha256="0" * 64, max_concurrent=1), now=0.0)
    limited.admit(0.0)
    with pytest.raises(ConcurrencyLimited):
        limited.admit(0.0)


def test_every_key_is_compared_in_constant_time(monkeypatch):
    """No early exit: the digest is compared with every key, matching one or not."""
    names = [f"k{i}" for i in range(5)]
    config = AuthConfig(keys={n: ApiKeyConfig(sha256=hash_key(n)) for n in names})
    keys = ClientKeys(config)
    calls: list[tuple[str, str]] = []

    def counting(given: str, expected: str) -> bool:
        calls.append((given, expected))
        return access.same_secret(given, expected)

    monkeypatch.setattr("vllm_gateway.http.keys.same_secret", counting)

    class Request:
        remote = "127.0.0.1"
        path = "/v1/completions"

        def __init__(self, key: str) -> None:
            self.headers = {"Authorization": f"Bearer {key}"}

    for given in ("k0", "k4", "nobody"):
        calls.clear()
        try:
            found = keys.authenticate(Request(given)).name  # type: ignore[arg-type]
        except Exception:
            found = None
        assert found == (given if given in names else None)
        assert len(calls) == len(names)  # the first key matching does not end the loop
        assert all(g == hash_key(given) for g, _ in calls)  # only digests are compared


def test_hash_key_command_prints_a_table_never_the_key(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["hash-key", "--name", "team-a"], input=KEY_A + "\n")
    assert result.exit_code == 0, result.output
    assert KEY_A not in result.output
    assert hashlib.sha256(KEY_A.encode()).hexdigest() in result.output
    # --generate: the new key on stderr, only its table on stdout; the table loads as is.
    result = runner.invoke(main, ["hash-key", "--generate", "--name", "gen"])
    assert result.exit_code == 0
    key = result.stderr.strip().rsplit(" ", 1)[-1]
    assert key.startswith("sk-gw-") and len(key) > 40 and key not in result.stdout
    path = tmp_path / "gateway.toml"
    path.write_text(result.stdout)
    config = load_config(path, env={})
    assert config.auth.keys["gen"].sha256 == hash_key(key)
    assert generate_key() != generate_key()
    # A malformed hash in the config is refused at load.
    path.write_text('[auth.keys."x"]\nsha256 = "not-hex"\n')
    with pytest.raises(Exception, match="64 hex digits"):
        load_config(path, env={})


# --- credentials towards workers -------------------------------------------------------------


async def test_client_authorization_is_not_forwarded_unless_configured(fake_worker, gateway, http):
    w = await fake_worker(models="m")
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    seen = []
    for auth in (
        AuthConfig(),
        AuthConfig(forward_authorization=True),
        AuthConfig(forward_authorization=True, worker_api_key="worker-secret"),
    ):
        gw = await gateway([w], auth=auth)
        async with http.post(gw.url + "/v1/completions", json=body, headers=bearer("mine")) as r:
            assert r.status == 200
        seen.append(w.stats.last("/v1/completions").headers.get("Authorization"))
    assert seen == [None, "Bearer mine", "Bearer worker-secret"]


async def test_worker_api_key_is_sent_on_requests_probes_and_scrapes(fake_worker, gateway, http):
    w = await fake_worker(models="m", api_key="worker-secret")
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    # Without the key, the worker's /v1/models refuses the probe: it never becomes ready.
    blind = await gateway([w])
    async with http.post(blind.url + "/v1/completions", json=body) as r:
        assert r.status in (404, 503)  # models unknown until a probe passes
    assert all(x.state.value != "ready" for x in blind.app[REGISTRY])
    # With it: probes pass, requests are served, and each carries the worker's key.
    gw = await gateway([w], auth=AuthConfig(worker_api_key="worker-secret"), probe=FAST_PROBES)
    async with http.post(gw.url + "/v1/completions", json=body, headers=bearer("client")) as r:
        assert r.status == 200
    assert w.stats.last("/v1/completions").headers["Authorization"] == "Bearer worker-secret"
    probes = [r for r in w.stats.requests if r.path == "/v1/models"]
    assert probes and probes[-1].headers["Authorization"] == "Bearer worker-secret"


# --- logs ------------------------------------------------------------------------------------


async def test_no_key_or_token_appears_in_any_log_line(tmp_path, fake_worker, http):
    worker_key, admin_token, reg_token = "wk-s3cret-1", "adm-s3cret-2", "reg-s3cret-3"
    admin2, reg2, worker2 = "adm-s3cret-4", "reg-s3cret-5", "wk-s3cret-6"
    secrets = [KEY_A, KEY_B, "sk-gw-wrong-s3cret", worker_key, admin_token, reg_token]
    secrets += [admin2, reg2, worker2]
    w = await fake_worker(models="m", api_key=worker_key)
    gp = GatewayProcess(tmp_path, [w])

    def config(admin: str, reg: str, wkey: str) -> str:
        return (
            f'port = {gp.port}\n[log]\nformat = "json"\nlevel = "debug"\naccess_log = true\n'
            "[probe]\ninterval = 0.2\ntimeout = 1.0\nstartup_wait = 5.0\n"
            f'[auth]\nworker_api_key = "{wkey}"\n'
            f'[auth.keys."a"]\nsha256 = "{hash_key(KEY_A)}"\nrequests_per_minute = 2\n'
            f'[auth.keys."b"]\nsha256 = "{hash_key(KEY_B)}"\n'
            f'[admin]\ntoken = "{admin}"\n[registration]\ntoken = "{reg}"\n'
            f'[[workers]]\nurl = "{w.url}"\n'
        )

    gp.write_config([w], raw=config(admin_token, reg_token, worker_key))
    try:
        await gp.start()
        url = gp.url
        body = {"model": "m", "prompt": "x", "max_tokens": 2}
        calls = [
            ("POST", "/v1/completions", body, KEY_A, 200),
            ("POST", "/v1/completions", body, KEY_A, 200),
            ("POST", "/v1/completions", body, KEY_A, 429),  # over a's rate
            ("POST", "/v1/completions", body, "sk-gw-wrong-s3cret", 401),
            ("POST", "/v1/completions", {**body, "stream": True}, KEY_B, 200),
            ("POST", "/v1/completions", {"model": "nope"}, KEY_B, 404),
            ("GET", "/admin/workers", None, "sk-gw-wrong-s3cret", 401),
            ("GET", "/admin/workers", None, admin_token, 200),
            ("POST", "/register_worker", {"worker_name": "http://127.0.0.1:9"}, KEY_B, 401),
        ]
        for method, path, doc, key, status in calls:
            data = orjson.dumps(doc) if doc is not None else None
            async with http.request(method, url + path, data=data, headers=bearer(key)) as r:
                assert r.status == status, (path, key, await r.text())
                await r.read()
        # A worker error and a reload that changes every secret (and is logged).
        async with http.post(
            url + "/v1/completions",
            json=body,
            headers={**bearer(KEY_B), "X-Fake-Fault": "status=500"},
        ) as r:
            assert r.status == 500
        gp.write_config([w], raw=config(admin2, reg2, worker2))
        gp.signal(signal.SIGHUP)
        await gp.notification()  # RELOADING
        await gp.notification()  # READY
        gp.signal(signal.SIGTERM)
        assert await gp.wait() == 0
    finally:
        await gp.close()
    text = gp.log_path.read_text()
    events = [orjson.loads(line) for line in text.splitlines() if line.strip()]
    names = [e["event"] for e in events]
    # The log did record all that (so the check below looks at something)...
    assert "gateway listening" in names and "configuration reloaded" in names
    assert "control request refused" in names and "request refused" in names
    assert sum(e.get("status") == 200 for e in events) >= 3  # access log lines
    assert any("admin" in str(e.get("changes")) for e in events)  # the reload said what
    # ...and no secret, nor the Authorization header that carries one, in any line.
    for secret in secrets:
        assert secret not in text, f"{secret} appears in the log"
    assert "Bearer" not in text
