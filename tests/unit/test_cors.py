"""CORS answers as vLLM's server gives them (Starlette's CORSMiddleware), one case a line."""

from __future__ import annotations

import pytest

from vllm_gateway.config.gateway import CorsConfig
from vllm_gateway.http.cors import ALL_METHODS, Cors

PAGE = "https://page.example"
DEFAULT = Cors(CorsConfig())
NAMED = Cors(CorsConfig(allowed_origins=(PAGE,), allowed_methods=("POST",), allowed_headers=()))
CREDENTIALS = Cors(CorsConfig(allow_credentials=True))
ACAO = "Access-Control-Allow-Origin"


def test_defaults_are_vllms():
    config = CorsConfig()
    assert config.allowed_origins == config.allowed_methods == config.allowed_headers == ("*",)
    assert config.allow_credentials is False


@pytest.mark.parametrize(
    ("cors", "origin", "cookie", "expected"),
    [
        (DEFAULT, None, False, []),  # not a browser's request: nothing
        (DEFAULT, PAGE, False, [(ACAO, "*")]),
        (DEFAULT, PAGE, True, [(ACAO, PAGE), ("Vary", "Origin")]),  # cookies: `*` not enough
        (NAMED, PAGE, False, [(ACAO, PAGE), ("Vary", "Origin")]),
        (NAMED, "https://other.example", False, []),
        (
            CREDENTIALS,
            PAGE,
            False,
            [(ACAO, "*"), ("Access-Control-Allow-Credentials", "true")],
        ),
        (Cors(CorsConfig(allowed_origins=())), PAGE, False, []),
    ],
)
def test_answer_headers(cors, origin, cookie, expected):
    assert cors.answer_headers(origin, cookie) == expected
    if origin is not None:
        lines = b"".join(b"%s: %s\r\n" % (n.encode(), v.encode()) for n, v in expected)
        assert cors.answer_bytes(origin, cookie) == lines


def test_preflight_allowed_by_default_echoes_the_asked_headers():
    headers, refused = DEFAULT.preflight(PAGE, "POST", "authorization, content-type")
    assert refused == []
    assert dict(headers) == {
        ACAO: "*",
        "Access-Control-Allow-Methods": ", ".join(ALL_METHODS),
        "Access-Control-Max-Age": "600",
        "Access-Control-Allow-Headers": "authorization, content-type",
    }


def test_preflight_with_named_origins_and_credentials_names_the_origin():
    headers, refused = NAMED.preflight(PAGE, "POST", "content-type")
    assert refused == []
    assert (ACAO, PAGE) in headers and ("Vary", "Origin") in headers
    assert (
        "Access-Control-Allow-Headers",
        "Accept, Accept-Language, Content-Language, Content-Type",
    ) in headers
    headers, refused = CREDENTIALS.preflight(PAGE, "GET", None)
    assert (ACAO, PAGE) in headers and ("Access-Control-Allow-Credentials", "true") in headers
    assert not any(name == "Access-Control-Allow-Headers" for name, _ in headers)


@pytest.mark.parametrize(
    ("origin", "method", "asked", "refused"),
    [
        ("https://other.example", "POST", None, ["origin 'https://other.example'"]),
        (PAGE, "DELETE", None, ["method 'DELETE'"]),
        (PAGE, "POST", "authorization", ["headers"]),
        (
            "https://x.example",
            "PUT",
            "x-a",
            ["origin 'https://x.example'", "method 'PUT'", "headers"],
        ),
    ],
)
def test_preflight_refusals_name_what_is_not_allowed(origin, method, asked, refused):
    assert NAMED.preflight(origin, method, asked)[1] == refused
