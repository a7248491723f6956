"""RequestInfo: what the gateway reads of a body, and what it refuses."""

from __future__ import annotations

import orjson
import pytest

from vllm_gateway.dispatch.request_info import parse_request
from vllm_gateway.errors import BadRequest


def parse(body: bytes, headers: dict | None = None):
    return parse_request("/v1/chat/completions", body, "rid", headers or {})


def test_reads_model_and_stream_and_keeps_bytes():
    body = b'{"model": "m", "stream": true, "messages": []}'
    info = parse(body)
    assert (info.model, info.stream) == ("m", True)
    assert info.body is body


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "empty"),
        (b"{", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (b'"x"', "JSON object"),
        (b"{}", "no `model`"),
        (b'{"model": 3}', "must be a string"),
        (b'{"model": ""}', "empty"),
        (b'{"model": "a\\r\\nX-Evil: 1"}', "control characters"),
        (b'{"model": "m", "stream": "yes"}', "`stream`"),
        (b'\xff\xfe{"model": "m"}', "not valid JSON"),
    ],
)
def test_refuses_unusable_bodies(body, message):
    with pytest.raises(BadRequest, match=message):
        parse(body)


def test_session_key_prefers_header_then_user():
    body = orjson.dumps({"model": "m", "user": "alice"})
    assert parse(body).session_key == "alice"
    assert parse(body, {"x-session-id": "s1"}).session_key == "s1"
    assert parse(b'{"model": "m"}').session_key is None


def test_prefix_text_from_prompt_or_messages():
    info = parse(orjson.dumps({"model": "m", "prompt": "abcdef"}))
    assert info.prefix_text(3) == "abc"
    info = parse(
        orjson.dumps(
            {
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                ],
            }
        )
    )
    assert info.prefix_text(100) == "system:be brief\nuser:hi\n"


def test_with_model_rewrites_body():
    info = parse(b'{"model": "alias", "stream": false}')
    other = info.with_model("real")
    assert other.model == "real" and orjson.loads(other.body)["model"] == "real"
    assert info.body == b'{"model": "alias", "stream": false}'


def test_priority_header():
    assert parse(b'{"model": "m"}', {"x-priority": "-5"}).priority == -5
    assert parse(b'{"model": "m"}', {"x-priority": "high"}).priority == 0
