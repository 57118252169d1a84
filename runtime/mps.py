"""The CUDA MPS control daemon: found running, or started (and then stopped) by us.

Under MPS the processes of one GPU share it as one context, and each may be held to a share
of its SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, read by the CUDA runtime of each client when
it starts). Without MPS two processes on one GPU are time-sliced: side by side then gains
1.11x over running in turn, with MPS at 25/75 1.42x (issue 27's probe on the H200; but at 75%
cuBLAS leaves many GEMM outputs unwritten, so that probe's matmuls may not all have run). At
some shares cuBLAS computes wrong in a client (roles.compute_check): the launcher checks each role's first.

    daemon = find_or_start()                 # MpsUnavailable says why not
    env = daemon.client_env(percentage=25)   # for one role process (priority="below_normal": it yields)
    daemon.stop()                            # only a daemon we started is stopped

The daemon is reached through its pipe directory: CUDA_MPS_PIPE_DIRECTORY when set, else
CUDA's default /tmp/nvidia-mps, where a machine's own daemon (an administrator's) answers.
Where none answers we start ours in a private directory (tempfile, `tandem-mps-*`), not the
default: a daemon there would make every CUDA process the machine starts afterwards its
client (other jobs, other tests), where ours serves only the role processes given
`client_env`. It logs to CUDA_MPS_LOG_DIRECTORY, else a `log` folder beside its pipes (the
default, /var/log/nvidia-mps, needs root).
Whether one runs is asked as the control program's own client does: `get_server_list` on
its standard input exits 0 when a daemon answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass

CONTROL = "nvidia-cuda-mps-control"
PRIVATE_PREFIX = "tandem-mps-"
DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's, where a machine's own daemon listens
CUDA_LOG_DIR = "/var/log/nvidia-mps"  # CUDA's default log folder (root's)
START_TIMEOUT_S = 10.0
# CUDA_MPS_CLIENT_PRIORITY (CUDA 12.4+): the server schedules a below_normal client's work
# after normal clients' ready work, so a below_normal role fills the SMs the others leave idle
PRIORITIES = {"normal": "0", "below_normal": "1"}


class MpsUnavailable(RuntimeError):
    """No MPS daemon runs and none can be started here; the message says why."""


@dataclass(frozen=True, kw_only=True)
class MpsDaemon:
    pipe_dir: str
    log_dir: str
    started: bool  # by us: stop() ends it (and removes its private folder); one found running is left alone
    control: str  # the control program's path

    def client_env(self, *, percentage: int, priority: str = "normal") -> dict[str, str]:
        """The environment of a role process that gets `percentage` of the SMs (1..100), its
        work scheduled at `priority` (PRIORITIES) against the other clients'."""
        if not 1 <= percentage <= 100:
            raise ValueError(f"percentage={percentage}: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE must be in 1..100")
        if priority not in PRIORITIES:
            raise ValueError(f"priority={priority!r}: CUDA_MPS_CLIENT_PRIORITY must be one of {sorted(PRIORITIES)}")
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir,
                "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percentage),
                "CUDA_MPS_CLIENT_PRIORITY": PRIORITIES[priority]}

    def stop(self) -> None:
        """`echo quit | nvidia-cuda-mps-control`, when we started the daemon."""
        if self.started:
            _command(self.control, self.pipe_dir, self.log_dir, "quit")
            if os.path.basename(self.pipe_dir).startswith(PRIVATE_PREFIX):
                shutil.rmtree(self.pipe_dir, ignore_errors=True)


def find_or_start(*, pipe_dir: str | None = None, log_dir: str | None = None,
                  timeout_s: float = START_TIMEOUT_S) -> MpsDaemon:
    """The daemon answering at `pipe_dir` (default: $CUDA_MPS_PIPE_DIRECTORY, else CUDA's
    /tmp/nvidia-mps), or one started with `nvidia-cuda-mps-control -d` at `pipe_dir` (default:
    $CUDA_MPS_PIPE_DIRECTORY, else a new private folder: module note). MpsUnavailable when the
    program is not on PATH, the start fails (not permitted: the message quotes it) or no
    daemon answers within `timeout_s`."""
    control = shutil.which(CONTROL)
    if control is None:
        raise MpsUnavailable(f"{CONTROL} is not on PATH (the NVIDIA driver's MPS tools are not installed)")
    chosen = pipe_dir or os.environ.get("CUDA_MPS_PIPE_DIRECTORY")
    found = chosen or DEFAULT_PIPE_DIR
    log_dir = log_dir or os.environ.get("CUDA_MPS_LOG_DIRECTORY")
    if _answers(control, found, log_dir or CUDA_LOG_DIR):
        return MpsDaemon(pipe_dir=found, log_dir=log_dir or CUDA_LOG_DIR, started=False, control=control)
    pipe_dir = chosen or tempfile.mkdtemp(prefix=PRIVATE_PREFIX)
    try:
        return _start(control, pipe_dir, log_dir or os.path.join(pipe_dir, "log"), timeout_s)
    except MpsUnavailable:
        if not chosen:  # our private folder: nothing is left behind
            shutil.rmtree(pipe_dir, ignore_errors=True)
        raise


def _start(control: str, pipe_dir: str, log_dir: str, timeout_s: float) -> MpsDaemon:
    try:
        os.makedirs(pipe_dir, exist_ok=True)
        os.makedirs(log_dir, exist_ok=True)
    except OSError as e:
        raise MpsUnavailable(f"cannot make MPS's directories ({e})") from None
    try:
        started = subprocess.run([control, "-d"], env=_env(pipe_dir, log_dir), capture_output=True, text=True,
                                 timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise MpsUnavailable(f"`{CONTROL} -d` failed: {e}") from None
    if started.returncode != 0:
        said = (started.stderr or started.stdout).strip() or "nothing"
        raise MpsUnavailable(f"`{CONTROL} -d` exited with {started.returncode} (not permitted?): {said}")
    deadline = time.monotonic() + timeout_s
    while not _answers(control, pipe_dir, log_dir):  # -d returns before the daemon listens
        if time.monotonic() > deadline:
            raise MpsUnavailable(f"`{CONTROL} -d` started but no daemon answered at {pipe_dir} in {timeout_s:g} s")
        time.sleep(0.05)
    return MpsDaemon(pipe_dir=pipe_dir, log_dir=log_dir, started=True, control=control)


def _answers(control: str, pipe_dir: str, log_dir: str) -> bool:
    return _command(control, pipe_dir, log_dir, "get_server_list").returncode == 0


def _command(control: str, pipe_dir: str, log_dir: str, command: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([control], input=command + "\n", env=_env(pipe_dir, log_dir), capture_output=True,
                              text=True, timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:  # a daemon that does not answer is none
        return subprocess.CompletedProcess(e.cmd, 1, "", "timed out")


def _env(pipe_dir: str, log_dir: str) -> dict[str, str]:
    return {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": pipe_dir, "CUDA_MPS_LOG_DIRECTORY": log_dir}
