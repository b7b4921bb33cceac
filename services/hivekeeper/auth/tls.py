"""The token service's TLS, pinned to the swarm's key.

The gateway serves a self-signed certificate for the swarm's own signing key, made at start
(and remade before it runs out). There is no CA: every invite carries the fingerprint of the
swarm's public key (SHA-256 of its SubjectPublicKeyInfo DER, base64url), and a client trusts
the gateway whose certificate holds that key, whatever address it dials. Python's gRPC has no
verification callback, so the client fetches the certificate first, checks its key, then
opens a gRPC channel that trusts exactly that certificate. The gap between the two is
harmless: the channel's own handshake accepts no other certificate.

No hivemind here: the operator mints invites (and so takes fingerprints) without it."""

from __future__ import annotations

import base64
import hashlib
import socket
import ssl
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import NameOID

GATEWAY_TLS_NAME = "hivekeeper-gateway"  # the certificate's DNS name: clients ask for it whatever they dial
CERTIFICATE_DAYS = 30.0
BACKDATE = timedelta(hours=1)  # a client whose clock runs a little behind still accepts a new certificate


def key_fingerprint(key: Any) -> str:
    """SHA-256 of a public key's SubjectPublicKeyInfo DER, base64url without padding. `key` is
    a `cryptography` public key, or any key whose `to_bytes()` is its OpenSSH form (hivemind's
    RSAPublicKey, the operator's signing key)."""
    if not hasattr(key, "public_bytes"):
        key = serialization.load_ssh_public_key(key.to_bytes())
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()


def certificate_fingerprint(pem: bytes) -> str:
    """The fingerprint of the public key in a PEM certificate (see `key_fingerprint`)."""
    return key_fingerprint(x509.load_pem_x509_certificate(pem).public_key())


def self_signed_certificate(key: rsa.RSAPrivateKey, days: float = CERTIFICATE_DAYS,
                            now: float | None = None) -> bytes:
    """A PEM certificate for `key`, signed by itself, for GATEWAY_TLS_NAME."""
    start = datetime.fromtimestamp(time.time() if now is None else now, timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, GATEWAY_TLS_NAME)])
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start - BACKDATE).not_valid_after(start + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(GATEWAY_TLS_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256()))
    return certificate.public_bytes(serialization.Encoding.PEM)


def private_key_pem(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


class RotatingCertificate:
    """The gateway's certificate: remade once half its validity has passed, so that a gateway
    that runs for months never serves an expired one. `current()` is what to serve now, and
    `renewed()` is gRPC's per-connection fetcher: the new (key PEM, certificate PEM) pair, or
    None to keep the current one. A client that fetched the old certificate an instant before
    the swap fails its handshake with UNAVAILABLE and, like any unavailable gateway, retries."""

    def __init__(self, key: rsa.RSAPrivateKey, days: float = CERTIFICATE_DAYS,
                 clock: Callable[[], float] = time.time):
        self.key_pem, self.days, self.clock = private_key_pem(key), days, clock
        self._key = key
        self._lock = threading.Lock()
        self._make(clock())

    def _make(self, now: float) -> None:
        self.certificate = self_signed_certificate(self._key, self.days, now)
        self.renew_at = now + self.days * 86400 / 2

    def current(self) -> tuple[bytes, bytes]:
        return self.key_pem, self.certificate

    def renewed(self) -> tuple[bytes, bytes] | None:
        with self._lock:  # gRPC calls it from its own threads, once per new connection
            now = self.clock()
            if now < self.renew_at:
                return None
            self._make(now)
            return self.current()


class NotTLS(Exception):
    """The address answered, but not with a TLS handshake (a plaintext server, say)."""


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT or [IPV6]:PORT, as gRPC dials it; ValueError otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host, int(port)


def fetch_certificate(address: str, timeout: float) -> bytes:
    """The PEM certificate the TLS server at HOST:PORT presents, unverified (the caller pins
    it). OSError (including socket.timeout) when nothing answers in time or the connection
    drops; NotTLS when something answers that does not speak TLS."""
    host, port = split_address(address)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # by design: the certificate is judged by its key's fingerprint
    context.set_alpn_protocols(["h2"])  # as a gRPC client would say
    with socket.create_connection((host, port), timeout=timeout) as raw:
        try:
            with context.wrap_socket(raw, server_hostname=GATEWAY_TLS_NAME) as tls:
                der = tls.getpeercert(binary_form=True)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError):
            raise  # the connection dropped mid-handshake: an OSError like any other
        except ssl.SSLError as e:
            raise NotTLS(f"no TLS handshake ({e.reason or e})") from None
    if not der:
        raise NotTLS("the server presented no certificate")
    return ssl.DER_cert_to_PEM_cert(der).encode()
