"""Tokens and TLS roots, read as the grpo commands read them (services/auth.cc)."""

from __future__ import annotations

import os
from pathlib import Path

from grpo_serve.errors import GrpoServeError

PathLike = str | os.PathLike[str]


def check_token(token: str, what: str = "token") -> str:
    """`token` with trailing whitespace dropped; GrpoServeError unless it is printable ASCII.

    gRPC metadata carries only bytes 0x20-0x7e; the learner refuses any other (auth.cc).
    """
    token = token.rstrip()
    if not token:
        raise GrpoServeError(f"{what} is empty")
    for i, ch in enumerate(token):
        if not 0x20 <= ord(ch) <= 0x7E:
            byte = ch.encode("utf-8", "surrogateescape")[0]
            raise GrpoServeError(f"{what} holds byte 0x{byte:02x} at offset {i}: a token must be "
                                 "printable ASCII (gRPC metadata)")
    return token


def read_token_file(path: PathLike, key: str = "auth_token_file") -> str:
    """The token in the file `path`, checked as check_token does."""
    what = f"{key} {os.fspath(path)}"
    p = Path(path)
    if p.is_dir():
        raise GrpoServeError(f"{what} is a directory, not a token file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise GrpoServeError(f"cannot read {what}: {e.strerror}") from e
    return check_token(raw.decode("latin-1"), what)


def resolve_token(token: str | None, token_file: PathLike | None,
                  key: str = "auth_token_file") -> str:
    """The token given directly or in a file (not both); empty for none."""
    if token is not None and token_file is not None:
        raise GrpoServeError("give token or token_file, not both")
    if token_file is not None:
        return read_token_file(token_file, key)
    if token is not None:
        return check_token(token)
    return ""


def read_pem(ca: PathLike | bytes, key: str = "tls_ca") -> bytes:
    """The PEM roots: `ca` itself when bytes, else the file it names."""
    if isinstance(ca, bytes):
        pem, what = ca, key
    else:
        what = f"{key} {os.fspath(ca)}"
        try:
            pem = Path(ca).read_bytes()
        except OSError as e:
            raise GrpoServeError(f"cannot read {what}: {e.strerror}") from e
    if b"-----BEGIN " not in pem:
        raise GrpoServeError(f"{what} holds no PEM block")
    return pem
