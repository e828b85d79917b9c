"""Shared-secret authentication of the bus (docs/wire-format.md, section 5).

The secret is loaded from a file or an environment variable with the C++ rules
(transport/auth.cc): one trailing "\\n" or "\\r\\n" is removed, and it must be at least 16 bytes.
It is held in a Secret, whose repr never shows the bytes; errors name the file or variable,
never the content. load_secret() applies the worker's lookup order (a file, $PARAPILOT_SECRET_FILE,
then $PARAPILOT_SECRET) and says how to provide a secret when there is none.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Optional

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
    """Reads a secret from `path`; raises SecretError naming the path when it cannot be read, is
    open to other users (any of the mode's "other" bits: chmod 600 it), is empty or too short."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            raw = f.read(1 << 20)
    except OSError as e:
        raise SecretError(f"secret file '{path}': cannot read ({e.strerror})") from None
    if mode & stat.S_IRWXO:
        raise SecretError(f"secret file '{path}' is open to other users (mode "
                          f"{stat.S_IMODE(mode):04o}): make it private with chmod 600 '{path}'")
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


def secret_help(secret_env: str = "PARAPILOT_SECRET",
                file_env: str = "PARAPILOT_SECRET_FILE") -> str:
    """How to provide the bus secret (one sentence, for error messages)."""
    return (f"set {file_env} to a file holding the secret `parapilot deploy` was given with "
            f"--secret-file (make one with `head -c 32 /dev/urandom | base64 > secret && "
            f"chmod 600 secret`), or "
            f"{secret_env} to the secret itself (at least {MIN_SECRET_BYTES} bytes)")


def load_secret(secret_file: Optional[str] = None, secret_env: str = "PARAPILOT_SECRET",
                file_env: str = "PARAPILOT_SECRET_FILE") -> Secret:
    """The bus secret from `secret_file`, else the file named by $file_env, else the variable
    `secret_env`. Raises SecretError naming both variables and how to make a secret when none
    is set or the one found cannot be used (missing file, empty, too short)."""
    path = secret_file or os.environ.get(file_env)
    try:
        if path:
            return load_secret_from_file(path)
        if os.environ.get(secret_env) is None:
            raise SecretError(f"neither {file_env} nor {secret_env} is set")
        return load_secret_from_env(secret_env)
    except SecretError as e:
        raise SecretError(f"{e}; {secret_help(secret_env, file_env)}") from None


def server_proof(secret: Secret, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(secret.bytes, _SERVER_LABEL + client_nonce + server_nonce,
                    hashlib.sha256).digest()


def client_proof(secret: Secret, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret.bytes, _CLIENT_LABEL + server_nonce + client_nonce,
                    hashlib.sha256).digest()
