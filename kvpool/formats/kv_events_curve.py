"""ZMQ CURVE for the KV event socket: who may subscribe, and encryption on the wire.

The events carry every tenant's block hashes (and, with `include_token_ids`, their prompts),
so a replica can require CURVE: its PUB socket is a CURVE server holding the replica's secret
key, and a ZAP handler (pyzmq's thread authenticator) admits only subscribers whose public key
is on the replica's list; anyone else completes no handshake and receives nothing.

    replica   kv_events_config {"curve_secret_key_file": "replica.key_secret",
                                "curve_client_keys": ["<router's public key>", ...]}
    router    --kv-events-curve-secret-key-file router.key_secret
              (the replica's public key comes from GET /v1/kv/events "curve_public_key")

Keys are pyzmq's certificate files (`zmq.auth.create_certificates`, or `generate_key_pair`
here): a public file holds the public key, a secret file both. A public key may also be given
as its 40-character Z85 text. This module imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

__all__ = ["AllowedKeys", "generate_key_pair", "load_public_key", "load_secret_key",
           "make_curve_client", "make_curve_server", "start_authenticator"]

Z85_KEY_CHARS = 40  # a 32-byte key in Z85 text


def generate_key_pair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write `name.key` (public) and `name.key_secret` (both keys, mode 0600) in
    `directory`; returns (public file, secret file)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, name)
    Path(secret_file).chmod(0o600)
    return Path(public_file), Path(secret_file)


def load_secret_key(path: str | Path) -> tuple[bytes, bytes]:
    """(public key, secret key), Z85, from a secret certificate file; ValueError if the file
    is missing, unreadable or holds no secret key."""
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read the CURVE secret key file {str(path)!r}: {error}") from None
    if not secret:
        raise ValueError(f"{str(path)!r} holds no CURVE secret key (a public key file?)")
    return public, secret


def load_public_key(value: str) -> bytes:
    """A public key, Z85: `value` itself when it is 40 Z85 characters, else the public key in
    the certificate file it names; ValueError otherwise."""
    if len(value) == Z85_KEY_CHARS and not Path(value).exists():
        try:
            zmq.utils.z85.decode(value)
        except (ValueError, KeyError, IndexError):
            raise ValueError(f"{value!r} is not a Z85 CURVE public key") from None
        return value.encode("ascii")
    try:
        return zmq.auth.load_certificate(value)[0]
    except (OSError, ValueError) as error:
        raise ValueError(f"{value!r} is neither a Z85 CURVE public key nor a key file: "
                         f"{error}") from None


class AllowedKeys:
    """The ZAP handler's question, answered: is this subscriber's key on the list?"""

    def __init__(self, public_keys: Iterable[bytes]) -> None:
        self._keys = frozenset(public_keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self._keys


def start_authenticator(context: zmq.Context, client_keys: Iterable[str]) -> ThreadAuthenticator:
    """A running ZAP handler on `context` admitting only `client_keys` (Z85 text or files);
    stop it before terminating the context."""
    allowed = AllowedKeys(load_public_key(key) for key in client_keys)
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_curve_callback("*", allowed)
    return authenticator


def make_curve_server(socket: zmq.Socket, secret_key_file: str | Path) -> bytes:
    """Make `socket` (not yet bound) a CURVE server with this key; returns its public key."""
    public, secret = load_secret_key(secret_key_file)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_server = True
    return public


def make_curve_client(socket: zmq.Socket, secret_key_file: str | Path,
                      server_public_key: str) -> None:
    """Make `socket` (not yet connected) a CURVE client of the server with that key."""
    public, secret = load_secret_key(secret_key_file)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = load_public_key(server_public_key)
