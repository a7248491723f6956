"""`serve --processes N`: each process tells the others where it sent which prompt, so a
conversation's next turn finds its history whichever process it reaches."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator

import aiohttp
import openai
import pytest

from tests.conftest import FAST_PROBES, wait_until
from tests.support.processes import sibling_apps
from vllm_gateway.app import DISPATCHER, REGISTRY
from vllm_gateway.config.gateway import GatewayConfig, WorkerSpec
from vllm_gateway.process.feed_links import MAX_LINE
from vllm_gateway.process.placement_feed import BATCH, MAX_NAMES, PlacementFeed, feed_path
from vllm_gateway.workers import WorkerState

pytestmark = pytest.mark.timeout(40)


@contextlib.asynccontextmanager
async def three_feeds() -> AsyncIterator[tuple[str, list[PlacementFeed], list[list[tuple]]]]:
    """Three processes' feeds in one directory, connected; what each was told."""
    got: list[list[tuple]] = [[], [], []]
    with tempfile.TemporaryDirectory() as d:
        feeds = [
            PlacementFeed.siblings(i, 3, d, lambda *p, i=i: got[i].append(p))  # type: ignore[misc]
            for i in range(3)
        ]
        for f in feeds:
            await f.open()
        try:
            await wait_until(lambda: all(p.transport for p in feeds[0]._peers), timeout=5)
            yield d, feeds, got
        finally:
            for f in feeds:
                await f.close()


async def test_placements_reach_the_siblings_and_malformed_lines_are_dropped():
    async with three_feeds() as (d, feeds, got):
        for n in range(150):  # more than one line's worth, in one loop pass
            feeds[0].publish("m", "http://w1", 5, 7, [n, 2**63 - 1, -(2**63)])
        await wait_until(lambda: len(got[1]) == len(got[2]) == 150, timeout=5)
        assert got[0] == []  # not told its own
        assert got[1][5] == ("m", "http://w1", 5, 7, [5, 2**63 - 1, -(2**63)])
        assert feeds[0].sent == 300 and feeds[1].received == 150
        # A stranger's lines (never a sibling's): not JSON, wrong shapes, too many names,
        # a float or a bool among them, too many placements. Each is dropped whole; a good
        # one after them still applies; a line past MAX_LINE closes the connection.
        bad = [
            b"\xff not json",
            b"{}",
            b'[["m", "u", 0, 0]]',
            b'[["m", "u", 0, "7", []]]',
            b'[["m", "u", 0, 0, [1.5]]]',
            b'[["m", "u", 0, 0, %s]]' % str(list(range(MAX_NAMES + 1))).encode(),
            b'[["m", "u", 0, 0, [1]], ["m", "u", 0, 0, "x"]]',
            b'[["m", "u", true, 0, [1]]]',
            b"[%s]" % b",".join([b'["m", "u", 0, 0, []]'] * (BATCH + 1)),
        ]
        reader, writer = await asyncio.open_unix_connection(feed_path(d, 1))
        writer.write(b"\n".join(bad) + b'\n[["m", "http://w2", 0, 0, [1, 2]]]\n')
        await wait_until(lambda: len(got[1]) == 151, timeout=5)
        assert got[1][-1] == ("m", "http://w2", 0, 0, [1, 2])
        assert feeds[1].dropped == len(bad)
        writer.write(b"[" * (MAX_LINE + 1))
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""  # closed
        writer.close()
    feeds[0].publish("m", "u", 0, 0, [1])  # closed: a no-op
    assert feeds[0].sent == 300


async def test_a_sibling_that_goes_away_is_reconnected_and_one_that_stalls_is_skipped():
    """Sibling 1 restarts: what is published meanwhile is dropped for it, and once it is
    back it is told again. A sibling that does not read is skipped once MAX_BUFFERED
    bytes wait for it, and the others are still told."""
    async with three_feeds() as (d, feeds, got):
        await feeds[1].close()
        await wait_until(lambda: feeds[0]._peers[0].transport is None, timeout=5)
        feeds[0].publish("m", "u", 0, 0, [1])  # 1 is away: dropped for it
        await asyncio.sleep(0)
        assert feeds[0].dropped == 1
        feeds[1] = PlacementFeed.siblings(1, 3, d, lambda *p: got[1].append(p))
        await feeds[1].open()
        await wait_until(lambda: feeds[0]._peers[0].transport is not None, timeout=5)
        feeds[0].publish("m", "u", 0, 0, [2])
        await wait_until(lambda: len(got[1]) == 1, timeout=5)
        assert got[1][0][4] == [2] and [p[4] for p in got[2]] == [[1], [2]]
        # Sibling 2 stops reading: its buffer fills, then it is skipped; 1 keeps up.
        for stalled in feeds[2].inbound:
            assert stalled.transport is not None
            stalled.transport.pause_reading()  # type: ignore[attr-defined]
        names = [2**62 + n for n in range(MAX_NAMES - 1)]  # ~1.4 KB a placement
        before, dropped, told_2 = len(got[1]), feeds[0].dropped, len(got[2])
        for _ in range(100):  # ~9 MB: past MAX_BUFFERED and the kernel's buffers
            for _ in range(BATCH):
                feeds[0].publish("m", "u", 0, 0, names)
            await asyncio.sleep(0)
        await wait_until(lambda: len(got[1]) == before + 100 * BATCH, timeout=10)
        assert feeds[0].dropped > dropped  # some for 2, none for 1
        assert len(got[2]) == told_2  # it read nothing since


async def test_a_later_turn_at_the_other_process_goes_where_its_history_is(fake_worker):
    """Two processes of one gateway, two workers. Process 0 cannot use worker A (draining
    there only, as if its view lagged), so it sends the first turn of each of 10
    conversations to B. Each second turn reaches process 1, which sent none of them: told
    by process 0, it sends every one to B, where its history is; not told, its rendezvous
    order would have sent about half of them to A (all 10 to B by chance: 1 in 1024)."""
    a, b = await fake_worker(models="m"), await fake_worker(models="m")
    config = GatewayConfig(
        host="127.0.0.1",
        port=0,
        workers=(WorkerSpec(url=a.url), WorkerSpec(url=b.url)),
        probe=FAST_PROBES,
        policy="cache_aware",
    )
    async with sibling_apps(config) as servers:
        apps = [s.app for s in servers]
        for app in apps:
            await wait_until(lambda app=app: all(w.available for w in app[REGISTRY]), timeout=5)
        in0 = apps[0][REGISTRY].get(a.url)
        assert in0 is not None
        apps[0][REGISTRY].set_state(in0, WorkerState.DRAINING, "test: process 0 only")
        clients = [
            openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
            for s in servers
        ]
        try:
            histories = []
            for i in range(10):
                messages = [{"role": "user", "content": f"conversation {i}: " + "word " * 60}]
                r = await clients[0].chat.completions.create(
                    model="m", messages=messages, max_tokens=8
                )
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
                messages.append({"role": "user", "content": "and then? " * 20})
                histories.append(messages)
            assert len([r for r in a.stats.requests if r.path == "/v1/chat/completions"]) == 0
            index = apps[1][DISPATCHER].policy.index
            await wait_until(lambda: index.blocks_of(apps[1][REGISTRY].get(b.url)) >= 10, 5)
            for messages in histories:
                await clients[1].chat.completions.create(model="m", messages=messages, max_tokens=8)
            # /metrics (either process answers for both) counts what each told and applied.
            async with aiohttp.ClientSession() as http, http.get(servers[1].url + "/metrics") as r:
                text = await r.text()
            counts = {
                (line.split('process="')[1][0], line.split('result="')[1].split('"')[0]): float(
                    line.rsplit(" ", 1)[1]
                )
                for line in text.splitlines()
                if line.startswith("vllm_gateway_sibling_placements_total{")
            }
            # (each request told twice: placed, and ended)
            assert counts[("0", "told")] == counts[("1", "applied")] == 20
            assert counts[("1", "told")] == counts[("0", "applied")] == 20
            assert counts[("0", "dropped")] == counts[("1", "dropped")] == 0
            # Each conversation counts once in each process's shares, whichever sent its turns.
            samples = [app[DISPATCHER].policy.shares["m"].samples for app in apps]
            assert samples == [10, 10]
        finally:
            for c in clients:
                await c.close()
    to_a = [r for r in a.stats.requests if r.path == "/v1/chat/completions"]
    to_b = [r for r in b.stats.requests if r.path == "/v1/chat/completions"]
    assert (len(to_a), len(to_b)) == (0, 20)


async def test_a_sibling_away_is_retried_once_a_second_however_often_others_reconnect():
    """Sibling 2 never starts; sibling 1 restarts five times. Each restart asks feed 0 to
    connect to its away siblings now, but there stays one retry per sibling, not one
    chain per restart."""
    with tempfile.TemporaryDirectory() as d:
        feeds = [PlacementFeed.siblings(i, 3, d, lambda *p: None) for i in range(2)]
        for f in feeds:
            await f.open()
        tries = []
        away = feeds[0]._peers[1]
        connect = away._connect

        async def counted() -> None:
            tries.append(asyncio.get_running_loop().time())
            await connect()

        away._connect = counted  # type: ignore[method-assign]
        try:
            for _ in range(5):
                await feeds[1].close()
                feeds[1] = PlacementFeed.siblings(1, 3, d, lambda *p: None)
                await feeds[1].open()
                await wait_until(lambda: feeds[0]._peers[0].transport is not None, timeout=5)
            start = len(tries)
            await asyncio.sleep(2.5)
            assert len(tries) - start <= 3, tries  # one chain: 2-3 tries in 2.5 s
        finally:
            for f in feeds:
                await f.close()


async def test_a_placement_that_fails_to_apply_costs_its_line_not_the_connection():
    def apply(model: str, url: str, *rest: object) -> None:
        if url == "boom":
            raise ValueError("a defect")
        got.append(url)

    got: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        feed = PlacementFeed.siblings(0, 2, d, apply)
        await feed.open()
        try:
            _, writer = await asyncio.open_unix_connection(feed_path(d, 0))
            writer.write(b'[["m", "a", 0, 0, []], ["m", "boom", 0, 0, []], ["m", "c", 0, 0, []]]\n')
            writer.write(b'[["m", "d", 0, 0, []]]\n')
            await wait_until(lambda: got == ["a", "d"], timeout=5)
            assert feed.received == 2 and feed.dropped == 1
            writer.close()
        finally:
            await feed.close()
