"""Where each step's rollout comes from: generated when the step asks for it, or, with
--train-async (miles' train_async.py), generated one step ahead while the previous step trains.

The driver's loop asks the same three things in both modes; only the timing changes:

    take(step, version)   the rollout of `step`. Synchronous: generated now. Asynchronous:
                          the one a background thread generated during step - 1's training
                          (step 0's, and the first after a resume, generated now); then the
                          next rollout starts generating, on the weights the engines hold.
    wait_generated(v)     before the weights change to version v: the rollout under way is
                          finished, so every request of it ran on one version (miles: "sync
                          generate before update weights"; an engine serves one call at a
                          time, so a sync sent meanwhile would wait for its generate anyway).
    close()               the background rollout is finished (or, on a signal's stop, left to
                          the job's end, which stops the engines it calls).

So the rollout of step k is generated on the weights of version k - 1 (one-step off-policy)
while the trainer is at k, and the objective corrects for it (decoupled PPO: ppo.loop's
mismatch_correction, docs/algorithms.md). Every sample carries the version that generated it
(the engine stamps it); `take` checks each group against the trainer's version and
generates again, on the current engines, any group more than --max-weight-staleness
versions old (miles' "retry" of a stale group), so none is trained on.

Threads. The producer thread calls the engines and the scorers only, except when an engine
dies: its recovery (`recover`) brings the restarted engine to the current policy through
the actor and the lease table, which the driver's thread uses while it trains. `lock`
keeps them apart: the driver's thread holds it except while it waits in `take` and
`wait_generated`, where the actor holds no lease and `version` (given to both) is the
actor's, so a restarted engine is brought to the weights the actor holds. It lets go in
`close` too, after a trainer died mid-step, when a trainer may still hold its GPUs: a
recovery's sync there may fail, and `close` drops that error, because the trainers'
recovery or the run's stop syncs or ends every engine anyway.

A checkpoint written while a rollout is ahead records the data position before that
rollout's prompts (`data_position`): a resumed run generates it again, on its weights.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from ppo.generate.sessions import by_group, renumber

# Seeds of a stale group generated again: a round no dynamic-sampling round (>= 0) has
# (ppo.generate.rollout.sample_seed), so its samples do not repeat the stale ones' randomness.
STALE_RETRY_ROUND = -1

Rollout = tuple[list[dict], dict[str, float]]  # (samples in batch order, sampling metrics)


class Rollouts:
    """Args:
      rollout: step -> (samples, metrics); draws its prompts from `data`, generates and scores them.
      regenerate: (prompts, step, sampling_round) -> samples of those prompts, generated and scored now.
      data: the prompt dataset (its state_dict is the position a checkpoint records).
      ahead: --train-async; num_rollout: no rollout is started past the last step.
      max_staleness: --max-weight-staleness.

    `lock` and `version` are for the rollout's engine recovery (module docstring).
    """

    def __init__(self, rollout: Callable[[int], Rollout], regenerate: Callable[[list[dict], int, int], list[dict]],
                 *, data, ahead: bool, num_rollout: int, max_staleness: int):
        self.rollout, self.regenerate, self.data = rollout, regenerate, data
        self.ahead, self.num_rollout = ahead, num_rollout
        self.max_staleness = max_staleness
        self.lock = threading.RLock()
        self.version = 0
        self._next: _Producer | None = None
        self._position: dict | None = None  # the data position before the rollout ahead drew its prompts

    def __enter__(self) -> Rollouts:
        self.lock.acquire()  # the driver's thread holds it but while it waits (module docstring)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # A signal's stop (RunStopped, KeyboardInterrupt: BaseExceptions) is at once: the rollout
        # ahead is left to die with the job. An error (a trainer's death before its recovery)
        # waits for it, so that it draws no prompts after the recovery restores the data position.
        self.close(wait=exc is None or isinstance(exc, Exception))

    def take(self, step: int, version: int) -> Rollout:
        """Step `step`'s samples, none more than max_staleness versions behind `version`, and
        its metrics (with rollout/staleness, the oldest sample's lag, and rollout/stale_groups)."""
        self.version = version
        producer, self._next = self._next, None
        samples, metrics = self._waiting(producer.result) if producer else self.rollout(step)
        if producer:  # how long it generated beside the last step; perf/rollout_time is the wait for it
            metrics = {**metrics, "perf/rollout_ahead_time": producer.seconds}
        samples, stale = self._fresh(samples, step, version)
        if self.ahead and step + 1 < self.num_rollout:
            self._position = self.data.state_dict()
            self._next = _Producer(lambda: self.rollout(step + 1))
        lag = max(version - s["weight_version"] for s in samples)
        return samples, {**metrics, "rollout/staleness": lag, "rollout/stale_groups": stale}

    def wait_generated(self, version: int) -> None:
        """Block until the rollout generating in the background (if any) is finished; the
        actor now holds `version` (not yet sent to the engines)."""
        self.version = version
        if self._next is not None:
            self._waiting(self._next.done.wait)

    def data_position(self):
        """What a checkpoint records as the data position: the dataset, or with a rollout
        ahead, the position before that rollout drew its prompts."""
        return self.data if self._next is None else _Position(self._position)

    def close(self, wait: bool = True) -> None:
        """Let the lock go, after the background rollout finished (`wait`; its errors go with it:
        the loop is ending) or leaving it to the job's end."""
        if self._next is not None and wait:
            self._waiting(self._next.done.wait)
        self._next = None
        self.lock.release()

    def _waiting(self, wait: Callable[[], object]):
        """`wait()` with the lock let go, so that the producer can recover an engine meanwhile."""
        self.lock.release()
        try:
            return wait()
        finally:
            self.lock.acquire()

    def _fresh(self, samples: list[dict], step: int, version: int) -> tuple[list[dict], int]:
        """`samples` with each group generated more than max_staleness versions before `version`
        generated again now (in place, renumbered as the group it replaces); the count of them."""
        groups = by_group(samples)  # n sessions each (ppo.generate.sessions)
        stale = [g for g, rows in enumerate(groups)
                 if any(version - s["weight_version"] > self.max_staleness for s in rows)]
        if not stale:
            return samples, 0
        again = by_group(self.regenerate([_prompt_of(groups[g][0]) for g in stale], step, STALE_RETRY_ROUND))
        for j, g in enumerate(stale):
            groups[g] = again[j]
        return renumber(groups), len(stale)


def _prompt_of(sample: dict) -> dict:
    """The prompt record (ppo.prompts.dataset) a sample was generated from."""
    return {"prompt": sample["prompt"], "prompt_ids": sample["prompt_ids"], "label": sample["label"],
            "metadata": sample["metadata"]}


class _Position:
    """A data position as a checkpoint reads it (ppo.state.checkpoint.driver_state)."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return self._state


class _Producer:
    """One rollout generating on a daemon thread; `result()` is its value or its exception."""

    def __init__(self, fn: Callable[[], Rollout]):
        self.done = threading.Event()
        self.seconds = 0.0
        self._value: Rollout | None = None
        self._error: BaseException | None = None

        def run():
            t0 = time.monotonic()
            try:
                self._value = fn()
            except BaseException as e:  # raised again in the driver's thread, by result()
                self._error = e
            finally:
                self.seconds = time.monotonic() - t0
                self.done.set()

        threading.Thread(target=run, name="rollout-ahead", daemon=True).start()

    def result(self) -> Rollout:
        self.done.wait()
        if self._error is not None:
            raise self._error
        return self._value
