"""What a role started is ended with it: the role's own stop (kill_session_but_self) and the
supervisor's, on a death (`_on_death`) and on a stop (`_stop_children`); neither dies of a
process it may not signal."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from runtime import Actor, Supervisor, endpoint
from runtime import process


def _eperm_for(protected: int):
    real_kill = os.kill

    def kill(pid, sig):
        if pid == protected:  # another user's process, as a non-root supervisor would see it
            raise PermissionError(1, "Operation not permitted")
        return real_kill(pid, sig)
    return kill


def test_ending_a_session_skips_a_process_it_may_not_signal_and_does_not_wait_for_it(monkeypatch):
    protected = 999_999_999
    monkeypatch.setattr(process, "_session_members", lambda session: [protected])
    monkeypatch.setattr(process.os, "kill", _eperm_for(protected))
    t0 = time.monotonic()
    process.end_session(12345, timeout_s=10.0)
    process.kill_session_but_self(timeout_s=10.0)
    assert time.monotonic() - t0 < 2.0  # not waited for until the timeout
