"""A real one-host Slurm for the tests (tests/test_slurm.py): munged, slurmctld and slurmd from
Debian's packages (munge, slurm-wlm; .ci/run installs them as root), in the foreground, with a
minimal slurm.conf in a temporary folder. `srun -n2` then starts two tasks on this host, which
launch.py takes for two nodes (SLURM_PROCID is the node rank: ppo/config/cluster.py).

`start` returns None with the reason when it cannot run here (not root, a binary missing, the
daemons not up within the timeout), for the tests to skip with it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo")


@dataclass
class Slurm:
    dir: Path
    env: dict[str, str]  # SLURM_CONF, for srun, sbatch, scancel and scontrol
    procs: list[subprocess.Popen]

    def run(self, *cmd: str, timeout: float = 30, cwd: Path | None = None) -> str:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout,
                              check=True, cwd=cwd).stdout

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(dir: Path, timeout_s: float = 30) -> Slurm | str:
    """Start munged, slurmctld and slurmd under `dir`; a Slurm, or why not."""
    if os.geteuid() != 0:
        return "a one-host Slurm runs its daemons as root (SlurmUser=root): not root here"
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        return f"no {', '.join(missing)} here: apt-get install slurm-wlm slurmctld slurmd munge (.ci/run does as root)"
    if not Path("/etc/munge/munge.key").exists():
        return "no /etc/munge/munge.key (the munge package makes it)"
    dir.mkdir(parents=True, exist_ok=True)
    host, sock = socket.gethostname().split(".")[0], dir / "munge.socket"
    memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20) // 2
    conf = dir / "slurm.conf"
    conf.write_text(f"""ClusterName=tandemci
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={memory_mb} State=UNKNOWN
PartitionName=ci Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    (dir / "state").mkdir(exist_ok=True)
    (dir / "spool").mkdir(exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "SLURM_CONF": str(conf)}
    logs = open(dir / "daemons.log", "w")
    procs = [subprocess.Popen(["munged", "-F", "--force", f"--socket={sock}", f"--pid-file={dir}/munged.pid",
                               f"--seed-file={dir}/munge.seed", f"--log-file={dir}/munged.log"],
                              stdout=logs, stderr=subprocess.STDOUT, start_new_session=True)]
    slurm = Slurm(dir, env, procs)
    until = time.monotonic() + timeout_s
    while not sock.exists() and time.monotonic() < until:
        time.sleep(0.1)
    for daemon in (["slurmctld", "-D", "-i"], ["slurmd", "-D", "-N", host]):
        procs.append(subprocess.Popen([*daemon, "-f", str(conf)], env=env, stdout=logs, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    while time.monotonic() < until:
        if any(p.poll() is not None for p in procs):
            break
        try:
            state = slurm.run("sinfo", "-h", "-o", "%T", timeout=5).strip()
        except (subprocess.SubprocessError, OSError):
            state = ""
        if state in ("idle", "mixed", "allocated"):
            return slurm
        time.sleep(0.5)
    slurm.stop()
    tail = (dir / "daemons.log").read_text()[-600:].strip().replace("\n", " | ")
    return f"the one-host Slurm did not come up within {timeout_s:g} s: {tail}"
