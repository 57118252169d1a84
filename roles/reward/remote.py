"""Scores samples by a remote reward service over HTTP (``--rm-type remote_rm --rm-url URL``).

The request and response are miles' (``miles/rollout/rm_hub/__init__.py``, ``remote_rm``): one
POST per sample of the JSON ``{"prompt", "response", "label"}`` to the URL; the answer is a JSON
number, or an object from which ``--reward-key`` picks the number (miles' ``get_reward_value``).
What miles leaves to aiohttp's defaults is bounded here, so a slow or dead service costs a
sample, never the run:

- each attempt has ``timeout_s`` in all (connect, send, wait, read): at the deadline a watchdog
  shuts the socket, which ends a blocked read at once, even one fed a byte at a time;
- a failed attempt (no connection, a reset, the deadline, HTTP 5xx or 429) is tried again up to
  ``max_retries`` times, after 0.1 s, 0.2 s, 0.4 s ... (at most 2 s); an HTTP 4xx or an answer
  that is not a reward is the sample's fault and is not retried;
- at most ``max_concurrency`` requests are in flight (per scorer process).

A sample whose last attempt failed gets the failing-rule treatment (``scorer.Scorer``): reward
0.0, status ``"error"`` or ``"timeout"`` and the reason. Threads rather than the worker processes
of the rules: a request is I/O, the GIL is free while it waits, and the watchdog makes each one
end by its deadline, so no thread is ever abandoned.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

from roles.reward.pool import JobResult
from roles.reward.values import reward_value

_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
_MAX_BACKOFF_S = 2.0


class _Retryable(Exception):
    """An attempt that failed for the service's sake (down, slow, overloaded): try again."""


class _Timeout(_Retryable):
    pass


def check_url(url: str) -> tuple[str, int, str]:
    """(host, port, path) of an http URL; ValueError naming what is wrong with it."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"rm_url={url!r} must be an http://HOST[:PORT]/PATH URL")
    try:
        port = parts.port or 80
    except ValueError:
        raise ValueError(f"rm_url={url!r} has a bad port") from None
    return parts.hostname, port, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def service_problem(url: str, timeout_s: float = 5.0) -> str | None:
    """Why the service at `url` cannot be reached now (a bad URL, nothing listening), or None.
    Only a connection is tried: miles' services have no health endpoint to ask."""
    try:
        host, port, _ = check_url(url)
        socket.create_connection((host, port), timeout=timeout_s).close()
    except ValueError as e:
        return f"--rm-url: {e}"
    except OSError as e:
        return (f"--rm-url {url}: the reward service cannot be reached ({e.strerror or e}); "
                "start it, or fix the URL")
    return None


class RemoteReward:
    """Runs reward requests for sample dicts; ``run`` has ``pool.WorkerPool.run``'s contract."""

    def __init__(self, url: str, *, timeout_s: float, max_retries: int, max_concurrency: int,
                 reward_key: str | None = None):
        self._host, self._port, self._path = check_url(url)
        self._url = url
        self._timeout_s = timeout_s
        self._max_retries = max_retries
        self._reward_key = reward_key
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="remote-rm")
        self._lock = threading.Lock()
        self.num_retries = 0

    def run(self, samples: list[dict]) -> list[JobResult]:
        """One result per sample, in order; every one within (max_retries + 1) attempts' time."""
        return list(self._threads.map(self._score, samples))

    def stats(self) -> dict:
        return {"num_retries": self.num_retries}

    def _score(self, sample: dict) -> JobResult:
        payload = json.dumps({"prompt": sample["prompt"], "response": sample["response"],
                              "label": sample["label"]}).encode()
        for attempt in range(self._max_retries + 1):
            if attempt:
                with self._lock:
                    self.num_retries += 1
                time.sleep(min(_MAX_BACKOFF_S, 0.1 * 2 ** (attempt - 1)))
            try:
                answer = self._post(payload)
            except _Retryable as e:
                failure = JobResult(status="timeout" if isinstance(e, _Timeout) else "error",
                                    error=f"{self._url}: {e}")
                continue
            except (TypeError, ValueError) as e:  # the service answered, but not with a reward
                return JobResult(status="error", error=f"{self._url}: {e}")
            return JobResult(status="ok", value=answer)
        return failure

    def _post(self, payload: bytes) -> float:
        """The reward of one attempt; _Retryable if it failed for the service's sake, TypeError or
        ValueError if the service answered without a reward."""
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            if conn.sock is not None:
                try:
                    conn.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(self._timeout_s, expire)
        watchdog.start()
        try:
            conn.request("POST", self._path, body=payload, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            body = response.read()
        except (OSError, http.client.HTTPException) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise _Timeout(f"no answer within {self._timeout_s} s") from None
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
            conn.close()
        if expired.is_set():  # the read may end cleanly at the shutdown, with a cut body
            raise _Timeout(f"no answer within {self._timeout_s} s")
        if response.status in _RETRY_STATUSES:
            raise _Retryable(f"HTTP {response.status} {response.reason}")
        if response.status != 200:
            raise ValueError(f"HTTP {response.status} {response.reason}: {body[:200]!r}")
        try:
            answer = json.loads(body)
        except json.JSONDecodeError:
            raise ValueError(f"the answer is not JSON: {body[:200]!r}") from None
        return reward_value(answer, self._reward_key, "the reward service")

    def close(self) -> None:
        self._threads.shutdown(wait=True)  # each request ends by its deadline
