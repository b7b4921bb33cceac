"""The swarm's signing key: an RSA key in a PEM file that signs invites and access tokens."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey


def load_or_create_swarm_key(path: str | Path) -> RSAPrivateKey:
    """The key at `path`, made first if there is none (mode 0600). Creation is atomic: a
    reader never sees half a file, and of two processes racing to create it, both end up with
    the one that landed first."""
    path = Path(path)
    if path.exists():
        return load_swarm_key(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # unlike rename, fails if someone else created it meanwhile
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
    return load_swarm_key(path)


def load_swarm_key(path: str | Path) -> RSAPrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: not an RSA private key")
    return wrap_private_key(key)


def wrap_private_key(key: rsa.RSAPrivateKey) -> RSAPrivateKey:
    """hivemind's RSAPrivateKey around an existing key (its constructor always makes a new one);
    its pickling hook is the supported way in."""
    wrapped = RSAPrivateKey.__new__(RSAPrivateKey)
    wrapped.__setstate__({"_private_key": key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())})
    return wrapped


def unwrap_private_key(key: RSAPrivateKey) -> rsa.RSAPrivateKey:
    """The `cryptography` key inside hivemind's RSAPrivateKey (for X.509: the gateway's certificate)."""
    # validated when it was loaded; checking it again costs a tenth of a second or more
    unwrapped = serialization.load_der_private_key(key.to_bytes(), password=None, unsafe_skip_rsa_key_validation=True)
    if not isinstance(unwrapped, rsa.RSAPrivateKey):
        raise ValueError("not an RSA private key")
    return unwrapped


def public_key_text(key: RSAPublicKey) -> str:
    """The OpenSSH form ("ssh-rsa AAAA..."), as tokens and the gateway carry public keys."""
    return key.to_bytes().decode()


def load_swarm_public_key(source: str | Path) -> RSAPublicKey:
    """The swarm's public key from a file: its OpenSSH form, or the private key's PEM file."""
    data = Path(source).read_bytes()
    if data.lstrip().startswith(b"ssh-rsa "):
        return RSAPublicKey.from_bytes(data.strip())
    return load_swarm_key(source).get_public_key()
