"""The supervisor: spawns role processes, watches them, restarts them, stops them.

Roles just work and crash; the supervisor owns the child specs (restart type, group),
the strategy and the restart limit, as in Erlang/OTP:

- ``one_for_one``: restart the dead child alone (stateless roles).
- ``one_for_all``: restart every member of the child's named group (a colocated GPU
  group whose members share IPC handles and NCCL state).
- ``temporary``: never restart; callers get ActorDied. Temporary children of one group
  (a rank group, ``spawn_group``) die together: the first death stops the others. The
  caller may start a rank group again (``respawn_group``): the driver's trainer recovery.

Death is seen from the process sentinel, hangs from missed heartbeats, both by the watch
thread (runtime.watcher), which hands each death to the restart policy here. Past the
restart intensity (``max_restarts`` within ``restart_window_s``), or when a child dies
before it was ever ready, the supervisor stops everything and raises SupervisionFailed
with the role's error file. A child spawned holding its GPUs' leases (a rollout engine,
which loads its weights while starting) that dies while another role holds one of them
restarts when it holds them all again, and counts toward the intensity only then.
Shutdown: SIGTERM to all at once, a grace period, SIGKILL to each child's process group.
The host's event bus, GPU leases and fake GPUs come in a runtime.node.Node, so that a node
agent on another host runs this same supervisor over its own.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Mapping, Sequence

import zmq

from runtime import curve, shm, wire
from runtime.actor import endpoints_of
from runtime.child import (ERROR_FILE_ENV, ChildBoot, StartupError, child_main, control_message,
                           describe_silent_start, refuse_bootstrap_reentry)
from runtime.errors import ActorDied, SupervisionFailed
from runtime.events import watch_socket
from runtime.handle import ActorGroup, ActorHandle, Address, Caller, Directory
from runtime.node import Node
from runtime.process import RESTART_POLICIES, Child, ChildSpec, end_session, kill_tree, read_text, start_with_env
from runtime.rendezvous import host_store
from runtime.watcher import Watcher


class Supervisor:
    """Owns the role processes of one run on one host. Use as a context manager.

    `node` gives it the host's event bus, GPU leases and socket folder (runtime.node); by
    default it builds them for this host from `run_dir`, `gpus`, `fake_gpus` and
    `fake_gpu_bytes`. Either way it closes them at shutdown.

    Across nodes (runtime.agent) every supervisor of the job uses `transport="tcp"` bound to its
    node's address, the job's CURVE key pair `job_keys` on every socket, and the job's wire
    `token`, which node 0 hands the node agents."""

    def __init__(self, run_dir: str | os.PathLike, *, heartbeat_interval: float = 1.0,
                 heartbeat_timeout: float | None = None, max_restarts: int = 3,
                 restart_window_s: float = 60.0, shutdown_grace_s: float = 5.0,
                 ready_timeout_s: float = 300.0, transport: str = "ipc", host: str = "127.0.0.1",
                 max_message_bytes: int = 16 << 30, gpus: Sequence[int] = (), fake_gpus: int = 0,
                 fake_gpu_bytes: int = 80 << 30, stats_interval_s: float = 1.0, spin_us: int = 500,
                 node: Node | None = None, job_keys: curve.KeyPair | None = None, token: str | None = None):
        refuse_bootstrap_reentry("Supervisor()")  # a script without a __main__ guard, re-run in a role
        if transport not in ("ipc", "tcp"):
            raise ValueError(f"transport={transport!r}: allowed values are 'ipc' and 'tcp'")
        if not isinstance(spin_us, int) or not 0 <= spin_us <= 1_000_000:
            raise ValueError(f"spin_us={spin_us!r}: allowed range is 0..1000000 (0: never poll before sleeping)")
        if job_keys is not None and transport != "tcp":
            raise ValueError("job_keys (CURVE across nodes) needs transport='tcp'")
        if heartbeat_interval <= 0:
            raise ValueError(f"heartbeat_interval={heartbeat_interval}: must be > 0 seconds")
        self.node = node or Node.local(run_dir, gpus=gpus, fake_gpus=fake_gpus, fake_gpu_bytes=fake_gpu_bytes)
        self.run_dir, self.sock_dir = self.node.run_dir, self.node.sock_dir
        self.bus, self.leases, self.fake_gpu_dir = self.node.bus, self.node.leases, self.node.fake_gpu_dir
        self.heartbeat_interval = heartbeat_interval
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.shutdown_grace_s = shutdown_grace_s
        self.transport, self.host = transport, host
        # Across nodes: gloo (torch.distributed) binds the address the host name resolves to, on
        # many hosts (and in a network namespace) loopback, not the node's; its ranks would then
        # hand their peers on other nodes 127.0.0.1. Its roles use the interface of `host`.
        iface = curve.interface_of(host) if job_keys and "GLOO_SOCKET_IFNAME" not in os.environ else None
        self._net_env = {"GLOO_SOCKET_IFNAME": iface} if iface else {}
        self.run_id = secrets.token_hex(4)
        self.cfg = wire.WireConfig(token=token or secrets.token_hex(16), max_message_bytes=max_message_bytes,
                                   shm_prefix=f"tandem-{self.run_id}" if transport == "ipc" else None,
                                   spin_us=spin_us, curve=job_keys)
        if self.cfg._pool is not None:
            shm.set_process_pool(self.cfg._pool)  # runtime.shared_empty in the driver

        self._ctx = zmq.Context()
        # across nodes, the control socket and the roles' mailboxes admit the job's key only
        self._gate = curve.Gatekeeper(self._ctx, [job_keys.public]) if job_keys else None
        self._control = self._ctx.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        self.control_endpoint = self._bind(self._control, "control")
        self._control_watch = watch_socket(self._control, self.bus, "control")
        self.directory = Directory()
        self.caller = Caller(self._ctx, self.cfg, "supervisor", self.directory)

        self.leases.listen(self._on_lease_event)
        self._deferred: dict[str, str] = {}  # children whose restart waits for their leases: reason
        self._stores: dict[str, object] = {}  # rank group name: its rendezvous store (a TCPStore server)
        # rank groups whose ranks here are all stopped after a death (by the watch thread or
        # stop_group): what respawn_group waits for, on every node (only node 0 hosts a store)
        self._groups_down: set[str] = set()
        self._respawning: set[str] = set()  # rank groups that respawn_group or stop_group stops: their deaths are its own
        # One stop_group or respawn_group at a time: across nodes a death elsewhere stops a slice
        # (stop_group, from the agent's channel) while the driver may be respawning it, and both
        # act on the same Child objects, which a respawn gives new processes.
        self._group_ops = threading.Lock()

        self._children: dict[str, Child] = {}
        self._lock = threading.RLock()          # guards _children and restart bookkeeping
        self._restart_times: collections.deque[float] = collections.deque()
        # per role, the deaths that led to a restart (immediate or deferred), counted once at
        # the death: callers that see an ActorDied or none at all read the same count
        self._restarts_by_role: collections.Counter[str] = collections.Counter()
        self._failure: SupervisionFailed | None = None
        self._stopping = False  # no more restarts
        self._closed = False
        self._mp = multiprocessing.get_context("spawn")
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-spawner")
        self.bus.publish("supervisor_started", pid=os.getpid(), run_dir=str(self.run_dir))
        self._watcher = Watcher(control=self._control, token=self.cfg.token, bus=self.bus,
                                watched=self._watched, find=self._children.get, on_death=self._on_death,
                                heartbeat_timeout=heartbeat_timeout or 5 * heartbeat_interval,
                                ready_timeout_s=ready_timeout_s, stats_interval_s=stats_interval_s)
        self._watcher.start()

    @property
    def heartbeat_timeout(self) -> float:
        return self._watcher.heartbeat_timeout

    @property
    def ready_timeout_s(self) -> float:
        return self._watcher.ready_timeout_s

    # -- public API -----------------------------------------------------------------------
    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.shutdown()
        if exc_type is None:
            self.check()

    def spawn(self, name: str, cls: type, *args, gpus: Sequence[int] = (), restart: str = "one_for_one",
              group: str | None = None, env: dict[str, str] | None = None, first_incarnation: int = 0,
              **kwargs) -> ActorHandle:
        """Start ``cls(*args, **kwargs)`` in a new process; returns at once with its handle.

        Calls made before the actor is ready wait in its mailbox queue. `first_incarnation`: past
        0 for a role that lived on a node that was lost and came back (runtime.cluster), so that
        its callers tell the new process from the dead one.
        """
        self.check()
        if restart not in RESTART_POLICIES:
            raise ValueError(f"restart={restart!r}: allowed values are {', '.join(RESTART_POLICIES)}")
        if restart == "one_for_all" and not group:
            raise ValueError(f"{name}: restart='one_for_all' needs group=NAME (the members restarted together)")
        if not name or "#" in name or "/" in name:
            raise ValueError(f"actor name {name!r}: must be non-empty without '#' or '/'")
        try:
            init = wire.encode(wire.WireConfig(token=self.cfg.token), {
                "kind": "init", "id": 0, "src": "supervisor", "dst": name, "method": "__init__",
                "inc": 0, "deadline": None}, [list(args), kwargs])
        except (TypeError, ValueError, wire.WireError) as e:
            raise StartupError(f"role {name!r}: cannot send the arguments of {cls.__name__}(...): {e}") from e
        spec = ChildSpec(name, cls, [bytes(f) for f in init.frames], tuple(int(g) for g in gpus),
                         restart, group, dict(env or {}),
                         lease_to_start=bool(gpus) and all(self._holds(int(g), name) for g in gpus))
        with self._lock:
            if name in self._children:
                raise ValueError(f"an actor named {name!r} already exists")
            child = Child(spec, incarnation=first_incarnation)
            self._children[name] = child
            try:
                self._start(child)
            except BaseException:
                del self._children[name]  # nothing started: shutdown must not see a child without a process
                raise
        return self.handle(name)

    def spawn_group(self, name: str, cls: type, *args, gpus: Sequence[int], env: dict[str, str] | None = None,
                    world_size: int | None = None, first_rank: int = 0, master: tuple[str, int] | None = None,
                    first_incarnation: int = 0, **kwargs) -> list[ActorHandle]:
        """Start a rank group: ``cls(*args, **kwargs)`` once per GPU, rank i named ``f"{name}.{i}"``
        on ``gpus[i]`` alone, with the torch.distributed environment set before any import:
        MASTER_ADDR=127.0.0.1, MASTER_PORT, RANK, WORLD_SIZE and LOCAL_RANK (= RANK: one node).
        MASTER_PORT is the group's rendezvous store, which the supervisor hosts until the group
        dies (runtime.rendezvous): the ranks connect to it, none listens. Returns the ranks'
        handles in rank order.

        The group lives and dies as one (``restart="temporary"``, ``group=name``): when a rank
        dies the others are stopped, and calls to any of them raise the ActorDied of the rank
        that died. The supervisor never restarts it by itself (its state is the run's, which
        only the driver can reload); the driver may, with `respawn_group`.

        Across nodes (runtime.agent) each node starts its slice: ranks ``first_rank`` on of a group
        of ``world_size``, LOCAL_RANK counting from 0 on each node. Node 0's supervisor hosts the
        store on its host; the others are given it as ``master`` (address, port). What one slice's
        death does to the others' is the driver's to decide (docs/multinode.md).
        """
        if not gpus:
            raise ValueError(f"{name}: a rank group needs gpus (one rank per GPU)")
        if "." in name:
            raise ValueError(f"rank group name {name!r}: must not contain '.' (ranks are named NAME.RANK)")
        world = len(gpus) if world_size is None else world_size
        if not 0 <= first_rank <= world - len(gpus):
            raise ValueError(f"{name}: ranks {first_rank}..{first_rank + len(gpus) - 1} do not fit a group of "
                             f"world_size={world}")
        with self._lock:
            if any(c.spec.group == name for c in self._children.values()):
                raise ValueError(f"a group named {name!r} already exists")
            if master is None:
                self._stores[name] = store = host_store(self.host, world)
                master = (self.host, store.port)
        return [self.spawn(f"{name}.{first_rank + i}", cls, *args, gpus=[gpu], restart="temporary", group=name,
                           env={**(env or {}), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
                                "RANK": str(first_rank + i), "WORLD_SIZE": str(world), "LOCAL_RANK": str(i)},
                           first_incarnation=first_incarnation, **kwargs)
                for i, gpu in enumerate(gpus)]

    def group_master(self, name: str) -> tuple[str, int]:
        """(address, port) of the store this supervisor hosts for rank group `name`: what the
        slices of the group on other nodes are given as `master`."""
        with self._lock:
            return self.host, self._stores[name].port

    def respawn_group(self, name: str, reason: str, timeout: float = 60.0, other_slices: bool = False,
                      master: tuple[str, int] | None = None) -> list[ActorHandle]:
        """Start rank group `name` again: its live ranks are stopped, then every rank starts as
        a new incarnation with a new rendezvous store (a new MASTER_PORT). The driver's call
        (ppo.recovery: the driver knows what to reload; a supervisor restart would bring back
        freshly initialised trainers). Counts once toward the restart intensity, past which
        the supervisor gives up and this raises SupervisionFailed. Returns at once; the
        handles (the same names) reach the new incarnations. A group that spans nodes restarts
        its slice here (`other_slices`: the caller starts the others, runtime.cluster); the slice
        of a node other than 0 joins the new store that node 0 hosts, at `master`."""
        with self._group_ops:
            return self._respawn_group(name, reason, timeout, other_slices, master)

    def _respawn_group(self, name: str, reason: str, timeout: float, other_slices: bool,
                       master: tuple[str, int] | None) -> list[ActorHandle]:
        self.check()
        with self._lock:
            members = [c for c in self._children.values() if c.spec.group == name and c.spec.restart == "temporary"]
        if not members:
            raise ValueError(f"no rank group named {name!r}")
        world = int(members[0].spec.env["WORLD_SIZE"])
        if world != len(members) and not other_slices:
            raise ValueError(f"rank group {name!r} spans nodes: respawning it restarts its other slices too "
                             "(runtime.cluster.ClusterSupervisor.respawn_group)")
        members.sort(key=lambda c: int(c.spec.env["RANK"]))
        # A rank's death stops its peers in the watch thread, which then marks the group down:
        # wait for that, so that no stop of an old incarnation lands on a new one.
        until = time.monotonic() + timeout
        while any(c.state == "dead" for c in members) and name not in self._groups_down:
            if time.monotonic() > until:
                raise TimeoutError(f"group {name!r}: its ranks were not stopped within {timeout} s")
            time.sleep(0.01)
        with self._lock:
            self._groups_down.discard(name)
            self._respawning.add(name)  # the watch thread leaves the stop of its live ranks to us
        try:
            self._stop_children([c for c in members if c.state != "dead"],
                                reason=f"restarting group {name!r}: {reason}", event="stopped")
            err_file = self._error_file(members[0])
            if not self._count_restart(name, reason, err_file, read_text(err_file)):
                self.check()  # raises the SupervisionFailed of _give_up
            with self._lock:
                if master is None:
                    self._stores[name] = store = host_store(self.host, world)
                    master = (self.host, store.port)
                for c in members:
                    c.spec = replace(c.spec, env={**c.spec.env, "MASTER_ADDR": master[0],
                                                  "MASTER_PORT": str(master[1])})
        finally:
            with self._lock:
                self._respawning.discard(name)
        for c in members:
            self._restart(c, reason)
        return [self.handle(c.spec.name) for c in members]

    def handle(self, name: str) -> ActorHandle:
        child = self._children[name]
        return ActorHandle(name, child.spec.cls.__name__, endpoints_of(child.spec.cls), self.caller,
                           killer=self.kill)

    def group(self, handles_or_names: Sequence[ActorHandle | str]) -> ActorGroup:
        return ActorGroup(h if isinstance(h, ActorHandle) else self.handle(h) for h in handles_or_names)

    def wait_ready(self, names: Sequence[str] | None = None, timeout: float = 300.0) -> None:
        """Block until the named actors (default: all) are ready; raises if one dies starting
        (SupervisionFailed; ActorDied for a `temporary` one, which is never restarted)."""
        until = time.monotonic() + timeout
        names = list(names or self._children)
        while True:
            self.check()
            with self._lock:
                pending = [n for n in names if self._children[n].state != "ready"]
                gone = [n for n in pending if self._children[n].state == "dead"
                        and self._children[n].spec.restart == "temporary"]
            if gone:
                self.directory.resolve(gone[0])  # raises its ActorDied (for a rank: the rank that died)
            if not pending:
                return
            if time.monotonic() > until:
                raise TimeoutError(f"actors not ready after {timeout} s: {', '.join(pending)}")
            time.sleep(0.01)

    def restart_counts(self) -> dict[str, int]:
        """{role: deaths that led to its restart so far}. Counted at the death, once, whether
        or not a caller saw it: a role that dies idle and comes back unnoticed counts too."""
        with self._lock:
            return dict(self._restarts_by_role)

    def wait_restarted(self, name: str, dead_incarnation: int, timeout: float = 300.0) -> int:
        """Block until `name` runs a newer incarnation than `dead_incarnation` and is ready;
        returns it. Raises SupervisionFailed if the supervisor gave up, ActorDied for a
        `temporary` actor (never restarted)."""
        until = time.monotonic() + timeout
        while True:
            self.check()
            with self._lock:
                child = self._children[name]
                inc, state, policy = child.incarnation, child.state, child.spec.restart
            if inc > dead_incarnation and state == "ready":
                return inc
            if policy == "temporary" and state == "dead":
                raise ActorDied(name, inc, "a temporary actor is not restarted")
            if time.monotonic() > until:
                raise TimeoutError(f"{name} was not restarted within {timeout} s")
            time.sleep(0.01)

    def stop_group(self, name: str, cause: ActorDied, incarnations: Mapping[str, int] | None = None) -> None:
        """Stop the live ranks of rank group `name` here because a rank elsewhere died (a slice
        on another node, runtime.agent); calls to them raise `cause`. Nothing when none runs here,
        or when the ranks are no longer at `incarnations` ({rank: incarnation} as the caller knew
        them when the rank died): the group was respawned since, and the new ranks stay."""
        with self._group_ops:
            with self._lock:
                members = [c for c in self._children.values() if c.spec.group == name]
                if incarnations is not None and any(incarnations.get(c.spec.name, c.incarnation) != c.incarnation
                                                    for c in members):
                    return
                live = [c for c in members if c.state != "dead"]
                self._stores.pop(name, None)
                self._respawning.add(name)  # the watch thread leaves their deaths to us: they carry `cause`
            try:
                self._stop_children(live, reason=f"stopped with its group {name!r}: {cause.role!r} died "
                                    f"({cause.reason})", cause=cause)
            finally:
                with self._lock:
                    self._respawning.discard(name)
                    self._groups_down.add(name)

    def incarnations(self, group: str) -> dict[str, int]:
        """{rank: incarnation} of rank group `group`'s ranks here (what `stop_group` compares)."""
        with self._lock:
            return {c.spec.name: c.incarnation for c in self._children.values() if c.spec.group == group}

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        with self._lock:
            proc = self._children[name].process
        if proc is not None and proc.pid:
            os.kill(proc.pid, sig)

    def pid(self, name: str) -> int:
        return self._children[name].process.pid

    def publish(self, event: str, **fields) -> None:
        """Publish an event of the training loop (e.g. ``metrics``) on the run's bus."""
        self.bus.publish(event, **fields)

    def check(self) -> None:
        """Raise SupervisionFailed if the supervisor gave up."""
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        """SIGTERM every child at once, wait the grace period, SIGKILL what is left."""
        with self._lock:
            if self._closed:
                return
            self._closed = self._stopping = True
            children = list(self._children.values())
        self._watcher.stop()
        self._stop_children(children, reason="supervisor shutdown", event="stopped")
        self._stores.clear()
        self._spawner.shutdown()
        self.caller.close()
        self._control.disable_monitor()
        self._control_watch.join(timeout=2)  # it publishes on the bus, which closes next
        self._control.close(linger=0)
        if self._gate is not None:
            self._gate.close()
        self._ctx.term()
        if self.cfg.shm_prefix:
            shm.clear_process_pool(self.cfg._pool)
            self.cfg._pool.close()
            self.cfg._reader.clear()  # its roles' segments are removed below: free their pages
            shm.remove_all(self.cfg.shm_prefix)
        self.node.close()

    # -- starting ---------------------------------------------------------------------------
    def _bind(self, sock: zmq.Socket, name: str) -> str:
        if self.transport == "tcp":
            if self.cfg.curve is not None:
                return curve.serve(sock, self.cfg.curve, self.host)
            port = sock.bind_to_random_port(f"tcp://{self.host}")
            return f"tcp://{self.host}:{port}"
        ep = f"ipc://{self.sock_dir}/{name}.sock"
        sock.bind(ep)
        return ep

    def _mailbox_endpoint(self, child: Child) -> str:
        if self.transport == "tcp":
            # the child binds; pick a free port now so the address is known before it boots
            with zmq.Context.instance().socket(zmq.ROUTER) as probe:
                port = probe.bind_to_random_port(f"tcp://{self.host}")
            return f"tcp://{self.host}:{port}"
        return f"ipc://{self.sock_dir}/{child.spec.name}.{child.incarnation}.sock"

    def _start(self, child: Child) -> None:
        spec = child.spec
        endpoint = self._mailbox_endpoint(child)
        peers = tuple((c.spec.name, c.incarnation, c.endpoint)
                      for c in self._children.values() if c is not child and c.state != "dead")
        boot = ChildBoot(
            name=spec.name, incarnation=child.incarnation, cls=spec.cls, init_frames=spec.init_frames,
            run_dir=str(self.run_dir), gpus=spec.gpus, mailbox=endpoint, control=self.control_endpoint,
            token=self.cfg.token, max_message_bytes=self.cfg.max_message_bytes, spin_us=self.cfg.spin_us,
            shm_prefix=self.cfg.shm_prefix, heartbeat_interval=self.heartbeat_interval,
            parent_pid=os.getpid(), error_file=self._error_file(child), peers=peers,
            group=spec.group, stop_timeout_s=self.shutdown_grace_s / 2,  # the rest of the grace: its SIGKILL
            curve=(self.cfg.curve.public, self.cfg.curve.secret) if self.cfg.curve else None)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, spec.gpus)), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
               **({"TANDEM_FAKE_GPU_DIR": self.fake_gpu_dir} if self.fake_gpu_dir else {}),
               ERROR_FILE_ENV: self._error_file(child), **self._net_env, **spec.env}
        proc = self._mp.Process(target=child_main, args=(boot,), name=f"tandem:{spec.name}", daemon=False)
        # PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so every child
        # is forked by one thread that outlives them all (restarts come from the watch thread).
        self._spawner.submit(start_with_env, proc, env).result()
        child.process, child.endpoint = proc, endpoint
        child.state, child.started_at, child.last_beat = "starting", time.monotonic(), None
        self.directory.update(Address(spec.name, child.incarnation, endpoint))
        self._notify_children({"what": "started", "name": spec.name, "inc": child.incarnation,
                               "endpoint": endpoint})
        self.bus.publish("spawned", role=spec.name, incarnation=child.incarnation, pid=proc.pid,
                         gpus=list(spec.gpus), restart=spec.restart, group=spec.group)
        self._watcher.wake()

    def _error_file(self, child: Child) -> str:
        return str(self.run_dir / "errors" / f"{child.spec.name}.{child.incarnation}.txt")

    def _watched(self) -> list[tuple[Child, int]]:
        """The children the watcher watches, each with its incarnation: the live ones, but
        for rank groups that respawn_group is stopping (their deaths are its own)."""
        with self._lock:  # the incarnation too: the driver may restart the child before it is handled
            return [(c, c.incarnation) for c in self._children.values()
                    if c.state != "dead" and c.spec.group not in self._respawning]

    # -- death and restarts ---------------------------------------------------------------
    def _on_death(self, child: Child, incarnation: int, reason: str) -> None:
        """The death of `child`'s `incarnation`: nothing if a later one runs already (the
        watch thread saw the sentinel of a rank that respawn_group stopped and started again;
        taking it for the new one's death failed a megatron recovery on the H200)."""
        with self._lock:
            if (child.state == "dead" or child.incarnation != incarnation
                    or child.spec.group in self._respawning):  # respawn_group stops it
                return
            child.state = "dead"
        spec = child.spec
        err_file = self._error_file(child)
        if not child.ever_ready and (child.process.exitcode or 0) > 0 and not os.path.exists(err_file):
            # it failed before child_main ran (which creates the file): say what usually causes that
            Path(err_file).write_text(describe_silent_start(spec.name, spec.cls, reason))
        err_text = read_text(err_file)
        err = ActorDied(spec.name, incarnation, reason, err_file if err_text else None, err_text)
        self.directory.mark_dead(spec.name, incarnation, err)
        self.caller.fail_destination(spec.name, incarnation, err)
        self.caller.forget_endpoint(child.endpoint)
        self._notify_children({"what": "died", "name": spec.name, "inc": incarnation,
                               "reason": reason, "endpoint": child.endpoint,
                               "error_file": err_file if err_text else None})
        self.bus.publish("died", role=spec.name, incarnation=incarnation, pid=child.process.pid,
                         gpus=list(spec.gpus), reason=reason, error_file=err_file if err_text else None)
        # What the dead incarnation started (an sglang scheduler holding GPU memory) goes before
        # anything is restarted on its GPUs: a new incarnation never races the old one's release.
        end_session(child.process.pid)
        self.leases.drop_dead_memory(list(spec.gpus), spec.name)
        if self._stopping:
            return
        if spec.restart == "temporary":
            if spec.group:  # a rank group dies as one; its calls name the rank that died
                peers = [c for c in self._children.values()
                         if c.spec.group == spec.group and c is not child and c.state != "dead"]
                self._stop_children(peers, reason=f"stopped with its group {spec.group!r}: {spec.name!r} died "
                                                  f"({reason})", cause=err)
                with self._lock:
                    self._stores.pop(spec.group, None)  # never restarted: nobody rendezvouses again
                    self._groups_down.add(spec.group)
            return
        if not child.ever_ready:
            self._give_up(f"actor {spec.name!r} died while starting ({reason}); not restarting it, "
                          "since a start-up failure usually repeats", err_file, err_text)
            return
        with self._lock:
            self._restarts_by_role[spec.name] += 1
        if spec.lease_to_start and spec.restart == "one_for_one" and self._defer_restart(child, reason):
            return
        if not self._count_restart(spec.name, reason, err_file, err_text):
            return
        if spec.restart == "one_for_all":
            members = [c for c in self._children.values() if c.spec.group == spec.group]
            self._stop_children([c for c in members if c.state != "dead"],
                                reason=f"restarting group {spec.group!r} after {spec.name!r} died")
        else:
            members = [child]
        for c in members:
            self._restart(c, reason)

    def _count_restart(self, name: str, reason: str, err_file: str, err_text: str | None) -> bool:
        """Record a restart; past the restart intensity, give up and return False."""
        now = time.monotonic()
        self._restart_times.append(now)
        while self._restart_times and now - self._restart_times[0] > self.restart_window_s:
            self._restart_times.popleft()
        if len(self._restart_times) > self.max_restarts:
            self._give_up(f"restart intensity exceeded: {len(self._restart_times)} restarts within "
                          f"{self.restart_window_s} s (max_restarts={self.max_restarts}); "
                          f"last death: {name!r}: {reason}", err_file, err_text)
            return False
        return True

    def _lease_wait(self, spec: ChildSpec) -> dict[str, str | None]:
        """{gpu: holder} of the child's GPUs whose lease it does not hold (side by side, an
        engine never gives up its budget's lease: its restart never waits)."""
        return {str(g): self.leases.holder(g, like=spec.name) for g in spec.gpus if not self.leases.holds(g, spec.name)}

    def _holds(self, gpu: int, name: str) -> bool:
        """Whether `name` holds `gpu`'s lease; False for a GPU without a lease (fake GPUs numbered past them)."""
        try:
            return self.leases.holds(gpu, name)
        except ValueError:
            return False

    def _defer_restart(self, child: Child, reason: str) -> bool:
        """A child that allocates on its GPUs while starting, dead while it does not hold
        their leases (another role works there), would only fail to allocate and count
        restarts until the supervisor gives up. Its restart waits instead until it holds
        them all again (`_on_lease_event`). False when it holds them now: restart at once."""
        name = child.spec.name
        with self._lock:
            self._deferred[name] = reason
        waiting = self._lease_wait(child.spec)
        if not waiting:
            with self._lock:
                return self._deferred.pop(name, None) is None  # True: _on_lease_event restarted it
        self.bus.publish("restart_deferred", role=name, incarnation=child.incarnation, gpus=list(child.spec.gpus),
                         waiting_for=waiting, reason=reason)
        return True

    def _on_lease_event(self, event: str, **fields) -> None:
        """The lease table's events (called under its lock, in the thread that changed it, after
        the bus published them): an acquisition restarts a child that was waiting for it."""
        name = fields.get("holder")
        if fields.get("action") != "acquire" or name not in self._deferred:
            return
        with self._lock:
            child = self._children[name]
            if self._stopping or name not in self._deferred or self._lease_wait(child.spec):
                return
            reason = self._deferred.pop(name)
        err_file = self._error_file(child)
        if self._count_restart(name, reason, err_file, read_text(err_file)):
            self._restart(child, reason)

    def _restart(self, child: Child, reason: str) -> None:
        with self._lock:
            child.incarnation += 1
            child.restarts += 1
            self._start(child)
        self.bus.publish("restarted", role=child.spec.name, incarnation=child.incarnation,
                         pid=child.process.pid, gpus=list(child.spec.gpus), reason=reason,
                         restarts=child.restarts)

    def _give_up(self, message: str, err_file: str, err_text: str | None) -> None:
        detail = f"\n\n--- {err_file} ---\n{err_text.rstrip()}" if err_text else ""
        self._failure = SupervisionFailed(message + detail)
        self.bus.publish("failed", reason=message, error_file=err_file if err_text else None)
        with self._lock:
            self._stopping = True
            children = list(self._children.values())
        self._stop_children(children, reason=f"supervisor gave up: {message}")
        self.caller.fail_all(self._failure)

    def _stop_children(self, children: list[Child], reason: str, event: str = "died",
                       cause: ActorDied | None = None) -> None:
        """SIGTERM all at once, wait the grace period, SIGKILL the rest and their sessions.

        `event` is "died" when the stop is a failure's consequence, "stopped" at a clean shutdown.
        `cause`: the error that calls to the stopped children raise (default: their own death)."""
        live = [c for c in children if c.process is not None and c.process.exitcode is None]
        for c in live:
            try:
                os.kill(c.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        until = time.monotonic() + self.shutdown_grace_s
        for c in live:
            c.process.join(timeout=max(0.0, until - time.monotonic()))
        for c in children:
            if c.process is not None:
                kill_tree(c.process.pid)
                c.process.join(timeout=5)
                # what it started in a process group of its own (an sglang scheduler) outlives
                # the group kill: end its session and its memory, as on a death (_on_death)
                end_session(c.process.pid)
                self.leases.drop_dead_memory(list(c.spec.gpus), c.spec.name)
        for c in children:
            if c.state != "dead":
                c.state = "dead"
                err = cause or ActorDied(c.spec.name, c.incarnation, reason)
                self.directory.mark_dead(c.spec.name, c.incarnation, err)
                self.caller.fail_destination(c.spec.name, c.incarnation, err)
                self.bus.publish(event, role=c.spec.name, incarnation=c.incarnation, pid=c.process.pid,
                                 gpus=list(c.spec.gpus), reason=reason, error_file=None)

    def _notify_children(self, notice: dict) -> None:
        msg = control_message("notice", self.cfg.token, notice)
        with self._lock:
            targets = [c.endpoint_id for c in self._children.values() if c.state != "dead"]
        for ident in targets:
            try:
                self._control.send_multipart([ident.encode(), *msg], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
