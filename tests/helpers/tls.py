"""Throwaway certificates for TLS and mTLS tests, made with the `openssl` command-line tool.

`make_pki(directory)` writes a CA, a server certificate signed by it (SAN IP:127.0.0.1 and
DNS:localhost), a client certificate signed by it, and a client certificate signed by another
("rogue") CA that the server must refuse. Keys are P-256 (fast to generate); everything is valid
for one day.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc

_CURVE = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes]:
        """(private key, certificate chain), as grpc wants them."""
        return self.key.read_bytes(), self.cert.read_bytes()


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: KeyPair
    client: KeyPair
    rogue_client: KeyPair

    def channel_credentials(self, client: KeyPair | None = None) -> grpc.ChannelCredentials:
        """Credentials trusting the CA, presenting `client`'s certificate if given."""
        key, chain = client.read() if client else (None, None)
        return grpc.ssl_channel_credentials(self.ca.read_bytes(), key, chain)


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def _make_ca(directory: Path, name: str) -> KeyPair:
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.key")
    _openssl(
        "req", "-x509", *_CURVE, "-keyout", pair.key, "-out", pair.cert, "-days", "1",
        "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return pair


def _make_leaf(directory: Path, name: str, ca: KeyPair, extensions: str) -> KeyPair:
    pair = KeyPair(directory / f"{name}.pem", directory / f"{name}.key")
    csr, ext = directory / f"{name}.csr", directory / f"{name}.ext"
    ext.write_text(extensions)
    _openssl("req", *_CURVE, "-keyout", pair.key, "-out", csr, "-subj", f"/CN={name}")
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca.cert, "-CAkey", ca.key,
        "-set_serial", str(secrets.randbits(63)), "-days", "1", "-sha256",
        "-extfile", ext, "-out", pair.cert,
    )  # fmt: skip
    return pair


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _make_ca(directory, "test-ca")
    rogue_ca = _make_ca(directory, "rogue-ca")
    leaf = "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
    server = _make_leaf(
        directory,
        "server",
        ca,
        leaf + "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n",
    )
    client = _make_leaf(directory, "client", ca, leaf + "extendedKeyUsage=clientAuth\n")
    rogue = _make_leaf(directory, "rogue-client", rogue_ca, leaf + "extendedKeyUsage=clientAuth\n")
    return Pki(ca=ca.cert, server=server, client=client, rogue_client=rogue)


def encrypted_key(key: Path, directory: Path) -> Path:
    """A copy of `key` protected by a pass phrase (which nothing here can give)."""
    target = directory / f"encrypted-{key.name}"
    _openssl("pkey", "-in", key, "-out", target, "-aes256", "-passout", "pass:not-given")
    return target
