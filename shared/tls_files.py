"""What is wrong with PEM files given for TLS, found before grpc uses them: grpc takes any bytes,
then fails every connection (or the listening port) without saying why, and OpenSSL, asked to
load a key protected by a pass phrase, would prompt for it on the terminal and wait."""

from __future__ import annotations

import ssl

ENCRYPTED_KEY = "the private key is encrypted (pass-phrase protected), which grpc cannot use"


class _PassPhraseAsked(Exception):
    pass


def _refuse_pass_phrase() -> bytes:
    raise _PassPhraseAsked


def ca_error(path: str) -> str | None:
    """Why `path` is not a PEM CA bundle (OpenSSL's reason), or None when it is one."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(path)
    except ssl.SSLError as error:
        return str(error.reason or error)
    return None


def key_pair_error(cert: str, key: str) -> str | None:
    """Why `cert` and `key` are not a PEM certificate and its unencrypted private key, or None."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=_refuse_pass_phrase)
    except _PassPhraseAsked:
        return ENCRYPTED_KEY
    except ssl.SSLError as error:
        return str(error.reason or error)
    return None
