"""The control plane between nodes (runtime.curve): a real CURVE handshake on 127.0.0.1 in which
a peer with the job's key is answered and one without it is refused by the ZAP handler."""

from __future__ import annotations

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from runtime.curve import Gatekeeper, KeyPair, dial, route_to, serve

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    ctx = zmq.Context()
    keys, member = KeyPair.new(), KeyPair.new()
    gate = Gatekeeper(ctx, allowed=[member.public])
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    endpoint = serve(sock, keys, "127.0.0.1")
    yield ctx, sock, endpoint, keys, member
    gate.close()
    ctx.destroy(linger=0)  # closes what a failed test left open too (term() would wait for it forever)


def handshake(ctx: zmq.Context, client: KeyPair | None, server_public: bytes, endpoint: str) -> tuple[zmq.Socket, int]:
    """A DEALER that connects (with CURVE when `client` is given) and the first handshake
    outcome its monitor reports."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    # a refused peer may also see its connection drop, before or after the handshake's verdict
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    if client is None:
        sock.connect(endpoint)
    else:
        dial(sock, client, server_public, endpoint)
    assert monitor.poll(5000), "no handshake outcome within 5 s"
    event = recv_monitor_message(monitor)["event"]
    sock.disable_monitor()
    monitor.close(linger=0)
    return sock, event


def handshake_succeeds(ctx: zmq.Context, client: KeyPair | None, server_public: bytes, endpoint: str,
                       within_s: float = 2.0) -> bool:
    """Whether a DEALER (with CURVE when `client` is given) finishes a handshake within `within_s`.
    A peer with a wrong server key, or none, gets no verdict to wait for: the server drops its
    connection, or never answers."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED)
    if client is None:
        sock.connect(endpoint)
    else:
        dial(sock, client, server_public, endpoint)
    ok = monitor.poll(int(within_s * 1000)) and recv_monitor_message(monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
    sock.disable_monitor()
    monitor.close(linger=0)
    sock.close()
    return bool(ok)


def test_a_peer_with_the_jobs_key_is_answered(server):
    ctx, router, endpoint, keys, member = server
    sock, event = handshake(ctx, member, keys.public, endpoint)
    assert event == zmq.EVENT_HANDSHAKE_SUCCEEDED
    sock.send(b"ping")
    assert router.poll(5000)
    ident, body = router.recv_multipart()
    assert body == b"ping"
    router.send_multipart([ident, b"pong"])
    assert sock.poll(5000) and sock.recv() == b"pong"
    sock.close()


def test_a_peer_without_the_jobs_key_is_refused(server):
    ctx, router, endpoint, keys, _ = server
    stranger, event = handshake(ctx, KeyPair.new(), keys.public, endpoint)  # knows the public server key
    assert event == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    try:  # queued while the refused connection is still up, else there is none to queue it on
        stranger.send(b"let me in", zmq.NOBLOCK)
    except zmq.Again:
        pass
    assert not router.poll(300), "a message of a refused peer reached the server"
    stranger.close()


def test_a_peer_guessing_the_server_key_or_without_curve_never_finishes_a_handshake(server):
    ctx, _, endpoint, keys, member = server
    assert handshake_succeeds(ctx, member, keys.public, endpoint)
    assert not handshake_succeeds(ctx, member, KeyPair.new().public, endpoint, within_s=1.0)
    assert not handshake_succeeds(ctx, None, keys.public, endpoint, within_s=1.0)


def test_a_peer_without_curve_is_refused(server):
    ctx, router, endpoint, _, _ = server
    plain = ctx.socket(zmq.DEALER)
    plain.linger = 0
    plain.connect(endpoint)
    plain.send(b"hello")
    assert not router.poll(500), "a plaintext peer's message reached a CURVE server"
    plain.close()


def test_a_wildcard_bind_is_refused():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(ValueError, match="wildcard.*--node-ip"):
            serve(sock, KeyPair.new(), "0.0.0.0")
    finally:
        sock.close(linger=0)
        ctx.term()


def test_the_default_bind_address_is_the_route_to_node_0():
    assert route_to("127.0.0.1") == "127.0.0.1"
