"""The peer replicas' handshake and line tags: both sides prove the shared token, and every
line after is tagged under a key of that connection's own.

    listener  -> {"nonce": NL, "id": L, "v": PROTOCOL}
    connector -> {"id": C, "nonce": NC, "v": PROTOCOL, "mac": MAC("connector", NL, NC, C, L, V)}
    listener  -> {"mac": MAC("listener", NL, NC, L, C), "self": C == L}   or `refused`
    then each connector line: TAG(K, seq, line) + " " + line, K = MAC("session", NL, NC)

MAC is HMAC-SHA256 under the token, over the JSON of its fields; the role names keep one
side's MAC from passing as the other's. The token never crosses the network; a listener
that cannot prove it (a stranger at a recycled address) gets no placement, and cannot
make the connector drop a link (as its own, or a twin) with an id it merely claims; a
stranger relaying a handshake between two replicas cannot tag a line of its own (it lacks
K), and replayed or reordered lines fail the sequence number in the tag.

Both sides must speak the same line protocol (`PROTOCOL`, V in the MAC as "v2"): a
connector does not answer an opening of another version (or none: a release before
versions), and a listener closes on an answer whose MAC proves the token under another
version (or none), saying nothing (an older release would read `refused` as a wrong
token); this release logs it. Replicas of two releases whose lines mean different things
do not link: during a rolling upgrade the two releases share nothing with each other,
rather than count what the other says wrongly.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

import orjson

TAG_BYTES = 32  # hex characters of a line's tag (128 bits)
# The feed's line protocol (placement_feed.py): 2 since every request and its end are
# told (`LOAD`, `DONE` lines), which a replica of the release before (no version in its
# handshake) would count as placements. Raise it whenever a line's meaning changes.
PROTOCOL = 2


@dataclass(frozen=True)
class Hello:
    """The handshake of a replica with id `ident`, all of them holding `token`."""

    token: str
    ident: str

    def _mac(self, *fields: str) -> str:
        return hmac.new(self.token.encode(), orjson.dumps(fields), hashlib.sha256).hexdigest()

    def opening(self, nonce: str) -> bytes:
        """What the listening side says first."""
        return orjson.dumps({"nonce": nonce, "id": self.ident, "v": PROTOCOL}) + b"\n"

    def answer(self, line: bytes) -> tuple[Pending, bytes] | None:
        """The connecting side's answer to an opening line, and what it then waits to see
        proven; None when the line is not an opening."""
        doc = _object(line)
        nonce, peer = doc.get("nonce"), doc.get("id")
        if not (isinstance(nonce, str) and isinstance(peer, str)):
            return None
        if len(nonce) > 128 or len(peer) > 512:
            return None
        mine = secrets.token_hex(16)
        mac = self._mac("connector", nonce, mine, self.ident, peer, _VERSION)
        out = orjson.dumps({"id": self.ident, "nonce": mine, "v": PROTOCOL, "mac": mac}) + b"\n"
        return Pending(nonce, mine, peer), out

    def check(self, nonce: str, line: bytes) -> tuple[str, bytes, bytes]:
        """The listening side's verdict on an answer to its `nonce`: ('ok' or 'self', the
        proof to send back, the session key), ('version', b'', b'') for an answer with
        the token of another protocol (a replica of another release: its MAC holds under
        the version it claims, or under none), or ('bad', b'', b'')."""
        doc = _object(line)
        peer, theirs, mac = doc.get("id"), doc.get("nonce"), doc.get("mac")
        if not (isinstance(peer, str) and isinstance(theirs, str) and isinstance(mac, str)):
            return "bad", b"", b""
        if len(peer) > 512 or len(theirs) > 128:
            return "bad", b"", b""
        version = _version(doc)
        said = (f"v{version}",) if version is not None else ()
        expected = self._mac("connector", nonce, theirs, peer, self.ident, *said)
        if not hmac.compare_digest(mac.encode(), expected.encode()):
            return "bad", b"", b""
        if version != PROTOCOL:
            return "version", b"", b""
        itself = peer == self.ident
        proof = self._mac("listener", nonce, theirs, self.ident, peer)
        out = orjson.dumps({"mac": proof, "self": itself}) + b"\n"
        return ("self" if itself else "ok"), out, self._key(nonce, theirs)

    def proven(self, pending: Pending, line: bytes) -> tuple[str, bytes]:
        """The connecting side's verdict on the listener's proof: ('ok', the session key),
        ('self', b'') when the listener is this replica, ('bad', b'') otherwise."""
        doc = _object(line)
        mac = doc.get("mac")
        expected = self._mac("listener", pending.theirs, pending.mine, pending.peer, self.ident)
        if not (isinstance(mac, str) and hmac.compare_digest(mac.encode(), expected.encode())):
            return "bad", b""
        if doc.get("self") is True and pending.peer == self.ident:
            return "self", b""
        return "ok", self._key(pending.theirs, pending.mine)

    def _key(self, listener_nonce: str, connector_nonce: str) -> bytes:
        return bytes.fromhex(self._mac("session", listener_nonce, connector_nonce))


def opening_protocol(line: bytes) -> int | bool | None:
    """The protocol an opening line says it speaks (None: none, a release before
    versions); False when the line is no opening (a stranger, another service). A
    connector answers only an opening of `PROTOCOL`. Unproven: the opening has no MAC."""
    doc = _object(line)
    if not (isinstance(doc.get("nonce"), str) and isinstance(doc.get("id"), str)):
        return False
    return _version(doc)


def _version(doc: dict) -> int | None:
    """A handshake line's protocol: an int, not a bool or a float (`2.0 == 2`, `True ==
    1`: a field anyone on the path may add must not pass for this version)."""
    v = doc.get("v")
    return v if type(v) is int else None


_VERSION = f"v{PROTOCOL}"  # (in the connector's MAC)


@dataclass(frozen=True)
class Pending:
    """A connector's handshake under way: the listener's nonce, its own, the id claimed."""

    theirs: str
    mine: str
    peer: str


def tag(key: bytes, seq: int, line: bytes) -> bytes:
    """Line number `seq` of a connection, tagged under its session `key`."""
    mac = hmac.new(key, seq.to_bytes(8, "big") + line, hashlib.sha256).hexdigest()
    return mac[:TAG_BYTES].encode() + b" " + line


def untag(key: bytes, seq: int, tagged: bytes) -> bytes | None:
    """The line inside `tagged` if its tag is right for line number `seq`, else None."""
    mark, line = tagged[:TAG_BYTES], tagged[TAG_BYTES + 1 :]
    mac = hmac.new(key, seq.to_bytes(8, "big") + line, hashlib.sha256).hexdigest()
    ok = len(tagged) > TAG_BYTES and hmac.compare_digest(mark, mac[:TAG_BYTES].encode())
    return line if ok else None


def _object(line: bytes) -> dict:
    """A line as a JSON object; {} when it is not one."""
    try:
        doc = orjson.loads(line)
    except orjson.JSONDecodeError:
        return {}
    return doc if isinstance(doc, dict) else {}
