"""Tandem's actor runtime: processes, ZeroMQ messaging, supervision, GPU leases.

It knows nothing about PPO or models, and imports no torch.
"""

from runtime.actor import Actor, endpoint
from runtime.errors import ActorDied, CallTimeout, RemoteError, SupervisionFailed
from runtime.handle import ActorGroup, ActorHandle, Future, gather, wait_any
from runtime.shm import shared_empty
from runtime.supervisor import Supervisor

__all__ = ["Actor", "endpoint", "Supervisor", "ActorHandle", "ActorGroup", "Future", "gather", "wait_any",
           "shared_empty", "RemoteError", "ActorDied", "CallTimeout", "SupervisionFailed"]
