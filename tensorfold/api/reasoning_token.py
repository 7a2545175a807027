"""Encrypted reasoning for the Responses API: the `encrypted_content` of a reasoning item, an
opaque token of the reasoning text that this server alone can read back.

    token = "tfr2." + base64url(nonce + AES-256-GCM(key, nonce, zlib(text), aad="tfr2."))

The cipher is `cryptography`'s AESGCM (never hand-written crypto). The nonce is synthetic:
the first 12 bytes of HMAC-SHA256(key, zlib(text)), so the same reasoning under the same key
seals to the same token (a reply stays a pure function of its request) and two different texts
never share a nonce; equal tokens reveal only that the texts are equal. GCM's tag makes a
changed or foreign token fail to open: a 400 naming the item.

The key is 32 random bytes: kept in the --response-store SQLite file, or in a key file, so that
tokens survive a restart; else made per process (tokens die with it). Randomness comes from the
OS (secrets.token_bytes) once, when a key is made.
"""
import base64
import binascii
import hashlib
import hmac
import os
import secrets
import zlib

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from tensorfold.api.errors import ApiError

PREFIX = "tfr2."
KEY_BYTES = 32
NONCE_BYTES = 12
MAX_TEXT = 16 << 20  # decompressed bytes a token may hold


class ReasoningSealer:
    """seal(text) -> token; open(token, at) -> text, or a 400 whose param is `at`."""

    def __init__(self, key: bytes):
        if len(key) != KEY_BYTES:
            raise ValueError(f"the reasoning key must be {KEY_BYTES} bytes")
        self._key = key
        self._aead = AESGCM(key)

    def seal(self, text: str) -> str:
        body = zlib.compress(text.encode("utf-8"))
        nonce = hmac.new(self._key, body, hashlib.sha256).digest()[:NONCE_BYTES]
        sealed = self._aead.encrypt(nonce, body, PREFIX.encode())
        return PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def open(self, token: object, at: str) -> str:
        refused = ApiError(f"'{at}' is not reasoning this server encrypted (it was altered, or made by another "
                           "server or with another key)", param=at, code="invalid_encrypted_content")
        if not isinstance(token, str) or not token.startswith(PREFIX):
            raise refused
        try:
            text64 = token[len(PREFIX):].encode("ascii")
            raw = base64.urlsafe_b64decode(text64)
            if base64.urlsafe_b64encode(raw) != text64:  # one spelling per token: padding bits count too
                raise ValueError("not canonical base64")
            body = self._aead.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], PREFIX.encode())
        except (binascii.Error, ValueError, UnicodeEncodeError, InvalidTag):
            raise refused from None
        inflate = zlib.decompressobj()
        try:
            text = inflate.decompress(body, MAX_TEXT)
        except zlib.error:
            raise refused from None
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
