"""Render the configuration reference (docs/configuration.md) from the declarations in config/.

`python -m vllm_gateway.config.docs > docs/configuration.md` regenerates it; a test fails
when the committed file differs, so the reference cannot fall behind the code.
"""

from __future__ import annotations

from vllm_gateway.config.load import describe

HEADER = """\
# Configuration reference

Generated from `vllm_gateway/config/` by `python -m vllm_gateway.config.docs`; do not
edit by hand.

Settings come from, lowest precedence first: the defaults below, the TOML file given by
`--config` (or `VLLM_GATEWAY_CONFIG`), environment variables, then command-line options.
A top-level key `port` is `port = 8000` in TOML and `VLLM_GATEWAY_PORT` in the
environment; a key in a section, such as `format` in `[log]`, is `VLLM_GATEWAY_LOG_FORMAT`.
Lists given in the environment are comma-separated. `vllm-gateway check-config` validates a
file and prints the effective configuration; every mistake is reported, one per line.

A value of 0 for a timeout disables it. Durations are in seconds, sizes in bytes.

| key | type | default | unit | CLI | environment | meaning |
| --- | --- | --- | --- | --- | --- | --- |
"""

EXAMPLE = """
## Example

```toml
host = "0.0.0.0"
port = 8000
policy = "cache_aware"

[log]
format = "json"

[timeouts]
first_byte = 300

[[workers]]
url = "http://10.0.0.5:8000"            # models learned from its /v1/models

[[workers]]
url = "http://10.0.0.6:8000"
models = ["llama-3-70b"]                # pinned: only this model is sent there
```
"""


def render_reference() -> str:
    """The whole reference as Markdown."""
    lines = [HEADER]
    for key, type_, default, unit, cli, env, help_ in describe():
        cells = [
            f"`{key}`",
            type_,
            f"`{default}`",
            unit,
            f"`{cli}`" if cli else "",
            f"`{env}`" if env else "",
            help_.replace("|", "\\|"),
        ]
        lines.append("| " + " | ".join(cells) + " |\n")
    lines.append(EXAMPLE)
    return "".join(lines)


if __name__ == "__main__":
    print(render_reference(), end="")
