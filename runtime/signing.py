"""The job's secret: what shows that a node's entry in the rendezvous store, and node 0's hello,
come from a launcher of this job (docs/multinode.md).

The scheduler hands every launcher the same secret (TANDEM_JOB_SECRET: the sbatch script
exports one to its srun tasks; under torchrun or by hand the user exports it on every node).
What a launcher publishes is signed with HMAC-SHA256 under it, over the fields that say who and
where (the job and run, the node rank, its endpoint and public key), and a reader recomputes the
signature and compares it in constant time. The store itself stays c10d's, open to whoever
reaches its port: such a peer can still delete or overwrite keys and stall the rendezvous, but
it cannot pass for a node, so the job's key pair never goes to it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass, field

SECRET_ENV = "TANDEM_JOB_SECRET"
MIN_SECRET_CHARS = 16  # `openssl rand -hex 32` makes 64


@dataclass(frozen=True)
class JobSecret:
    """The job's secret and the scheduler's id of the job ("" when started by hand), which every
    signature covers: a signed entry of another job that shared the secret does not verify."""

    key: bytes = field(repr=False)
    job: str = ""

    def sign(self, purpose: str, fields: dict) -> str:
        """HMAC-SHA256 (hex) of `purpose`, the job id and `fields`, in one canonical encoding
        (the fields nested, so that none can stand in for the purpose or the job)."""
        message = json.dumps({"purpose": purpose, "job": self.job, "fields": fields}, sort_keys=True,
                             separators=(",", ":"), default=_text)
        return hmac.new(self.key, message.encode(), hashlib.sha256).hexdigest()

    def verify(self, mac: object, purpose: str, fields: dict) -> bool:
        """Whether `mac` signs these fields; False too for fields that cannot be signed (what a
        peer sent may hold any type msgpack decodes)."""
        if not isinstance(mac, str):
            return False
        try:
            want = self.sign(purpose, fields)
        except (TypeError, ValueError):
            return False
        return hmac.compare_digest(mac, want)


def _text(value: object) -> str:
    """Bytes (keys, endpoints) signed as the text of their byte values."""
    if isinstance(value, bytes):
        return value.decode("latin-1")
    raise TypeError(f"cannot sign a {type(value).__name__}")
