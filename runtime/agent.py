"""The node agent: on a node other than 0, the same Supervisor spawns and supervises the roles
on that node's GPUs, under node 0's driver (docs/multinode.md).

Node 0's driver holds a `RemoteNode` per other node; each node runs a `NodeAgent`. They talk
over one tcp channel: the agent's ROUTER, a CURVE server with the node's key pair that admits
node 0's public key only (both keys come from the rendezvous store, runtime.rendezvous), and a
DEALER in the driver. Over it node 0 sends, in its hello, signed under the job's secret
(runtime.signing) for this node and run, the job's secrets (the wire token and the job's CURVE
key pair, which the store must not carry), spawn requests (a role, or the node's slice of a
rank group), pings, and the stop of a slice whose group lost a rank elsewhere; the agent answers
with the spawned roles' addresses, heartbeats, each death or restart its supervisor sees, and
its roles' events for the monitor at node 0.

Calls do not go through the agent: the driver's caller dials the remote role's mailbox itself
(tcp, CURVE with the job's key), as it calls a local role. Either side that hears nothing from
the other for `heartbeat_timeout` seconds takes the other for lost: node 0 fails the calls to
that node's roles and raises NodeLost; the agent stops its roles and returns.

Messages are frames [kind, msgpack(payload), *wire frames]; a spawn request carries the role's
arguments in wire format, as Supervisor.spawn sends them to a child.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import msgpack
import zmq

from runtime import wire
from runtime.actor import endpoints_of
from runtime.curve import Gatekeeper, KeyPair, dial, serve
from runtime.errors import ActorDied, RuntimeActorError, SupervisionFailed
from runtime.events import follow_events
from runtime.handle import ActorHandle, Address
from runtime.memory import Grant, LeaseError
from runtime.rendezvous import NodeEntry
from runtime.signing import SECRET_ENV, JobSecret
from runtime.supervisor import Supervisor

logger = logging.getLogger(__name__)

TICK_S = 0.02  # how often each side's loop looks at its socket and its clock
SUPERSEDED_LOOK_S = 0.5  # how often a node waiting for node 0's hello asks the store for a newer start
# The events of a node that node 0's bus carries too (with node=R), so that the monitor attached
# at node 0 shows every node's roles and GPUs: its roles' lives, and its GPUs' leases and the
# bytes its roles report in their spans (`phase`). GPU ids stay the node's own; `node` tells them
# apart from node 0's (runtime.monitor, ppo.observe.trace).
NODE_EVENTS = frozenset({"spawned", "ready", "state", "died", "stopped", "restarted", "hung", "role_stats",
                         "lease", "phase"})
# The LeaseTable methods node 0 may call on a node's table (runtime.cluster.ClusterLeases).
LEASE_OPS = ("acquire", "acquire_all", "release", "release_all", "report", "holds", "holder", "same_lease",
             "forget", "drop_dead_memory")


class NodeLost(RuntimeActorError):
    """A node stopped answering, or its supervisor gave up; the message is one line."""


def _send(sock: zmq.Socket, kind: str, payload: dict, frames: Sequence[bytes] = (), ident: bytes | None = None,
          flags: int = 0):
    head = [ident] if ident is not None else []
    sock.send_multipart([*head, kind.encode(), msgpack.packb(payload, use_bin_type=True), *frames], flags)


def _aside(fn, *args) -> None:
    """Run `fn` in a thread of its own: stopping roles waits out their grace period, a spawn imports
    the role's modules, a wait for roles waits; none may hold up a channel whose silence the other
    side takes for a lost node."""
    threading.Thread(target=fn, args=args, name="tandem-node-aside", daemon=True).start()


class NodeAgent:
    """Node `rank`'s agent. Binds its channel at once (`endpoint`, to publish in the rendezvous
    store); `serve` then runs the node until node 0 stops the job or is lost."""

    def __init__(self, rank: int, keys: KeyPair, host: str, run_dir: str | os.PathLike, *,
                 gpus: Sequence[int] = (), fake_gpus: int = 0, fake_gpu_bytes: int = 80 << 30):
        self.rank, self.keys, self.host = rank, keys, host
        self.run_dir, self.gpus, self.fake_gpus, self.fake_gpu_bytes = Path(run_dir), gpus, fake_gpus, fake_gpu_bytes
        self._ctx = zmq.Context()
        self._gate = Gatekeeper(self._ctx)  # admits node 0 once the rendezvous names its key
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self.endpoint = serve(self._sock, keys, host)
        self.sup: Supervisor | None = None
        # what threads other than serve()'s have for node 0 (role events, answers to wait_ready):
        # (kind, payload), sent by the serve loop, the only one that touches the socket
        self._outbox: collections.deque[tuple[str, dict]] = collections.deque()

    def entry(self) -> NodeEntry:
        return NodeEntry(self.rank, self.endpoint, self.keys.public)

    def admit(self, node_0: NodeEntry) -> None:
        """Let node 0 (its public key) in; before this node's entry is published (rendezvous.meet)."""
        self._gate.allow(node_0.public_key)

    def serve(self, driver_key: bytes, hello_timeout_s: float, *, secret: JobSecret, run: str,
              superseded: Callable[[], bool] | None = None) -> str | None:
        """Run this node for node 0 (known by `driver_key`) until it says stop or goes silent;
        returns why it stopped, one line. Stops every role of the node and closes the agent
        before it returns. Node 0's hello must be signed under the job's `secret` for this node
        and `run` (the rendezvous'); one that is not is logged and dropped. `superseded()`,
        asked while no hello has come: true once the job has started again without the node 0
        met (Rendezvous.superseded); serve then returns None, for the node to meet again."""
        self._gate.allow(driver_key)
        driver, last_heard, timeout = None, time.monotonic(), hello_timeout_s
        known: dict[str, tuple[int, str | None]] = {}  # role: (incarnation, its death once reported)
        next_beat = next_look = 0.0
        try:
            while True:
                if self._sock.poll(int(TICK_S * 1000)):
                    ident, kind, payload, *frames = self._sock.recv_multipart()
                    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)  # {gpu: bytes} maps
                    if kind == b"hello" and self.sup is None and not self._signed(body, secret, run):
                        continue
                    driver, last_heard = ident, time.monotonic()
                    if kind == b"hello" and self.sup is None:
                        self.sup = self._start(body)
                        threading.Thread(target=self._follow, name="tandem-node-events", daemon=True).start()
                        timeout = body["heartbeat_timeout"]
                        _send(self._sock, "welcome", {"rank": self.rank}, ident=driver)
                    elif kind == b"spawn" and self.sup is not None:
                        # aside: unpickling the role's class imports its modules (transformers: seconds
                        # on a busy CPU), during which this loop must go on beating
                        _aside(lambda *a: self._outbox.append(("spawned", self._spawn(*a))), body, frames, known)
                    elif kind == b"lease" and self.sup is not None:
                        _send(self._sock, "answer", self._lease(body), ident=driver)
                    elif kind == b"wait_ready" and self.sup is not None:
                        _aside(self._wait_ready, body)
                    elif kind == b"stop_group" and self.sup is not None:
                        cause = ActorDied(body["role"], body["inc"], body["reason"])
                        _aside(self.sup.stop_group, body["group"], cause, body["incs"])
                    elif kind == b"respawn_group" and self.sup is not None:
                        _aside(lambda *a: self._outbox.append(("answer", self._respawn_group(*a))), body, known)
                    elif kind == b"stop":
                        return f"node 0 stopped the job: {body.get('reason', '')}".rstrip(": ")
                now = time.monotonic()
                if self.sup is None and superseded is not None and now >= next_look:
                    if superseded():
                        return None
                    next_look = now + SUPERSEDED_LOOK_S
                if now - last_heard > timeout:
                    what = "did not say hello" if self.sup is None else "stopped answering"
                    return f"node 0 {what} for {timeout:g} s: stopping this node's roles"
                while self._outbox and driver is not None:
                    _send(self._sock, *self._outbox.popleft(), ident=driver)
                if self.sup is not None and driver is not None and now >= next_beat:
                    if failure := self._report(driver, known):
                        return f"this node's supervisor gave up: {failure}"
                    next_beat = now + self.sup.heartbeat_interval
        finally:
            self.close()

    def _signed(self, hello: dict, secret: JobSecret, run: str) -> bool:
        """Whether node 0's `hello` is signed under the job's secret for this node and run; logs
        one line when it is not."""
        mac = hello.get("mac") if isinstance(hello, dict) else None
        if mac is not None and secret.verify(mac, "hello", _hello_fields(hello, run, self.rank)):
            return True
        logger.warning("tandem: node %d: refused a hello that is %s (a peer with node 0's key but not the job's "
                       "%s, or of another run)", self.rank, "signed wrong" if mac else "not signed", SECRET_ENV)
        return False

    def _follow(self) -> None:
        """Queue this node's events for node 0 (the serve loop sends them); ends with the
        supervisor's shutdown event."""
        for event in follow_events(self.run_dir):
            if event["event"] in NODE_EVENTS:
                self._outbox.append(("event", event))

    def close(self) -> None:
        if self.sup is not None:
            self.sup.shutdown()
            self.sup = None
        if not self._ctx.closed:
            self._sock.close(linger=0)
            self._gate.close()
            self._ctx.term()

    def _start(self, hello: dict) -> Supervisor:
        if self.run_dir.exists():  # this node's folder from before it was lost: kept aside, whole
            n = 1
            while (aside := self.run_dir.with_name(f"{self.run_dir.name}.before-{n}")).exists():
                n += 1
            self.run_dir.rename(aside)
        return Supervisor(self.run_dir, transport="tcp", host=self.host, token=hello["token"],
                          job_keys=KeyPair(hello["job_public"], hello["job_secret"]),
                          heartbeat_interval=hello["heartbeat_interval"], gpus=self.gpus,
                          fake_gpus=self.fake_gpus, fake_gpu_bytes=self.fake_gpu_bytes)

    def _lease(self, req: dict) -> dict:
        """One LeaseTable method on this node's table (node 0's driver hands memory over between
        the roles here: runtime.cluster.ClusterLeases); GPU ids are the node's own."""
        try:
            result = getattr(self.sup.leases, LEASE_OPS[LEASE_OPS.index(req["op"])])(*req["args"], **req["kwargs"])
        except (LeaseError, ValueError) as e:  # raised again where the driver called it
            return {"req": req["req"], "error": str(e), "type": type(e).__name__}
        if isinstance(result, Grant):
            result = dataclasses.asdict(result)
        elif isinstance(result, list):
            result = [dataclasses.asdict(g) for g in result]
        return {"req": req["req"], "result": result}

    def _wait_ready(self, req: dict) -> None:
        """Supervisor.wait_ready in a thread of its own; the answer goes out through the outbox."""
        try:
            self.sup.wait_ready(req["names"], timeout=req["timeout"])
            answer = {"req": req["req"], "result": None}
        except ActorDied as e:
            answer = {"req": req["req"], "died": [e.role, e.incarnation, e.reason, e.error_file, e.error_text]}
        except (SupervisionFailed, TimeoutError, KeyError) as e:
            answer = {"req": req["req"], "error": str(e).splitlines()[0], "type": type(e).__name__}
        self._outbox.append(("answer", answer))

    def _spawn(self, req: dict, frames: list[bytes], known: dict) -> dict:
        """Supervisor.spawn, or spawn_group for this node's slice of a rank group (`ranks` set)."""
        try:
            # the class first: its module registers the role's config (wire.register_config)
            cls, ranks = pickle.loads(req["cls"]), req.get("ranks")
            cfg = self.sup.cfg
            hdr = wire.decode_header(cfg, frames)
            args, kwargs = wire.decode_body(cfg, hdr, frames)
            if ranks is None:
                handles = [self.sup.spawn(req["name"], cls, *args, gpus=req["gpus"], restart=req["restart"],
                                          group=req["group"], env=req["env"], first_incarnation=req["incarnation"],
                                          **kwargs)]
            else:
                handles = self.sup.spawn_group(req["name"], cls, *args, gpus=req["gpus"], env=req["env"],
                                               world_size=ranks["world_size"], first_rank=ranks["first_rank"],
                                               master=tuple(ranks["master"]), first_incarnation=req["incarnation"],
                                               **kwargs)
        except Exception as e:  # the driver raises it where it called spawn
            return {"req": req["req"], "error": f"{type(e).__name__}: {e}"}
        return self._roles_reply(req, handles, known)

    def _respawn_group(self, req: dict, known: dict) -> dict:
        """Supervisor.respawn_group of this node's slice, joining node 0's new store at `master`.
        Its old ranks' stops are node 0's doing: not reported as deaths (node 0 would stop its
        new slice for them)."""
        for name in self.sup.incarnations(req["group"]):
            known[name] = (known.get(name, (0, None))[0], "respawned")
        try:
            handles = self.sup.respawn_group(req["group"], req["reason"], timeout=req["timeout"], other_slices=True,
                                             master=tuple(req["master"]))
        except (SupervisionFailed, ValueError, TimeoutError) as e:  # raised again where node 0 called it
            return {"req": req["req"], "error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
        return self._roles_reply(req, handles, known)

    def _roles_reply(self, req: dict, handles: list, known: dict) -> dict:
        """The reply to a spawn or respawn: each started role's incarnation and endpoint, now
        known here as alive."""
        roles = []
        for h in handles:
            addr = self.sup.directory.resolve(h.name)
            known[addr.name] = (addr.incarnation, None)
            roles.append({"name": addr.name, "inc": addr.incarnation, "endpoint": addr.endpoint})
        return {"req": req["req"], "roles": roles}

    def _report(self, driver: bytes, known: dict) -> str | None:
        """A heartbeat, then each restart and death of a role since the last one; or, when the
        supervisor gave up, that (returned too)."""
        try:
            self.sup.check()
        except SupervisionFailed as e:
            reason = str(e).splitlines()[0]
            _send(self._sock, "failed", {"reason": reason}, ident=driver)
            return reason
        _send(self._sock, "heartbeat", {"roles": len(known)}, ident=driver)
        for name, (inc, reported) in list(known.items()):
            try:
                addr = self.sup.directory.resolve(name)
            except ActorDied as e:
                if reported is None:
                    known[name] = (inc, e.reason)
                    _send(self._sock, "died", {"name": name, "inc": e.incarnation, "reason": e.reason,
                                               "error_file": e.error_file, "error_text": e.error_text},
                          ident=driver)
                continue
            if addr.incarnation != inc:
                known[name] = (addr.incarnation, None)
                _send(self._sock, "started", {"name": name, "inc": addr.incarnation, "endpoint": addr.endpoint},
                      ident=driver)
        return None


class RemoteNode:
    """Node 0's side of one other node: spawns roles there and watches it. Calls to its roles
    go through `sup`'s caller, straight to their mailboxes; `sup` must use tcp with the job's
    key pair (Supervisor(transport="tcp", job_keys=...)), whose token and keys go to the agent."""

    def __init__(self, sup: Supervisor, entry: NodeEntry, keys: KeyPair, *, secret: JobSecret, run: str,
                 hello_timeout_s: float = 60.0):
        if sup.cfg.curve is None:
            raise ValueError("a RemoteNode needs a Supervisor with job_keys (CURVE across nodes)")
        self.sup, self.rank = sup, entry.rank
        self.heartbeat_timeout = sup.heartbeat_timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        dial(self._sock, keys, entry.public_key, entry.endpoint)
        self._outbox: list[tuple[str, dict, list]] = []
        # a byte here wakes the channel's thread for a new message, which would otherwise wait
        # out its poll tick: a handoff across nodes is a handful of lease requests
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._replies: dict[int, dict] = {}
        self._roles: dict[str, int] = {}  # name: incarnation, the roles spawned on this node
        self.restarts: collections.Counter[str] = collections.Counter()  # name: restarts the agent told of
        # rank groups with a slice here: {group: (world size, ranks here)}; a death elsewhere in one
        # stops the slice here, and a death here the slice on node 0 (a group dies as one)
        self._groups: dict[str, tuple[int, set[int]]] = {}
        self._stopped_groups: set[str] = set()
        self._respawning: set[str] = set()  # groups whose slice here is being respawned (respawn_group)
        self._cond = threading.Condition()
        self._req = 0
        self.failure: NodeLost | None = None
        self._closing = False
        job = sup.cfg.curve
        hello = {"token": sup.cfg.token, "job_public": job.public, "job_secret": job.secret,
                 "heartbeat_interval": sup.heartbeat_interval, "heartbeat_timeout": self.heartbeat_timeout}
        # signed for this node and run: the agent takes the job's key pair from no one else
        self._post("hello", {**hello, "mac": secret.sign("hello", _hello_fields(hello, run, self.rank))})
        self._last_heard = time.monotonic()
        self._hello_timeout_s = hello_timeout_s
        self._welcomed = False
        self._thread = threading.Thread(target=self._run, name=f"tandem-node{self.rank}", daemon=True)
        self._thread.start()
        with self._cond:
            if not self._cond.wait_for(lambda: self._welcomed or self.failure, timeout=hello_timeout_s + 1):
                self.failure = NodeLost(f"node {self.rank} at {entry.endpoint} did not answer node 0's hello "
                                        f"within {hello_timeout_s:g} s")
        if self.failure is not None:  # the channel's thread ends at its next tick
            self._thread.join(timeout=2)
            self._sock.close(linger=0)
            self._ctx.term()
            self._close_wake()
            raise self.failure

    def spawn(self, name: str, cls: type, *args, gpus: Sequence[int] = (), restart: str = "one_for_one",
              group: str | None = None, env: dict[str, str] | None = None, timeout: float = 60.0,
              first_incarnation: int = 0, **kwargs) -> ActorHandle:
        """Supervisor.spawn on this node; `gpus` are the node's own GPU ids."""
        return self._spawn(name, cls, args, kwargs, gpus=gpus, restart=restart, group=group, env=env,
                           ranks=None, timeout=timeout, incarnation=first_incarnation)[0]

    def spawn_group(self, name: str, cls: type, *args, gpus: Sequence[int], world_size: int, first_rank: int,
                    master: tuple[str, int], env: dict[str, str] | None = None, timeout: float = 60.0,
                    first_incarnation: int = 0, **kwargs) -> list[ActorHandle]:
        """This node's slice of rank group `name` (Supervisor.spawn_group): ranks `first_rank` on,
        one per GPU of `gpus` (the node's own ids), joining the store at `master`."""
        ranks = {"world_size": world_size, "first_rank": first_rank, "master": list(master)}
        handles = self._spawn(name, cls, args, kwargs, gpus=gpus, restart="temporary", group=name, env=env,
                              ranks=ranks, timeout=timeout, incarnation=first_incarnation)
        with self._cond:
            self._groups[name] = (world_size, set(range(first_rank, first_rank + len(gpus))))
        return handles

    @contextlib.contextmanager
    def respawning(self, group: str) -> Iterator[None]:
        """While node 0 restarts rank group `group` across nodes (ClusterSupervisor.respawn_group),
        its ranks' deaths here stop nothing on node 0: those are the restart's own stops, and node
        0's new slice must stay. Then the group dies as one again."""
        with self._cond:
            self._respawning.add(group)
        try:
            yield
        finally:
            with self._cond:
                self._respawning.discard(group)
                self._stopped_groups.discard(group)

    def respawn_group(self, name: str, reason: str, master: tuple[str, int], timeout: float = 60.0) -> None:
        """Start this node's slice of rank group `name` again (Supervisor.respawn_group: its live
        ranks stopped, new incarnations) joining the store at `master`, node 0's new one; within
        `respawning(name)`. The handles node 0 has reach the new incarnations."""
        reply = self._request("respawn_group", {"group": name, "reason": reason, "master": list(master),
                                                "timeout": timeout}, timeout=timeout + 30,
                              what=f"the restart of group {name!r}")
        if "error" in reply:
            raise RuntimeActorError(f"node {self.rank} could not restart group {name!r}: {reply['error']}")
        for role in reply["roles"]:
            self.sup.directory.update(Address(role["name"], role["inc"], role["endpoint"]))
            with self._cond:
                self._roles[role["name"]] = role["inc"]

    def _spawn(self, name: str, cls: type, args: tuple, kwargs: dict, *, gpus: Sequence[int], restart: str,
               group: str | None, env: dict[str, str] | None, ranks: dict | None, timeout: float,
               incarnation: int) -> list[ActorHandle]:
        self.check()
        init = wire.encode(wire.WireConfig(token=self.sup.cfg.token), {
            "kind": "init", "id": 0, "src": "supervisor", "dst": name, "method": "__init__",
            "inc": 0, "deadline": None}, [list(args), kwargs])
        reply = self._request("spawn", {"name": name, "cls": pickle.dumps(cls), "gpus": [int(g) for g in gpus],
                                        "restart": restart, "group": group, "env": dict(env or {}), "ranks": ranks,
                                        "incarnation": incarnation},
                              [bytes(f) for f in init.frames], timeout=timeout, what=f"the spawn of {name!r}")
        if "error" in reply:
            raise RuntimeActorError(f"node {self.rank} could not spawn {name!r}: {reply['error']}")
        handles = []
        for role in reply["roles"]:
            self.sup.directory.update(Address(role["name"], role["inc"], role["endpoint"]))
            self._roles[role["name"]] = role["inc"]
            handles.append(ActorHandle(role["name"], cls.__name__, endpoints_of(cls), self.sup.caller))
        return handles

    def lease(self, op: str, *args, **kwargs):
        """LeaseTable.`op`(*args, **kwargs) on this node's table (its own GPU ids); its LeaseError
        or ValueError is raised here. A Grant comes back as a dict."""
        reply = self._request("lease", {"op": op, "args": list(args), "kwargs": kwargs}, timeout=30.0,
                              what=f"lease {op}")
        if "error" in reply:
            raise (LeaseError if reply["type"] == "LeaseError" else ValueError)(f"node {self.rank}: {reply['error']}")
        return reply["result"]

    def wait_ready(self, names: Sequence[str], timeout: float = 300.0) -> None:
        """Supervisor.wait_ready on this node: ActorDied of a role that died starting."""
        reply = self._request("wait_ready", {"names": list(names), "timeout": timeout}, timeout=timeout + 5,
                              what="the roles' start")
        if "died" in reply:
            raise ActorDied(*reply["died"])
        if "error" in reply:
            raise (TimeoutError if reply["type"] == "TimeoutError" else RuntimeActorError)(
                f"node {self.rank}: {reply['error']}")

    def wait_restarted(self, name: str, dead_incarnation: int, timeout: float = 300.0) -> int:
        """Until the agent reports `name` started again past `dead_incarnation`, and it is ready."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._roles.get(name, -1) > dead_incarnation or self.failure,
                                       timeout=timeout):
                raise TimeoutError(f"{name} on node {self.rank} was not restarted within {timeout} s")
            self.check()
            inc = self._roles[name]
        self.wait_ready([name], timeout=timeout)
        return inc

    def _request(self, kind: str, payload: dict, frames: list | None = None, *, timeout: float, what: str) -> dict:
        """Send a request that the agent answers (matched by its number); NodeLost if the node is lost first."""
        self.check()
        with self._cond:
            self._req += 1
            req = self._req
        self._post(kind, {"req": req, **payload}, frames)
        with self._cond:
            if not self._cond.wait_for(lambda: req in self._replies or self.failure, timeout=timeout):
                raise TimeoutError(f"node {self.rank} did not answer {what} within {timeout:g} s")
            self.check()
            return self._replies.pop(req)

    def roles(self) -> dict[str, int]:
        """{name: incarnation} of the roles spawned on this node, as last reported."""
        with self._cond:
            return dict(self._roles)

    def check(self) -> None:
        """Raise NodeLost if the node was lost or its supervisor gave up."""
        if self.failure is not None:
            raise self.failure

    def close(self, reason: str = "the run ended") -> None:
        """Tell the agent to stop its roles, and stop watching it."""
        if self._thread.is_alive():
            self._post("stop", {"reason": reason})
            self._closing = True
            self._thread.join(timeout=5)
        if not self._ctx.closed:
            self._sock.close(linger=0 if self.failure else 1000)  # a live agent gets the stop
            self._ctx.term()
            self._close_wake()

    # -- the channel's thread: the only one that touches the socket ------------------------
    def _post(self, kind: str, payload: dict, frames: list | None = None) -> None:
        with self._cond:
            self._outbox.append((kind, payload, frames or []))
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"w")
                except BlockingIOError:  # full: the thread has a wake-up waiting already
                    pass

    def _close_wake(self) -> None:
        with self._cond:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1

    def _run(self) -> None:
        next_ping = 0.0
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while True:
            closing = self._closing  # read first: close() posts "stop" before it sets _closing
            with self._cond:
                outbox, self._outbox = self._outbox, []
            for i, (kind, payload, frames) in enumerate(outbox):
                try:  # never block: a DEALER with no connected peer (the agent refused us, or is
                    # gone) would hold this thread in send, past close()
                    _send(self._sock, kind, payload, frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    with self._cond:
                        self._outbox[:0] = outbox[i:]  # in order, before what came since
                    break
            if closing or self.failure is not None:
                return
            ready = dict(poller.poll(int(TICK_S * 1000)))
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
            while self._sock.poll(0):
                kind, payload, *_ = self._sock.recv_multipart()
                self._last_heard = time.monotonic()
                self._on_message(kind.decode(), msgpack.unpackb(payload, raw=False))
            now = time.monotonic()
            silent = now - self._last_heard
            if silent > (self.heartbeat_timeout if self._welcomed else self._hello_timeout_s):
                self._lose(f"node {self.rank} lost: no heartbeat for {silent:.1f} s "
                           f"(heartbeat timeout {self.heartbeat_timeout:g} s)")
                return
            if now >= next_ping:
                self._post("ping", {})
                self._stop_slices_of_dead_groups()
                next_ping = now + self.sup.heartbeat_interval

    def _on_message(self, kind: str, body: dict) -> None:
        if kind == "welcome":
            with self._cond:
                self._welcomed = True
                self._cond.notify_all()
        elif kind in ("spawned", "answer"):
            with self._cond:
                self._replies[body["req"]] = body
                self._cond.notify_all()
        elif kind == "started":
            self.sup.directory.update(Address(body["name"], body["inc"], body["endpoint"]))
            with self._cond:
                self._roles[body["name"]] = body["inc"]
                self.restarts[body["name"]] += 1
                self._cond.notify_all()
        elif kind == "died":
            err = ActorDied(body["name"], body["inc"], f"on node {self.rank}: {body['reason']}",
                            body.get("error_file"), body.get("error_text"))
            self.sup.directory.mark_dead(body["name"], body["inc"], err)
            self.sup.caller.fail_destination(body["name"], body["inc"], err)
            group = body["name"].rpartition(".")[0]
            if group in self._groups and group not in self._respawning:  # node 0's slice of the group goes with it
                # the incarnations now: a respawn of the group after this death keeps its new ranks
                _aside(self.sup.stop_group, group, err, self.sup.incarnations(group))
        elif kind == "event":  # an event of that node (NODE_EVENTS), for the monitor at node 0
            fields = {k: v for k, v in body.items() if k not in ("event", "seq", "ts")}
            self.sup.bus.publish(body["event"], node=self.rank, **fields)
        elif kind == "failed":
            self._lose(f"node {self.rank}'s supervisor gave up: {body['reason']}")

    def _stop_slices_of_dead_groups(self) -> None:
        """A rank of a group elsewhere (node 0's slice, another node's) dead in node 0's
        directory: ask the agent to stop this node's slice, once."""
        for group, (world, here) in list(self._groups.items()):
            if group in self._stopped_groups:
                continue
            for rank in range(world):
                if rank in here:
                    continue
                try:
                    self.sup.directory.resolve(f"{group}.{rank}")
                except ActorDied as e:
                    self._stopped_groups.add(group)
                    incs = {f"{group}.{r}": self._roles[f"{group}.{r}"] for r in here if f"{group}.{r}" in self._roles}
                    self._post("stop_group", {"group": group, "role": e.role, "inc": e.incarnation,
                                              "reason": e.reason, "incs": incs})
                    break
                except KeyError:  # not started yet
                    continue

    def _lose(self, reason: str) -> None:
        """Make check() raise, fail every call to this node's roles, and stop node 0's slices of
        rank groups that had ranks there (they would wait in a collective for ever). The failure
        is set first: a caller that sees a role's ActorDied finds the node lost."""
        with self._cond:
            self.failure = NodeLost(reason)
            self._cond.notify_all()
        for name, inc in list(self._roles.items()):
            err = ActorDied(name, inc, reason)
            self.sup.directory.mark_dead(name, inc, err)
            self.sup.caller.fail_destination(name, inc, err)
            if (group := name.rpartition(".")[0]) in self._groups:
                _aside(self.sup.stop_group, group, err, self.sup.incarnations(group))


def _hello_fields(hello: dict, run: str, rank: int) -> dict:
    """What node 0's hello to node `rank` of run `run` is signed over: its body, the run and the rank."""
    return {"hello": {k: v for k, v in hello.items() if k != "mac"}, "run": run, "rank": rank}
