"""ZeroMQ CURVE on the tcp sockets between nodes: each node makes a key pair per job, the
public keys travel through the rendezvous store (runtime.rendezvous), and a ZAP handler lets
in only peers whose public key is one of the job's. Traffic is encrypted and a peer without a
job key is refused in the handshake, before any message reaches our code.

CURVE alone checks only that the client knows the server's public key, which the store
holds in the clear; the ZAP handler (zmq.auth.thread, consulted by every CURVE server socket
of its context) is what refuses a client whose own key is not the job's.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from dataclasses import dataclass
from typing import Iterable

import psutil
import zmq
import zmq.auth.thread

WILDCARDS = ("0.0.0.0", "::", "*", "")


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes: published in the rendezvous store
    secret: bytes  # Z85, 40 bytes: never leaves this process

    @classmethod
    def new(cls) -> "KeyPair":
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq's libzmq was built without CURVE (libsodium); "
                               "install a pyzmq wheel, which bundles it")
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


class Gatekeeper:
    """The ZAP handler of a context: CURVE clients whose public key is in `allowed` get in,
    every other is refused. Runs a thread until close()."""

    def __init__(self, ctx: zmq.Context, allowed: Iterable[bytes] = ()):
        self._allowed = set(allowed)
        self._lock = threading.Lock()
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def allow(self, public_key: bytes) -> None:
        with self._lock:
            self._allowed.add(public_key)

    def callback(self, domain: str, public_key: bytes) -> bool:
        """zmq.auth.base.Authenticator._authenticate_curve calls it with the client's Z85 key."""
        with self._lock:
            return public_key in self._allowed

    def close(self) -> None:
        self._auth.stop()


def serve(sock: zmq.Socket, keys: KeyPair, host: str, port: int = 0) -> str:
    """Make `sock` a CURVE server with `keys` and bind it to tcp://host:port (port 0: one the
    OS picks); returns the endpoint peers connect to. A wildcard host is refused."""
    check_bind_host(host)
    host = numeric(host)  # libzmq binds to an address or an interface name, not a host name
    make_server(sock, keys)
    if port:
        sock.bind(f"tcp://{_bracket(host)}:{port}")
    else:
        sock.bind_to_random_port(f"tcp://{_bracket(host)}")
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def make_server(sock: zmq.Socket, keys: KeyPair) -> None:
    """Make `sock` a CURVE server with `keys`; set before it binds."""
    sock.curve_server = True
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public


def connect(sock: zmq.Socket, endpoint: str, job_keys: KeyPair | None) -> None:
    """Connect `sock` to `endpoint`: as a CURVE client with the job's keys when the job has them
    and the endpoint is tcp (ipc stays within a host, guarded by the socket folder's mode)."""
    if job_keys is not None and endpoint.startswith("tcp://"):
        dial(sock, job_keys, job_keys.public, endpoint)
    else:
        sock.connect(endpoint)


def dial(sock: zmq.Socket, keys: KeyPair, server_public: bytes, endpoint: str) -> None:
    """Connect `sock` as a CURVE client with `keys` to a server known by its public key."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
    sock.connect(endpoint)


def check_bind_host(host: str) -> None:
    if host in WILDCARDS:
        raise ValueError(f"bind address {host!r}: a wildcard would listen on every interface; give this "
                         "node's address on the job's network (--node-ip)")


def route_to(master_addr: str, port: int = 9) -> str:
    """This host's address on the route to `master_addr`: the address a node binds by default.
    A UDP connect sends nothing; it only asks the kernel which interface it would use."""
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        infos = socket.getaddrinfo(master_addr, port, family, socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ValueError(f"--master-addr {master_addr!r}: cannot resolve it ({e.strerror})") from None
    with socket.socket(infos[0][0], socket.SOCK_DGRAM) as s:
        s.connect(infos[0][4])
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds `address`; None when none does."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)):
            return name
    return None


def numeric(host: str) -> str:
    """`host` as an IP address (a host name resolved, IPv4 first: the supervisor's tcp endpoints
    are written without IPv6 brackets)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        raise ValueError(f"address {host!r}: cannot resolve it ({e.strerror})") from None
    return min(infos, key=lambda info: info[0] != socket.AF_INET)[4][0]


def _bracket(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a host name
        return host
