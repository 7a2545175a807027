"""Encrypted reasoning for the Responses API: the `encrypted_content` of a reasoning item, a token
of the reasoning text that this server alone can mint and read back.

Python's standard library has no cipher and `cryptography` is not a dependency, so a token is
authenticated, not secret: "tfr1." + base64url(zlib(text) + HMAC-SHA256(key, "tfr1." + zlib(text))).
Anyone holding it can decode the text (it was in the reply anyway); nobody without the key can
make one this server accepts, so a client cannot put words into the model's past reasoning.
The comparison is constant-time (hmac.compare_digest).

The key is 32 random bytes: kept in the --response-store SQLite file, or in a key file, so that
tokens survive a restart; else made per process (tokens die with it). Randomness comes from the
os (secrets.token_bytes) once, when a key is made.
"""
import base64
import binascii
import hashlib
import hmac
import os
import secrets
import zlib

from tensorfold.api.errors import ApiError

PREFIX = "tfr1."
KEY_BYTES = 32
TAG_BYTES = 32
MAX_TEXT = 16 << 20  # decompressed bytes a token may hold


class ReasoningSealer:
    """seal(text) -> token; open(token, at) -> text, or a 400 whose param is `at`."""

    def __init__(self, key: bytes):
        if len(key) < 16:
            raise ValueError("the reasoning key must be at least 16 bytes")
        self._key = key

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self._key, PREFIX.encode() + body, hashlib.sha256).digest()

    def seal(self, text: str) -> str:
        body = zlib.compress(text.encode("utf-8"))
        return PREFIX + base64.urlsafe_b64encode(body + self._tag(body)).decode("ascii")

    def open(self, token: object, at: str) -> str:
        refused = ApiError(f"'{at}' is not reasoning this server encrypted (it was altered, or made by another "
                           "server or with another key)", param=at, code="invalid_encrypted_content")
        if not isinstance(token, str) or not token.startswith(PREFIX):
            raise refused
        try:
            raw = base64.urlsafe_b64decode(token[len(PREFIX):].encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            raise refused from None
        body, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
        if len(raw) <= TAG_BYTES or not hmac.compare_digest(tag, self._tag(body)):
            raise refused
        inflate = zlib.decompressobj()
        text = inflate.decompress(body, MAX_TEXT)
        if inflate.unconsumed_tail:
            raise ApiError(f"'{at}' holds more than {MAX_TEXT} bytes of reasoning", param=at)
        return text.decode("utf-8")


def key_from_file(path: str) -> bytes:
    """The key in `path` (hex), made there (mode 0600) when the file does not exist."""
    try:
        with open(path) as f:
            return bytes.fromhex(f.read().strip())
    except FileNotFoundError:
        key = secrets.token_bytes(KEY_BYTES)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key.hex() + "\n")
        return key


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)
