"""`[replicas]`: gateways started apart tell each other where they placed which prompt, so
a conversation's next turn finds its history through either one; a stranger who reaches
the port without the token tells them nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest

from tests.conftest import wait_until
from tests.support.processes import free_port
from vllm_gateway.app import DISPATCHER, GATEWAY, REGISTRY
from vllm_gateway.config.gateway import ScrapeConfig, WorkerSpec
from vllm_gateway.config.replicas import ReplicasConfig
from vllm_gateway.dispatch.prefix_hash import prefix_blocks
from vllm_gateway.process import feed_handshake, feed_links
from vllm_gateway.process.placement_feed import PlacementFeed
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(60)

TOKEN = "a-shared-secret-of-some-length"


async def metric_lines(url: str, prefix: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as r:
        text = await r.text()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


async def test_a_later_turn_at_the_other_replica_goes_where_its_history_is(
    fake_worker, gateway, client
):
    """Two replicas, two workers. Replica 0 cannot use worker A (draining there only, as if
    its view lagged), so it sends the first turn of each of 10 conversations to B. Each
    second turn reaches replica 1, which placed none of them: told by replica 0, it sends
    every one to B, where its history is; not told, its rendezvous order would have sent
    about half of them to A (all 10 to B by chance: 1 in 1024). Both replicas list both
    addresses (one config for all): each finds itself among its peers and skips it."""
    a, b = await fake_worker(models="m"), await fake_worker(models="m")
    ports = [free_port(), free_port()]
    peers = tuple(f"127.0.0.1:{p}" for p in ports)
    replicas = [
        await gateway(
            [a, b],
            policy="cache_aware",
            replicas=ReplicasConfig(listen=f"127.0.0.1:{p}", peers=peers, token=TOKEN),
        )
        for p in ports
    ]
    apps = [r.app for r in replicas]
    for app in apps:
        await wait_until(lambda app=app: all(w.available for w in app[REGISTRY]), timeout=5)
    for app in apps:  # each connects to the other, and drops its link to itself
        feed = app[GATEWAY].status.peers
        assert feed is not None
        await wait_until(lambda f=feed: f.connected() == 1 and len(f._peers) == 1, timeout=5)
    in0 = apps[0][REGISTRY].get(a.url)
    assert in0 is not None
    apps[0][REGISTRY].set_state(in0, WorkerState.DRAINING, "test: replica 0 only")
    clients = [client(r) for r in replicas]
    histories = []
    for i in range(10):
        messages = [{"role": "user", "content": f"conversation {i}: " + "word " * 300}]
        r = await clients[0].chat.completions.create(model="m", messages=messages, max_tokens=8)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        messages.append({"role": "user", "content": "and then? " * 20})
        histories.append(messages)
    assert len([r for r in a.stats.requests if r.path == "/v1/chat/completions"]) == 0
    index = apps[1][DISPATCHER].policy.index
    await wait_until(lambda: index.blocks_of(apps[1][REGISTRY].get(b.url)) >= 10, timeout=5)
    for messages in histories:
        await clients[1].chat.completions.create(model="m", messages=messages, max_tokens=8)
    to_a = [r for r in a.stats.requests if r.path == "/v1/chat/completions"]
    to_b = [r for r in b.stats.requests if r.path == "/v1/chat/completions"]
    assert (len(to_a), len(to_b)) == (0, 20)
    # What each told and applied (each request placed, and ended: 10 + 10); nothing lost,
    # nothing refused, the self-link not counted.
    name = "vllm_gateway_replica_placements_total"
    counts = [await metric_lines(r.url, name) for r in replicas]
    assert counts[0][name + '{result="told"}'] == counts[1][name + '{result="applied"}'] == 20
    assert counts[1][name + '{result="told"}'] == counts[0][name + '{result="applied"}'] == 20
    for c in counts:
        assert c[name + '{result="dropped"}'] == c[name + '{result="refused"}'] == 0
    connected = [
        await metric_lines(r.url, "vllm_gateway_replica_peers_connected") for r in replicas
    ]
    assert [list(c.values()) for c in connected] == [[1.0], [1.0]]
    # Each conversation counts once in each replica's shares, whichever placed its turns.
    assert [app[DISPATCHER].policy.shares["m"].samples for app in apps] == [10, 10]


async def test_a_connection_without_the_token_is_refused_and_tells_nothing(
    fake_worker, gateway, monkeypatch
):
    """A stranger who reaches the port hears a nonce, never the token. A wrong MAC,
    placements sent as the answer, an answer too long, and silence are each closed (the
    wrong ones told `refused`); none of their placements is applied. The right MAC, made
    with the token, is: and a feed holding another token is refused, and says so."""
    monkeypatch.setattr(feed_links, "HELLO_SECONDS", 0.3)
    w = await fake_worker(models="m")
    port = free_port()
    gw = await gateway(
        [w],
        policy="cache_aware",
        replicas=ReplicasConfig(listen=f"127.0.0.1:{port}", token=TOKEN),
    )
    policy = gw.app[DISPATCHER].policy
    line = b'[["m", "%s", 5, 0, [1, 2, 3]]]\n' % w.url.encode()
    attempts = [
        (b'{"id": "x", "mac": "00"}\n' + line, feed_links.REFUSED),
        (line + line, feed_links.REFUSED),  # no answer: the first line is taken for one
        (b'{"id": "' + b"x" * (2 * feed_links.MAX_HELLO) + b'"}', b""),  # too long
        (b'{"id": 7, "mac": "00"}\n' + line, feed_links.REFUSED),
        (b"", b""),  # silence: closed after HELLO_SECONDS
    ]
    for data, told in attempts:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opening = await asyncio.wait_for(reader.readline(), timeout=5)
        assert TOKEN.encode() not in opening and b'"nonce"' in opening
        writer.write(data)
        assert await asyncio.wait_for(reader.read(), timeout=5) == told  # then closed
        writer.close()
    assert policy.shares == {} and not policy.index.known(1)
    name = "vllm_gateway_replica_placements_total"
    counts = await metric_lines(gw.url, name)
    assert counts[name + '{result="refused"}'] == 3  # the wrong MACs and the line as one
    assert counts[name + '{result="applied"}'] == 0
    # With the token (and the listener proving it too), the same line, tagged, applies.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    opening = await asyncio.wait_for(reader.readline(), timeout=5)
    hello = feed_handshake.Hello(TOKEN, "a peer")
    answered = hello.answer(opening.rstrip(b"\n"))
    assert answered is not None
    pending, answer = answered
    writer.write(answer)
    proof = await asyncio.wait_for(reader.readline(), timeout=5)
    verdict, key = hello.proven(pending, proof.rstrip(b"\n"))
    assert verdict == "ok" and TOKEN.encode() not in proof
    writer.write(feed_handshake.tag(key, 0, line.rstrip(b"\n")) + b"\n")
    await wait_until(lambda: "m" in policy.shares, timeout=5)
    assert policy.shares["m"].samples == 1
    # A line with a wrong tag, or one replayed: the connection is closed, nothing applied.
    writer.write(feed_handshake.tag(key, 0, line.rstrip(b"\n")) + b"\n")  # (seq 0 again)
    assert await asyncio.wait_for(reader.read(), timeout=5) == b""
    assert policy.shares["m"].samples == 1
    writer.close()
    # A replica configured with another token: refused, and it says so on its side.
    other = PlacementFeed(None, [("127.0.0.1", port)], lambda *p: None,
                          hello=feed_handshake.Hello("another-secret-entirely", "b"))  # fmt: skip
    await other.open()
    try:
        await wait_until(lambda: other.refused >= 1, timeout=5)
        assert other.connected() == 0
    finally:
        await other.close()
    counts = await metric_lines(gw.url, name)
    assert counts[name + '{result="refused"}'] >= 4


async def test_strangers_waiting_to_answer_do_not_keep_a_peer_out(fake_worker, monkeypatch):
    """More connections than MAX_UNPROVEN that never answer: each new one closes the
    oldest waiting, so a peer that connects meanwhile proves itself and is heard."""
    monkeypatch.setattr(feed_links, "MAX_UNPROVEN", 4)
    got: list[tuple] = []
    port = free_port()
    feed = PlacementFeed(("127.0.0.1", port), [], lambda *p: got.append(p),
                         hello=feed_handshake.Hello(TOKEN, "a"))  # fmt: skip
    await feed.open()
    strangers = []
    try:
        for _ in range(10):
            strangers.append(await asyncio.open_connection("127.0.0.1", port))
        await wait_until(lambda: len(feed.unproven) == 4, timeout=5)
        closed = [await asyncio.wait_for(r.read(), timeout=5) for r, _ in strangers[:6]]
        assert all(b'"nonce"' in c for c in closed)  # the opening, then EOF: evicted
        peer = PlacementFeed(None, [("127.0.0.1", port)], lambda *p: None,
                             hello=feed_handshake.Hello(TOKEN, "b"))  # fmt: skip
        await peer.open()
        try:
            await wait_until(lambda: peer.connected() == 1, timeout=5)
            peer.publish("m", "http://w", 1, 0, [7])
            await wait_until(lambda: len(got) == 1, timeout=5)
            # One replica at a second link (as if listed under two names): dropped as a twin.
            twin = feed_links.Link(("127.0.0.1", port))
            peer._peers.append(twin)
            twin.start(peer)
            await wait_until(lambda: twin not in peer._peers, timeout=5)
            assert peer._twins == {("127.0.0.1", port)} and peer.connected() == 1
        finally:
            await peer.close()
    finally:
        for _, writer in strangers:
            writer.close()
        await feed.close()


async def test_a_listener_without_the_token_is_told_nothing_and_cannot_drop_the_link():
    """A stranger answering at a peer's address (a recycled IP) claims this replica's own
    id, then a proof it cannot make: the link tells it nothing, is not dropped as this
    replica's own, and tries the address again."""
    seen: list[bytes] = []
    ended = asyncio.Event()

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        opening = {"nonce": "n", "id": "replica b", "v": feed_handshake.PROTOCOL}
        writer.write(json.dumps(opening).encode() + b"\n")  # b's own id, claimed
        seen.append(await reader.readline())  # b's answer (a MAC over a nonce: no token)
        writer.write(b'{"mac": "00", "self": true}\n')
        seen.append(await reader.read())  # anything else b sends, until it closes
        ended.set()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    b = PlacementFeed(None, [("127.0.0.1", port)], lambda *p: None,
                      hello=feed_handshake.Hello(TOKEN, "replica b"))  # fmt: skip
    await b.open()
    try:
        await wait_until(lambda: len(b._peers) == 1, timeout=5)
        b.publish("m", "http://w", 1, 0, [7])
        await asyncio.wait_for(ended.wait(), timeout=5)
        assert b'"mac"' in seen[0] and TOKEN.encode() not in seen[0]
        assert seen[1] == b""  # no placement: closed on the bad proof
        assert b._itself == set() and len(b._peers) == 1 and b.connected() == 0
    finally:
        await b.close()
        server.close()
        await server.wait_closed()


async def test_replicas_of_two_feed_protocols_do_not_link(fake_worker, gateway, monkeypatch):
    """A rolling upgrade: a replica of the release before versions (its handshake says
    none; it would count this release's request and end lines as placements) beside one
    of this. This one does not answer the older listener's opening, and closes on the
    older connector's answer though its MAC proves the token, saying nothing (the older
    one would read `refused` as a wrong token); it counts it (`mismatched`, not
    `refused`), and no line of the older one, tagged as it tags them, is applied. A
    version as a float (`2.0 == 2`) added by anyone on the path does not pass; a first
    line that is no opening (another service at the address) is no mismatch."""
    monkeypatch.setattr(feed_links, "RECONNECT_SECONDS", 60.0)  # one connection each
    seen: list[bytes] = []
    openings = [b'{"nonce": "n", "id": "an older replica"}', b"SSH-2.0-OpenSSH_9.2"]

    async def old_listener(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(openings[len(seen)] + b"\n")
        seen.append(await reader.read())  # whatever the new one says, until it closes

    server = await asyncio.start_server(old_listener, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        for expected in (1, 0):  # the older opening: a mismatch; then another service
            new = PlacementFeed(None, [("127.0.0.1", port)], lambda *p: None,
                                hello=feed_handshake.Hello(TOKEN, "a new replica"))  # fmt: skip
            before = len(seen)
            await new.open()
            try:
                await wait_until(lambda b=before: len(seen) > b, timeout=5)
                assert seen[-1] == b"" and new.connected() == 0 and new.refused == 0
                assert new.mismatches == expected
            finally:
                await new.close()
    finally:
        server.close()
        await server.wait_closed()
    # An older connector, with the token, at a gateway of this release.
    w = await fake_worker(models="m")
    port = free_port()
    gw = await gateway(
        [w], policy="cache_aware", replicas=ReplicasConfig(listen=f"127.0.0.1:{port}", token=TOKEN)
    )
    old = feed_handshake.Hello(TOKEN, "an older replica")
    line = b'[["m", "%s", 5, 0, [1, 2, 3]]]' % w.url.encode()
    for extra in ({}, {"v": 2.0}):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opening = json.loads(await asyncio.wait_for(reader.readline(), timeout=5))
        assert opening["v"] == feed_handshake.PROTOCOL
        mine = "0" * 32
        mac = old._mac("connector", opening["nonce"], mine, old.ident, opening["id"])  # (no v)
        answer = json.dumps({"id": old.ident, "nonce": mine, "mac": mac, **extra}).encode()
        key = old._key(opening["nonce"], mine)  # the older release tagged its lines too
        writer.write(answer + b"\n" + feed_handshake.tag(key, 0, line) + b"\n")
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # closed, no word
        writer.close()
        await writer.wait_closed()
    name = "vllm_gateway_replica_placements_total"
    counts = await metric_lines(gw.url, name)
    assert counts[name + '{result="mismatched"}'] == 2
    assert counts[name + '{result="refused"}'] == counts[name + '{result="applied"}'] == 0
    assert gw.app[DISPATCHER].policy.shares == {}


async def test_a_peer_name_stands_for_every_address_it_resolves_to():
    """A peer given by host name (a headless Service) is linked at each of its addresses,
    looked up again every RESOLVE_SECONDS: an address gone loses its link, and one that is
    this replica's own is not linked to again."""
    got: list[tuple] = []
    ports = [free_port(), free_port()]
    hello = feed_handshake.Hello(TOKEN, "replica b")
    b = PlacementFeed(("127.0.0.1", ports[1]), [], lambda *p: got.append(p), hello=hello)
    a = PlacementFeed(
        ("127.0.0.1", ports[0]),
        [("localhost", ports[1]), ("127.0.0.1", ports[0]), ("no-such-host.invalid", 1)],
        lambda *p: None,
        hello=feed_handshake.Hello(TOKEN, "replica a"),
    )
    await b.open()
    await a.open()
    try:
        await wait_until(lambda: a.connected() == 1 and len(a._peers) == 1, timeout=5)
        assert a._itself == {("127.0.0.1", ports[0])}  # found itself, and dropped that link
        a.publish("m", "http://w", 3, 0, [1, 2])
        await wait_until(lambda: got == [("m", "http://w", 3, 0, [1, 2])], timeout=5)
        # The name now resolves elsewhere: its link goes; its own address stays unlinked.
        a._follow({("127.0.0.1", ports[0])})
        assert a._peers == [] and a.connected() == 0
        a._follow({("127.0.0.1", ports[1])})
        await wait_until(lambda: a.connected() == 1, timeout=5)
    finally:
        await a.close()
        await b.close()


def test_every_name_is_the_same_in_another_interpreter():
    """Peer replicas and sibling processes tell each other these names: another
    interpreter, with another hash seed, names the same prompt alike."""
    doc = {
        "messages": [
            {"role": "system", "content": "s" * 2000},
            {"role": "user", "content": "u" * 3000},
            {"role": "assistant", "content": "a" * 4000},
            {"role": "user", "content": "v" * 50},
        ]
    }
    p = prefix_blocks(doc)
    assert p is not None and len(p.blocks) > p.first + 4
    code = (
        "import json, sys; from vllm_gateway.dispatch.prefix_hash import prefix_blocks; "
        "p = prefix_blocks(json.loads(sys.stdin.read())); print(json.dumps(p.blocks))"
    )
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], input=json.dumps(doc), capture_output=True,
            text=True, env=env, timeout=30, check=True,
        )  # fmt: skip
        assert json.loads(out.stdout) == p.blocks


async def test_a_replica_of_two_processes_hears_a_peer_in_both(fake_worker, gateway, client):
    """A replica run as two processes (both listening on its feed port) and a lone peer:
    what the peer places reaches the process its connection landed on, which tells its
    sibling; what either process places reaches the peer; nothing is counted twice."""
    from tests.support.processes import sibling_apps
    from vllm_gateway.config.gateway import GatewayConfig, WorkerSpec

    w = await fake_worker(models="m")
    ports = [free_port(), free_port()]
    peers = tuple(f"127.0.0.1:{p}" for p in ports)

    def replicas(i: int) -> ReplicasConfig:
        return ReplicasConfig(listen=f"127.0.0.1:{ports[i]}", peers=peers, token=TOKEN)

    lone = await gateway([w], policy="cache_aware", replicas=replicas(1))
    config = GatewayConfig(host="127.0.0.1", port=0, workers=(WorkerSpec(url=w.url),),
                           policy="cache_aware", replicas=replicas(0))  # fmt: skip
    async with sibling_apps(config) as servers:
        apps = [s.app for s in servers]
        feeds = [app[GATEWAY].status.peers for app in [*apps, lone.app]]
        # Each process of the pair and the lone one reach one peer each (a link to their own
        # port, landing on either process of the pair, is this replica's own: dropped).
        await wait_until(lambda: all(f is not None and f.connected() == 1 for f in feeds), 5)
        for i in range(6):
            messages = [{"role": "user", "content": f"conversation {i}: " + "word " * 300}]
            await client(lone).chat.completions.create(model="m", messages=messages, max_tokens=2)
        policies = [app[DISPATCHER].policy for app in apps]
        await wait_until(lambda: all(p.shares.get("m") and p.shares["m"].samples == 6
                                     for p in policies), timeout=5)  # fmt: skip
        messages = [{"role": "user", "content": "conversation x: " + "word " * 300}]
        await client(servers[0]).chat.completions.create(model="m", messages=messages, max_tokens=2)
        lone_policy = lone.app[DISPATCHER].policy
        await wait_until(lambda: lone_policy.shares["m"].samples == 7, timeout=5)
        await asyncio.sleep(0.2)  # (anything counted twice would have arrived by now)
        assert [p.shares["m"].samples for p in [*policies, lone_policy]] == [7, 7, 7]


async def told_pair(gateway, workers, policy):
    """Two replicas told of each other in front of `workers`, scraping them only every
    60 s (so what changes between is told), once linked."""
    ports = [free_port(), free_port()]
    peers = tuple(f"127.0.0.1:{p}" for p in ports)
    slow = ScrapeConfig(interval=60.0, timeout=1.0, stale_after=120.0)
    pair = [
        await gateway(workers, policy=policy, scrape=slow,
                      replicas=ReplicasConfig(listen=f"127.0.0.1:{p}", peers=peers, token=TOKEN))
        for p in ports
    ]  # fmt: skip
    for r in pair:
        feed = r.app[GATEWAY].status.peers
        await wait_until(lambda f=feed: f.connected() == 1, timeout=5)
    return pair


@pytest.mark.parametrize(
    ("policy", "content"),
    [
        ("cache_aware", "a long answer, please " * 60),  # placed by its prefix blocks
        ("queue", "a long answer, please " * 60),  # another policy's requests count too
    ],
)
async def test_a_peers_requests_count_on_a_worker_between_scrapes(
    fake_worker, gateway, client, policy, content
):
    """What the capacity gate adds to a replica's own requests on a worker (`others`):
    told, a peer's request counts there as it goes out and stops counting when it ends,
    with no scrape in between (scrapes every 60 s here), whatever policy placed it."""

    w = await fake_worker(models="m", ttft_ms=1, tpot_ms=50)
    a, b = await told_pair(gateway, [w], policy)
    in_b = b.app[REGISTRY].get(w.url)
    assert in_b is not None and in_b.others == 0
    scrapes = w.stats.metrics_scrapes
    messages = [{"role": "user", "content": content}]
    stream = await client(a).chat.completions.create(
        model="m", messages=messages, max_tokens=40, stream=True
    )
    chunks = aiter(stream)
    await anext(chunks)  # a's request is running on w
    await wait_until(lambda: in_b.others == 1, timeout=2)
    async for _ in chunks:
        pass
    await wait_until(lambda: in_b.others == 0, timeout=2)
    assert w.stats.metrics_scrapes == scrapes  # told, not scraped


async def test_a_request_waiting_for_a_peers_slot_goes_when_the_peers_request_ends(
    fake_worker, gateway, client
):
    """A worker of 2 slots: b runs one request there and a runs the other, so b's next
    request waits in b's queue (b counts a's request, told). When a's ends, b is told, and
    its waiter takes the slot at once: before b's own request ends, with no scrape between
    (every 60 s here)."""
    w = await fake_worker(models="m", ttft_ms=1, tpot_ms=30)
    a, b = await told_pair(gateway, [WorkerSpec(url=w.url, max_num_seqs=2)], "cache_aware")
    in_b = b.app[REGISTRY].get(w.url)
    assert in_b is not None
    messages = [{"role": "user", "content": "tell me a story"}]

    streams = []

    async def first_chunk(gw, max_tokens):
        stream = await client(gw).chat.completions.create(
            model="m", messages=messages, max_tokens=max_tokens, stream=True
        )
        streams.append(stream)
        chunks = aiter(stream)
        await anext(chunks)
        return chunks

    scrapes = w.stats.metrics_scrapes
    b_long = await first_chunk(b, 200)  # b's own, ~6 s: outlasts the rest (kept: collected,
    # its iterator would close the stream)
    a_short = await first_chunk(a, 10)  # a's, ~0.3 s
    await wait_until(lambda: in_b.others == 1, timeout=2)
    waiter = asyncio.create_task(first_chunk(b, 5))
    await asyncio.sleep(0.1)
    assert not waiter.done() and b.app[DISPATCHER].admission.depth == 1  # it waits in b
    async for _ in a_short:
        pass
    b_next = await asyncio.wait_for(waiter, timeout=1.0)  # a's end freed the slot
    assert in_b.inflight == 2  # b's first request is still running
    assert w.stats.metrics_scrapes == scrapes  # told, not scraped
    async for _ in b_next:
        pass
    await streams[0].close()  # b_long's, not read to its end
    del b_long
