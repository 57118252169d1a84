"""The error contract of a call: a value, or exactly one of these."""

from __future__ import annotations


class RuntimeActorError(Exception):
    """Base of every error the runtime raises to a caller."""


class RemoteError(RuntimeActorError):
    """The endpoint raised. The actor lives on; ``remote_traceback`` is the actor-side traceback."""

    def __init__(self, role: str, method: str, exc_type: str, message: str, remote_traceback: str):
        super().__init__(f"{role}.{method} raised {exc_type}: {message}\n\n"
                         f"--- remote traceback ({role}) ---\n{remote_traceback}")
        self.role, self.method, self.exc_type = role, method, exc_type
        self.remote_message, self.remote_traceback = message, remote_traceback


class ActorDied(RuntimeActorError):
    """The actor's process ended (or was declared hung) before it replied."""

    def __init__(self, role: str, incarnation: int, reason: str, error_file: str | None = None,
                 error_text: str | None = None):
        msg = f"actor {role!r} (incarnation {incarnation}) died: {reason}"
        if error_file:
            msg += f"\nerror file: {error_file}"
        if error_text:
            msg += f"\n{error_text.rstrip()}"
        super().__init__(msg)
        self.role, self.incarnation, self.reason = role, incarnation, reason
        self.error_file, self.error_text = error_file, error_text


class CallTimeout(RuntimeActorError, TimeoutError):
    """No reply before the call's deadline. The actor may still be working on it."""


class SupervisionFailed(RuntimeActorError):
    """The supervisor gave up (restart intensity exceeded, or a role died while starting)
    and stopped every role. The message carries the failing role's error file."""
