"""How to reach a Kubernetes API server: in-cluster service account, or a kubeconfig file.

In a pod, the service account gives everything (the standard paths below): the API server
from `KUBERNETES_SERVICE_HOST`/`_PORT`, a bearer token re-read at every connection (bound
tokens rotate, about hourly), the cluster CA, and the pod's namespace. Outside, a kubeconfig
file: its current context's cluster (`server`, `certificate-authority[-data]`,
`insecure-skip-tls-verify`) and user (`token`, `tokenFile`, `client-certificate[-data]` +
`client-key[-data]`). Exec plugins and auth providers are not supported: they run
programs, and a gateway that needs one can be given a token file instead.

kubeconfig files are YAML; the gateway reads them without a YAML library through the
block subset kubectl writes (`read_yaml`): mappings, `- ` sequences, plain or quoted
scalars, `{}` and `[]`. A JSON kubeconfig is read as JSON.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_gateway.errors import ConfigError

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
MAX_FILE_BYTES = 1024 * 1024  # a kubeconfig, token or CA file larger than this is refused


@dataclass(frozen=True, slots=True)
class KubeAccess:
    """One API server and the credentials to use with it."""

    server: str  # https://10.96.0.1:443, no trailing slash
    namespace: str = ""  # the pod's own (in-cluster) or the context's; "" when unknown
    token: str = ""
    token_file: str = ""  # read again at every connection: bound tokens rotate
    ca_file: str = ""
    ca_data: bytes = b""
    cert_file: str = ""  # client certificate and key (PEM files)
    key_file: str = ""
    insecure: bool = False  # insecure-skip-tls-verify

    def headers(self) -> dict[str, str]:
        """The Authorization header for the next request (a rotated token included)."""
        token = _read_text(self.token_file).strip() if self.token_file else self.token
        return {"Authorization": f"Bearer {token}"} if token else {}

    def ssl_context(self) -> ssl.SSLContext | None:
        """TLS settings for an https server; None for http (a test's fake API server)."""
        if not self.server.startswith("https://"):
            return None
        ctx = ssl.create_default_context(
            cafile=self.ca_file or None,
            cadata=self.ca_data.decode("ascii", "replace") if self.ca_data else None,
        )
        if self.insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file or None)
        return ctx


def in_cluster(env: Mapping[str, str] = os.environ, root: str = SERVICE_ACCOUNT_DIR) -> KubeAccess:
    """The pod's service account; ConfigError when not running in a pod."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    token_file = os.path.join(root, "token")
    if not host or not os.path.exists(token_file):
        raise ConfigError(
            [
                "discovery.kubernetes: not in a pod (no KUBERNETES_SERVICE_HOST or no "
                f"{token_file}); set kubeconfig"
            ]
        )
    host = f"[{host}]" if ":" in host else host
    namespace_file = os.path.join(root, "namespace")
    namespace = _read_text(namespace_file).strip() if os.path.exists(namespace_file) else ""
    return KubeAccess(
        server=f"https://{host}:{port or 443}",
        namespace=namespace,
        token_file=token_file,
        ca_file=os.path.join(root, "ca.crt"),
    )


def from_kubeconfig(path: str) -> KubeAccess:
    """The current context of the kubeconfig at `path`; ConfigError when unusable."""
    text = _read_text(path)
    try:
        doc = json.loads(text) if text.lstrip().startswith("{") else read_yaml(text)
    except ValueError as e:
        raise ConfigError([f"{path}: not a kubeconfig ({e})"]) from e
    try:
        return _current_context(doc, os.path.dirname(os.path.abspath(path)))
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError([f"{path}: {e}"]) from e


def _current_context(doc: Any, base: str) -> KubeAccess:
    def named(kind: str, name: str) -> dict[str, Any]:
        for item in doc.get(kind) or ():
            if isinstance(item, dict) and item.get("name") == name:
                return item.get(kind[:-1]) or {}
        raise KeyError(f"no {kind[:-1]} named {name!r}")

    context = named("contexts", str(doc["current-context"]))
    cluster = named("clusters", str(context["cluster"]))
    user = named("users", str(context.get("user", ""))) if context.get("user") else {}
    server = str(cluster["server"]).rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise ValueError(f"server {server!r} is not an http(s) URL")

    def path(value: object) -> str:
        return os.path.join(base, str(value)) if value else ""

    cert, key = path(user.get("client-certificate")), path(user.get("client-key"))
    if user.get("client-certificate-data"):  # ssl wants files: keep them private to us
        cert = _private_file(_b64(user["client-certificate-data"]))
        key = _private_file(_b64(user.get("client-key-data", "")))
    return KubeAccess(
        server=server,
        namespace=str(context.get("namespace") or ""),
        token=str(user.get("token") or ""),
        token_file=path(user.get("tokenFile")),
        ca_file=path(cluster.get("certificate-authority")),
        ca_data=_b64(cluster.get("certificate-authority-data", "")),
        cert_file=cert,
        key_file=key,
        insecure=cluster.get("insecure-skip-tls-verify") in (True, "true"),
    )


def _b64(value: object) -> bytes:
    return base64.b64decode(str(value)) if value else b""


def _private_file(data: bytes) -> str:
    fd, name = tempfile.mkstemp(prefix="vllm-gateway-kube-", suffix=".pem")  # mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return name


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise ConfigError([f"discovery.kubernetes: cannot read {path}: {e.strerror}"]) from e
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError([f"discovery.kubernetes: {path} is over {MAX_FILE_BYTES} bytes"])
    return data.decode("utf-8", "replace")


# --- the YAML subset of kubeconfig files ------------------------------------------------------


def read_yaml(text: str) -> Any:
    """Block YAML as kubectl writes it: mappings, sequences of mappings or scalars, plain and
    quoted scalars, `{}`/`[]`. Raises ValueError on anything else (anchors, flow content,
    multi-line scalars), rather than guess."""
    lines = []
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#") or stripped in ("---", "..."):
            continue
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError("tabs in indentation")
        lines.append((len(raw) - len(raw.lstrip(" ")), stripped))
    value, end = _block(lines, 0, lines[0][0] if lines else 0)
    if end != len(lines):
        raise ValueError(f"unexpected indentation at {lines[end][1]!r}")
    return value


def _block(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[Any, int]:
    if i >= len(lines):
        return None, i
    if lines[i][1].startswith("- ") or lines[i][1] == "-":
        return _sequence(lines, i, indent)
    return _mapping(lines, i, indent)


def _sequence(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[list[Any], int]:
    out: list[Any] = []
    while i < len(lines) and lines[i][0] == indent and lines[i][1].startswith("-"):
        rest = lines[i][1][1:].lstrip()
        if not rest:  # the item is the block below
            item, i = _block(lines, i + 1, lines[i + 1][0] if i + 1 < len(lines) else indent)
        elif _key_of(rest) is not None:  # "- key: value" opens a mapping one column in
            inner = indent + 2 + (len(lines[i][1]) - 2 - len(rest))
            lines[i] = (inner, rest)
            item, i = _mapping(lines, i, inner)
        else:
            item, i = _scalar(rest), i + 1
        out.append(item)
    return out, i


def _mapping(lines: list[tuple[int, str]], i: int, indent: int) -> tuple[dict[str, Any], int]:
    out: dict[str, Any] = {}
    while i < len(lines) and lines[i][0] == indent:
        text = lines[i][1]
        key = _key_of(text)
        if key is None:
            raise ValueError(f"expected `key: value`, got {text!r}")
        rest = text[len(key) + 1 :].strip()
        i += 1
        if rest:
            out[_scalar(key)] = _scalar(rest)
        elif i < len(lines) and (
            lines[i][0] > indent or (lines[i][0] == indent and lines[i][1].startswith("-"))
        ):
            out[_scalar(key)], i = _block(lines, i, lines[i][0])
        else:
            out[_scalar(key)] = None
    return out, i


def _key_of(text: str) -> str | None:
    """The key of `key: value` / `key:`, quotes kept; None when `text` is no such line."""
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        return text[: end + 1] if end > 0 and text[end + 1 : end + 2] == ":" else None
    head, sep, tail = text.partition(":")
    if not sep or (tail and not tail.startswith(" ")) or head.startswith(("{", "[")):
        return None
    return head


def _scalar(text: str) -> Any:
    if text[:1] == '"':
        value, end = json.JSONDecoder().raw_decode(text)
        _only_comment(text[end:])
        return value
    if text[:1] == "'":
        end = 1
        while (end := text.find("'", end)) >= 0 and text[end + 1 : end + 2] == "'":
            end += 2
        if end < 0:
            raise ValueError(f"unterminated quote: {text[:20]!r}")
        _only_comment(text[end + 1 :])
        return text[1:end].replace("''", "'")
    cut = text.find(" #")
    text = (text[:cut] if cut >= 0 else text).strip()
    if text in ("{}", "[]"):
        return {} if text == "{}" else []
    if text[:1] in ("{", "[", "&", "*", "|", ">", "!"):
        raise ValueError(f"unsupported YAML: {text[:20]!r}")
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "~", ""):
        return None
    return text


def _only_comment(rest: str) -> None:
    rest = rest.strip()
    if rest and not rest.startswith("#"):
        raise ValueError(f"unexpected text after a quoted scalar: {rest[:20]!r}")
