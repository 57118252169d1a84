"""What a supervisor is given to run one host's roles: the run's event bus, the lease table of
the host's GPUs (on the CPU, fake GPUs with exact ledgers), the socket folder and the routing
of library noise to the run's log. Built here for the local host; the supervisor owns it from
then on and closes it at shutdown."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from runtime.events import EventBus
from runtime.fakegpu import create_fake_devices
from runtime.memory import LeaseTable
from runtime.noise import route_library_noise

MAX_IPC_PATH = 100  # sun_path is 108 bytes on Linux


@dataclass
class Node:
    run_dir: Path
    sock_dir: str  # mode 0700; a short temporary one when run_dir is too deep for a unix socket path
    bus: EventBus
    leases: LeaseTable
    fake_gpu_dir: str | None  # set in each role's environment (TANDEM_FAKE_GPU_DIR) when GPUs are fake
    noise: Any  # library warnings routed to RUN_DIR/logs/warnings.log until close()

    @classmethod
    def local(cls, run_dir: str | os.PathLike, *, gpus: Sequence[int] = (), fake_gpus: int = 0,
              fake_gpu_bytes: int = 80 << 30) -> "Node":
        """This host, with a lease per GPU of `gpus`, or `fake_gpus` fake GPUs numbered from 0."""
        run_dir = Path(run_dir).resolve()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "errors").mkdir(exist_ok=True)
        sock_dir = _socket_dir(run_dir)
        bus = EventBus(run_dir, socket_dir=sock_dir)
        fake_gpu_dir, fake_devices = None, None
        if fake_gpus:
            fake_gpu_dir = str(run_dir / "fakegpu")
            fake_devices = {d.index: d for d in create_fake_devices(fake_gpu_dir, fake_gpus, fake_gpu_bytes)}
        leases = LeaseTable(sorted(fake_devices) if fake_devices else list(gpus), on_event=bus.publish,
                            fake_devices=fake_devices)
        return cls(run_dir, sock_dir, bus, leases, fake_gpu_dir, route_library_noise(run_dir, source="supervisor"))

    def close(self) -> None:
        self.bus.close()
        if self.sock_dir != str(self.run_dir / "sockets"):
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        self.noise.close()


def _socket_dir(run_dir: Path) -> str:
    d = run_dir / "sockets"
    if len(str(d)) + 32 > MAX_IPC_PATH:  # a long run dir would overflow sun_path
        return tempfile.mkdtemp(prefix="tandem-")  # mode 0700
    d.mkdir(mode=0o700, exist_ok=True)
    os.chmod(d, 0o700)
    return str(d)
