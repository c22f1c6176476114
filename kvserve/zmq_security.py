"""ZeroMQ CURVE for the sockets other machines may reach: KV events (PUB, replay ROUTER) and KV
transfer (the sender's ROUTER). One shared secret, `KVSERVE_ZMQ_SECRET` in every process's
environment, gives everyone the same two key pairs (scrypt of the secret): the server's and the
client's. A client must know the server's public key to finish CURVE's handshake, and a ZAP
handler on the server admits only the client public key, so a peer without the secret gets
nothing. A bind beyond loopback without a secret is refused (`ZmqSecurityError`); loopback and
ipc binds without one stay plain, as before.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import os
import socket as _socket
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvserve.errors import KVServeError

SECRET_ENV = "KVSERVE_ZMQ_SECRET"
MIN_SECRET_LENGTH = 16
_KDF_SALT = b"kvserve-zmq-curve-v1"  # a domain separator: the secret carries the entropy
_HOW_TO = (f"set {SECRET_ENV} to the same secret (at least {MIN_SECRET_LENGTH} characters, e.g. "
           f"`python -c 'import secrets; print(secrets.token_urlsafe(32))'`) in every server, "
           f"router and Ray node")


class ZmqSecurityError(KVServeError, ValueError):
    """A ZeroMQ socket would be reachable beyond loopback without a shared secret, or the
    secret given is too short."""


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """Both key pairs, z85-encoded as pyzmq's socket options take them. repr hides them."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return "CurveKeys(<derived from the shared secret>)"


def curve_keys(secret: str | None = None) -> CurveKeys | None:
    """The keys derived from `secret`, else from $KVSERVE_ZMQ_SECRET; None when neither is set
    (an empty variable counts as unset). A short secret is a ZmqSecurityError."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV) or None
    if secret is None:
        return None
    if len(secret) < MIN_SECRET_LENGTH:
        raise ZmqSecurityError(f"{SECRET_ENV} has {len(secret)} characters: too short to stand "
                               f"against guessing; {_HOW_TO}")
    return _derive(secret)


@functools.lru_cache(maxsize=4)
def _derive(secret: str) -> CurveKeys:
    """scrypt (~50 ms, once per process) makes each guess at the secret costly; X25519 clamps
    any 32 bytes into a valid secret key, so the halves are used as they are."""
    material = hashlib.scrypt(secret.encode(), salt=_KDF_SALT, n=2**14, r=8, p=1, dklen=64)
    server_secret, client_secret = z85.encode(material[:32]), z85.encode(material[32:])
    return CurveKeys(zmq.curve_public(server_secret), server_secret,
                     zmq.curve_public(client_secret), client_secret)


# ---- which addresses need the secret ---------------------------------------------------------
def endpoint_host(endpoint: str) -> str | None:
    """tcp://host:port -> host (brackets removed); None for ipc:// and inproc:// (local)."""
    if not endpoint.startswith("tcp://"):
        return None
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    return host.strip("[]")


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host`: a loopback address, or a name whose addresses are
    all loopback. Wildcards, interface names and unresolvable names are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = _socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback
                               for info in infos)


def require_secret(address: str, what: str, keys: CurveKeys | None) -> None:
    """Refuse to bind `address` (a ZeroMQ endpoint or a host) beyond loopback without keys."""
    host = endpoint_host(address) if "://" in address else address
    if keys is None and host is not None and not is_loopback(host):
        raise ZmqSecurityError(f"{what} {address!r} is reachable beyond this machine, and "
                               f"anyone who connects could read or pull KV data: {_HOW_TO}, "
                               f"or bind to 127.0.0.1")


# ---- sockets -----------------------------------------------------------------------------------
class _OnlyOurClient:
    """ZAP credentials check: the client key derived from the secret, no other."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def start_authenticator(context: zmq.Context, keys: CurveKeys | None
                        ) -> ThreadAuthenticator | None:
    """With keys: a ZAP handler on `context` admitting only our client key (start it before
    binding; stop it before terminating the context). Without: None."""
    if keys is None:
        return None
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_OnlyOurClient(keys.client_public))
    return auth


def make_server(socket: zmq.Socket, keys: CurveKeys | None) -> None:
    """A CURVE server socket (before it binds); plain without keys."""
    if keys is not None:
        socket.curve_secretkey = keys.server_secret
        socket.curve_publickey = keys.server_public
        socket.curve_server = True


def make_client(socket: zmq.Socket, keys: CurveKeys | None) -> None:
    """A CURVE client socket (before it connects); plain without keys."""
    if keys is not None:
        socket.curve_secretkey = keys.client_secret
        socket.curve_publickey = keys.client_public
        socket.curve_serverkey = keys.server_public
