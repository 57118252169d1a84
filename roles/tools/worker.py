"""One tool worker process: runs the calls ``ToolExecutor`` sends it, one at a time, each in a
fresh sandbox (``roles.tools.sandbox.run_call``).

Started as ``python -m roles.tools.worker PARENT_PID``; JSON lines on stdin and stdout. The
first line in is the setup ``{"bwrap", "limits", "function_path", "sys_path"}``, answered
``{"ready": true, "uid"}``; then each ``{"id", "name", "arguments", "check"}`` is answered
``{"id", "ok", "text", "error_kind", "cut"}``. The worker runs no tool code itself: what a tool
does ends in its sandbox, and the worker dies only if it is killed.
"""

import json
import signal
import sys
from dataclasses import asdict

from roles.reward.worker import die_with_parent
from roles.tools.sandbox import Limits, run_call, sandbox_uid


def main(parent_pid: int) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the executor decides when workers stop
    setup = json.loads(sys.stdin.readline())
    limits = Limits(**setup["limits"])
    uid = sandbox_uid()
    _send({"ready": True, "uid": uid})
    for line in sys.stdin:
        job = json.loads(line)
        outcome = run_call(bwrap=setup["bwrap"], uid=uid, limits=limits, function_path=setup["function_path"],
                           sys_path=setup["sys_path"], name=job["name"], arguments=job["arguments"],
                           check=job["check"])
        _send({"id": job["id"], **asdict(outcome)})


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="A tool worker: JSON lines on stdin and stdout (started by "
                                                 "roles.tools.executor.ToolExecutor, not by hand).")
    parser.add_argument("parent_pid", type=int, help="the process whose death ends this worker")
    main(parser.parse_args().parent_pid)
