"""CurveZMQ for a job: one keypair per job, handed to every process through the environment.

Design decisions:
- `cluster.auth = "curve"`: the node daemon makes a keypair (`zmq.curve_keypair()`) unless its
  environment already holds one, and puts it in every child's environment as z85 text
  (`MILES_CURVE_PUBLIC`, `MILES_CURVE_SECRET`), never on a command line, where `ps` would show it.
  Every node of a multi-node job must share the key: the launcher exports one pair for all nodes
  (`eval $(python -m miles.wire.auth)` prints the two exports) before starting the daemons.
- Every actor inbox is a CURVE server with the job's secret key, and a ZAP handler in the
  process (pyzmq's `ThreadAuthenticator`) admits exactly the job's public key; every connection is
  a CURVE client with the job keypair and the (same) public key as the server's. A peer without
  the key fails the handshake inside ZeroMQ: it gets no reply, and the actor sees nothing.
- The ZAP handler is consulted once per connection handshake, never per message.
- With auth off nothing here runs, and sockets are exactly as without this module.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Mapping, NamedTuple

import zmq

CURVE_PUBLIC_ENV = "MILES_CURVE_PUBLIC"
CURVE_SECRET_ENV = "MILES_CURVE_SECRET"
ZAP_DOMAIN = "miles"


class CurveKeys(NamedTuple):
    public: bytes   # z85, 40 characters
    secret: bytes

    def env(self) -> dict[str, str]:
        return {CURVE_PUBLIC_ENV: self.public.decode(), CURVE_SECRET_ENV: self.secret.decode()}


def keys_from_env(env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The job keypair from the environment, None when it holds none; a half or broken pair is
    an error naming the variable."""
    env = os.environ if env is None else env
    public, secret = env.get(CURVE_PUBLIC_ENV), env.get(CURVE_SECRET_ENV)
    if public is None and secret is None:
        return None
    if not public or not secret:
        missing = CURVE_PUBLIC_ENV if not public else CURVE_SECRET_ENV
        raise ValueError(f"{missing} is not set but its pair is: export both keys or neither")
    try:
        derived = zmq.curve_public(secret.encode())
    except (ValueError, zmq.ZMQError) as e:
        raise ValueError(f"{CURVE_SECRET_ENV}: not a z85 CurveZMQ secret key ({e})") from None
    if derived != public.encode():
        raise ValueError(f"{CURVE_PUBLIC_ENV} does not belong to {CURVE_SECRET_ENV}: "
                         "export the two halves of one keypair")
    return CurveKeys(public.encode(), secret.encode())


def job_keys(auth: str, env: Mapping[str, str] | None = None) -> CurveKeys | None:
    """The keys for `cluster.auth`: None for "none"; for "curve" the environment's pair, else a
    fresh one."""
    if auth == "none":
        return None
    if auth != "curve":
        raise ValueError(f"cluster.auth = {auth!r}: expected 'none' or 'curve'")
    return keys_from_env(env) or CurveKeys(*zmq.curve_keypair())


def set_child_env(env: dict[str, str], keys: CurveKeys | None) -> None:
    """Give a child the job keys, or none at all when auth is off."""
    env.pop(CURVE_PUBLIC_ENV, None)
    env.pop(CURVE_SECRET_ENV, None)
    if keys is not None:
        env.update(keys.env())


def make_server(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.zap_domain = ZAP_DOMAIN.encode()


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = keys.public


class _OnlyJobKey:
    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


def start_authenticator(ctx: zmq.Context, keys: CurveKeys):
    """The process's ZAP handler: admits clients holding the job's public key, no one else."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_OnlyJobKey(keys.public))
    return auth


if __name__ == "__main__":  # `eval $(python -m miles.wire.auth)`: one job key for every node
    for k, v in CurveKeys(*zmq.curve_keypair()).env().items():
        sys.stdout.write(f"export {k}={shlex.quote(v)}\n")
