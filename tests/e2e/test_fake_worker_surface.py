"""The fake worker's `n`, `logprobs`, `/v1/responses` and type errors, through a gateway,
read as clients read them: the openai SDK's objects, and every answer and stream event
validated strictly against the SDK's own pydantic schema (the SDK itself parses leniently,
so a missing or mistyped field would otherwise pass unseen)."""

from __future__ import annotations

import openai
import orjson
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

pytestmark = pytest.mark.timeout(30)

MESSAGES = [{"role": "user", "content": "say four words"}]
WORDS = " w0 w1 w2 w3"


@pytest.fixture
async def gw(fake_worker, gateway):
    return await gateway([await fake_worker(models="m", tpot_ms=1, ttft_ms=1)])


async def post(http, gw, path: str, body: dict) -> tuple[int, bytes]:
    async with http.post(gw.url + path, json=body) as r:
        return r.status, await r.read()


def sse(raw: bytes) -> list[dict]:
    """The JSON documents of an SSE body (the `data:` lines), `[DONE]` left out."""
    out = []
    for event in raw.split(b"\n\n"):
        for line in event.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(orjson.loads(line[6:]))
    return out


def completion_chunk(doc: dict) -> Completion:
    """A streamed completions event, validated as the SDK's Completion; the SDK reuses that
    type for chunks, though OpenAI and vLLM send `finish_reason: null` until the last one."""
    choices = [{**ch, "finish_reason": ch["finish_reason"] or "length"} for ch in doc["choices"]]
    return Completion.model_validate({**doc, "choices": choices})


async def test_n_choices_non_streamed_and_streamed(gw, client, http):
    c = client(gw)
    chat = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, n=2)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == WORDS and chat.usage.completion_tokens == 8
    done = await c.completions.create(model="m", prompt="x", max_tokens=4, n=3)
    assert [ch.text for ch in done.choices] == [WORDS] * 3

    stream = await c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, n=2, stream=True
    )
    texts, finished = {0: "", 1: ""}, {}
    async for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert texts == {0: WORDS, 1: WORDS} and finished == {0: "length", 1: "length"}

    status, raw = await post(http, gw, "/v1/chat/completions", {
        "model": "m", "messages": MESSAGES, "max_tokens": 4, "n": 2})  # fmt: skip
    assert status == 200 and len(ChatCompletion.model_validate_json(raw).choices) == 2
    status, raw = await post(http, gw, "/v1/completions", {
        "model": "m", "prompt": "x", "max_tokens": 4, "n": 2, "stream": True})  # fmt: skip
    events = sse(raw)
    assert status == 200 and {e["choices"][0]["index"] for e in events} == {0, 1}
    for doc in events:
        completion_chunk(doc)


async def test_chat_logprobs_and_top_logprobs(gw, client, http):
    c = client(gw)
    r = await c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [" w0", " w1", " w2", " w3"]
    first = content[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].token == first.token
    assert first.logprob < 0 and bytes(first.bytes).decode() == first.token
    assert first.top_logprobs[1].logprob < first.top_logprobs[0].logprob

    plain = await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None  # none unless asked for

    stream = await c.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, stream=True
    )
    streamed = [
        t
        async for chunk in stream
        for ch in chunk.choices
        if ch.logprobs
        for t in ch.logprobs.content
    ]
    assert [t.token for t in streamed] == [" w0", " w1", " w2", " w3"]
    assert all(len(t.top_logprobs) == 2 for t in streamed)

    body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 1}  # fmt: skip
    status, raw = await post(http, gw, "/v1/chat/completions", body)
    assert status == 200
    ChatCompletion.model_validate_json(raw)
    status, raw = await post(http, gw, "/v1/chat/completions", {**body, "stream": True})
    for doc in sse(raw):
        ChatCompletionChunk.model_validate(doc)


async def test_completions_logprobs(gw, client, http):
    c = client(gw)
    r = await c.completions.create(model="m", prompt="x", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [" w0", " w1", " w2", " w3"] and len(lp.token_logprobs) == 4
    assert lp.text_offset == [0, 3, 6, 9]
    assert all(
        len(top) == 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs, strict=True)
    )
    stream = await c.completions.create(
        model="m", prompt="x", max_tokens=3, logprobs=1, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert [t for chunk in chunks for t in chunk.choices[0].logprobs.tokens] == [
        " w0",
        " w1",
        " w2",
    ]
    status, raw = await post(http, gw, "/v1/completions", {
        "model": "m", "prompt": "x", "max_tokens": 2, "logprobs": 0})  # fmt: skip
    assert status == 200
    Completion.model_validate_json(raw)


async def test_responses_api_non_streamed_and_streamed(gw, client, http):
    c = client(gw)
    r = await c.responses.create(model="m", input="say four words", max_output_tokens=4)
    assert r.output_text == WORDS and r.status == "completed" and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (3, 4)
    items = await c.responses.create(
        model="m",
        instructions="be brief",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "one two"}]}],
        max_output_tokens=2,
    )
    assert items.output_text == " w0 w1" and items.usage.input_tokens == 4

    stream = await c.responses.create(model="m", input="hi", max_output_tokens=4, stream=True)
    events = [e async for e in stream]
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4:8] == ["response.output_text.delta"] * 4
    assert kinds[8:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == WORDS
    assert events[-1].response.output_text == WORDS
    assert [e.sequence_number for e in events] == list(range(len(events)))

    status, raw = await post(http, gw, "/v1/responses", {"model": "m", "input": "hi"})
    assert status == 200
    Response.model_validate_json(raw)
    status, raw = await post(http, gw, "/v1/responses", {
        "model": "m", "input": "hi", "max_output_tokens": 3, "stream": True})  # fmt: skip
    adapter = TypeAdapter(ResponseStreamEvent)
    for doc in sse(raw):
        adapter.validate_python(doc)
    assert b"event: response.completed\n" in raw and b"[DONE]" not in raw


@pytest.mark.parametrize(
    ("path", "body", "field", "words"),
    [
        ("/v1/chat/completions", {"messages": 5}, "messages", "Input should be a valid list"),
        ("/v1/chat/completions", {}, "messages", "Field required"),
        ("/v1/completions", {"prompt": 5}, "prompt", "Input should be a valid string"),
        ("/v1/completions", {"prompt": "x", "n": "2"}, "n", "Input should be a valid integer"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens", "valid integer"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "top_logprobs": 2},
            "top_logprobs",
            "`logprobs` must be set to true",
        ),
        ("/v1/responses", {"input": 5}, "input", "Input should be a valid string"),
        ("/v1/responses", {}, "input", "Field required"),
    ],
)
async def test_type_errors_are_worded_as_vllm_words_them(
    gw, client, http, path, body, field, words
):
    status, raw = await post(http, gw, path, {"model": "m", **body})
    error = orjson.loads(raw)["error"]
    assert status == 400 and words in error["message"] and error["param"] == field, error
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if "messages" in body and field == "messages":
        with pytest.raises(openai.BadRequestError, match="valid list"):
            await client(gw).chat.completions.create(model="m", **body)
