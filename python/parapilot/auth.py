"""Shared-secret authentication of the bus (docs/wire-format.md, section 5).

The secret is loaded from a file or an environment variable with the C++ rules
(transport/auth.cc): one trailing "\\n" or "\\r\\n" is removed, and it must be at least 16 bytes.
It is held in a Secret, whose repr never shows the bytes; errors name the file or variable,
never the content.
"""

from __future__ import annotations

import hashlib
import hmac
import os

MIN_SECRET_BYTES = 16
_SERVER_LABEL = b"parapilot/1 server"
_CLIENT_LABEL = b"parapilot/1 client"


class SecretError(ValueError):
    """A secret that cannot be loaded (message names the source, never the bytes)."""


class Secret:
    """A shared secret; its bytes are only reachable through .bytes, never printed."""

    __slots__ = ("_bytes",)

    def __init__(self, data: bytes):
        if isinstance(data, str):
            data = data.encode("utf-8")
        self._bytes = bytes(data)

    @property
    def bytes(self) -> bytes:
        return self._bytes

    def __len__(self) -> int:
        return len(self._bytes)

    def __repr__(self) -> str:
        return f"Secret(<{len(self._bytes)} bytes>)"

    __str__ = __repr__


def _finish(raw: bytes, where: str) -> Secret:
    if raw.endswith(b"\r\n"):
        raw = raw[:-2]
    elif raw.endswith(b"\n"):
        raw = raw[:-1]
    if not raw:
        raise SecretError(f"{where} is empty")
    if len(raw) < MIN_SECRET_BYTES:
        raise SecretError(f"{where} is shorter than {MIN_SECRET_BYTES} bytes")
    return Secret(raw)


def load_secret_from_file(path: str) -> Secret:
    """Reads a secret from `path`; raises SecretError naming the path."""
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise SecretError(f"secret file '{path}': cannot read ({e.strerror})") from None
    return _finish(raw, f"secret file '{path}'")


def load_secret_from_env(name: str) -> Secret:
    """Reads a secret from environment variable `name`; raises SecretError naming it."""
    value = os.environb.get(name.encode()) if hasattr(os, "environb") else None
    if value is None:
        s = os.environ.get(name)
        value = None if s is None else s.encode("utf-8")
    if value is None:
        raise SecretError(f"environment variable {name} is not set")
    return _finish(value, f"environment variable {name}")


def server_proof(secret: Secret, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret.bytes, _SERVER_LABEL + client_nonce + server_nonce,
                    hashlib.sha256).digest()


def client_proof(secret: Secret, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret.bytes, _CLIENT_LABEL + server_nonce + client_nonce,
                    hashlib.sha256).digest()
