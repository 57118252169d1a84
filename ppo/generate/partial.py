"""Partial rollouts (miles' --partial-rollout; APRIL, arXiv 2509.18521): over-sample, stop once
enough groups are complete, abort what is in flight, finish the stragglers in a later rollout.

Response lengths have a long tail, and a rollout that waits for its longest sample runs its
engines at a fraction of their batch at the end. A partial rollout starts --over-sampling-batch-size
groups (the buffered ones first, ppo.generate.partial_buffer), and once --rollout-batch-size
of them are complete it aborts the requests still running on every engine (the abort board,
roles/rollout/abort_board.py). The complete groups, the first --rollout-batch-size of them in
group order, are scored and trained on; every other group goes back to the buffer with its
tokens, log-probs and per-token weight versions, and continues first in a later rollout: each
unfinished sample is sent again as prompt + its tokens so far, for the max_new_tokens it has left.

With dynamic sampling (its filter set) a group counts once it is complete and passes the filter.
The engines' calls return only at the abort, so that goes in rounds: each round starts
--over-sampling-batch-size groups (buffered first), aborts once as many are complete as the batch
still lacks, scores and filters the complete ones (kept fill the batch, dropped are dropped, the
rest go back to the buffer); rounds are capped and a short batch filled with dropped groups, as in
ppo.generate.dynamic_sampling, whose metrics it reports.

With --mask-offpolicy-in-partial-rollout a sample's tokens from earlier rollouts get loss mask 0
(miles masks them the same way); otherwise they train, and their per-token weight versions tell
the objective how far off-policy each one is (sample "weight_versions").

Seeds: sample i (its place in the rollout) begun at step s, round r is seeded with sample_seed(
rollout seed, s, i, r), as ppo.generate.rollout seeds it, and keeps that seed when it continues. The built-in
engine draws each token from (seed, position) (roles/rollout/torch_engine/sampler.py), so a
sample continued on the same weights is the sample an uninterrupted request would have given,
and a rollout that aborts nothing gives what a plain rollout of the same prompts gives.

The abort: the built-in engines decide it in lockstep (`lockstep`), at the first sync of their
shared clock by which enough groups are complete, so it lands on the same tokens in every run and
a run resumed from its checkpoint repeats the uninterrupted one bit for bit; otherwise (sglang)
the driver decides from the finished flags every POLL_S, and where it lands depends on timing.

An engine that dies is replaced and its call issued again (as ppo.generate.rollout does). In
lockstep the others wait for it, and the call replays its syncs up to the same abort. Otherwise a
call issued again after the abort returns at once, its requests as they were before this rollout,
so the rollout may end with fewer complete groups than it needs: then the groups with the fewest
tokens left run to the end without an abort.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from algorithms.partial import offpolicy_metrics
from ppo.generate.dynamic_sampling import DynamicSampling, verdict
from ppo.generate.partial_buffer import PartialSource, is_complete
from ppo.generate.rollout import RequestsFailed, SamplingParams, forced_length, sample_seed, split_evenly
from roles.rollout.abort_board import AbortBoard
from runtime import ActorDied, ActorHandle, RemoteError, wait_any

POLL_S = 0.005  # how often the driver reads the board while the engines generate


def partial_rollout(engines: list[ActorHandle], scorers: list[ActorHandle], source: PartialSource,
                    params: SamplingParams, step: int, *, num_groups: int, over_sampling: int, mask_offpolicy: bool,
                    decode, eos_id: int, recover: Callable[[ActorHandle, int], None], lockstep: bool,
                    dynamic_sampling: DynamicSampling | None = None) -> tuple[list[dict], dict]:
    """(samples of `num_groups` complete groups in batch order, scored; metrics). With
    `dynamic_sampling` (its filter set) a group counts once it passes the filter (module docstring).
    `lockstep`: the engines decide the abort in a shared clock of syncs (the built-in engine's;
    roles/rollout/abort_board.py), so it lands on the same tokens in every run."""
    n, ds = params.n_samples_per_prompt, dynamic_sampling
    rounds = 1 + (ds.max_extra_rounds if ds is not None and ds.keep is not None else 0)
    kept, dropped, reasons, sampled_rewards = [], [], Counter(), []
    aborted = resumed_groups = extra_rounds = 0
    for rnd in range(rounds):
        extra_rounds = rnd
        need = num_groups - len(kept)
        groups = source.next_groups(over_sampling, n, step)
        resumed_groups += sum(any(s["response_ids"] or s["start_step"] < step for s in g) for g in groups)
        aborted += _generate(engines, groups, params, step, rnd, need, recover, lockstep)
        if sum(map(is_complete, groups)) < need:  # a call issued again after the abort (module docstring)
            rest = sorted((g for g in groups if not is_complete(g)), key=lambda g: _tokens_left(g, params))
            _generate(engines, rest[:need - sum(map(is_complete, groups))], params, step, rnd, None, recover, lockstep)
        done = [g for g in groups if is_complete(g)]
        rows = [_sample(s, j, k, n, step, mask_offpolicy, decode, eos_id) for j, g in enumerate(done)
                for k, s in enumerate(g)]
        if ds is not None and ds.keep is not None:
            score_groups(scorers, rows, n, recover)  # the filter reads the rewards
            sampled_rewards += [float(r["reward"]) for r in rows]
        taken = set()
        for j, g in enumerate(done):
            if len(kept) == num_groups:
                break
            group = rows[j * n:(j + 1) * n]
            keep, reason = verdict(ds, group) if ds is not None and ds.keep is not None else (True, None)
            (kept if keep else dropped).append(group)
            if not keep:
                reasons[reason or "filtered"] += 1
            taken.add(id(g))
        source.put_back([g for g in groups if id(g) not in taken])
        if len(kept) == num_groups:
            break
    filled = num_groups - len(kept)  # the cap on rounds reached short of groups: dropped ones fill up
    batch = [dict(s, index=g * n + k, group_index=g)
             for g, group in enumerate(kept + dropped[:filled]) for k, s in enumerate(group)]
    if ds is None or ds.keep is None:
        score_groups(scorers, batch, n, recover)
    metrics = partial_metrics(batch, source, resumed_groups, aborted)
    if ds is not None and ds.keep is not None:  # dynamic sampling's own metrics (ppo.generate.dynamic_sampling)
        metrics.update({
            "rollout/dynamic_sampling_kept_groups": len(kept), "rollout/dynamic_sampling_dropped_groups": len(dropped),
            "rollout/dynamic_sampling_extra_rounds": extra_rounds, "rollout/dynamic_sampling_filled_groups": filled,
            "rollout/sampled_raw_reward": sum(sampled_rewards) / max(len(sampled_rewards), 1),
            **{f"rollout/dynamic_filter/drop_{r}": c for r, c in sorted(reasons.items())}})
    return batch, metrics


def partial_metrics(batch: list[dict], source: PartialSource, resumed_groups: int, aborted: int) -> dict:
    """rollout/partial_* counts of a trained batch (docs/partial_rollouts.md, "Metrics")."""
    resumed = [s for s in batch if s["partial_age"]]
    return {
        # trained samples begun in an earlier rollout, and their tokens generated there
        "rollout/partial_resumed_samples": len(resumed),
        "rollout/partial_carried_tokens": sum(s["partial_carried_tokens"] for s in batch),
        "rollout/partial_max_age": max((s["partial_age"] for s in batch), default=0),
        "rollout/partial_mean_age": sum(s["partial_age"] for s in resumed) / max(len(resumed), 1),
        "rollout/partial_resumed_groups": resumed_groups,  # groups this rollout took from the buffer
        "rollout/partial_aborted_requests": aborted,
        "rollout/partial_buffered_groups": len(source.groups),
        "rollout/partial_buffered_tokens": source.num_buffered_tokens,
    }


def _tokens_left(group: list[dict], params: SamplingParams) -> int:
    """The most tokens the group's unfinished samples may still generate."""
    return sum(_budget(s, k, params) - len(s["response_ids"]) for k, s in enumerate(group) if s["finish_reason"] is None)


def _budget(s: dict, k: int, params: SamplingParams) -> int:
    """Sample k's whole length budget: max_new_tokens, or the length it is told to end at."""
    forced = forced_length(s["prompt"], k)
    return params.max_new_tokens if forced is None else min(forced, params.max_new_tokens)


def _generate(engines: list[ActorHandle], groups: list[list[dict]], params: SamplingParams, step: int, rnd: int,
              need: int | None, recover, lockstep: bool) -> int:
    """Continue every unfinished sample of `groups` (in place); abort the rest once `need` groups
    are complete (None: run all to the end). Returns how many requests the abort stopped."""
    n = params.n_samples_per_prompt
    todo = [(g * n + k, s) for g, group in enumerate(groups) for k, s in enumerate(group) if s["finish_reason"] is None]
    if not todo:
        return 0
    requests = [_request(rid, i, s, params, step, rnd) for rid, (i, s) in enumerate(todo)]
    chunks = split_evenly(requests, len(engines))
    # the board counts the groups with requests: the complete ones without count already
    waiting = {i // n for i, _ in todo}
    on_board = None if need is None else need - (len(groups) - len(waiting))
    board = AbortBoard.create([i // n for i, _ in todo], [c for c, chunk in enumerate(chunks) for _ in chunk],
                              on_board, lockstep)
    with board:
        try:
            answers = _call_all(engines, "generate", chunks, recover, between=board.check, abort_board=board.path)
        except BaseException:
            board.abort()  # no call may wait in lockstep for one that will not come
            raise
    results = {r["id"]: r for answer in answers for r in answer}
    for rid, (_, s) in enumerate(todo):
        _append(s, results[rid], step)
    return sum(r["finish_reason"] == "abort" for r in results.values())


def _request(rid: int, index: int, s: dict, params: SamplingParams, step: int, rnd: int) -> dict:
    """Sample `s` continued: its prompt and tokens so far, for the tokens it has left, with the seed
    it got in its first rollout (module docstring)."""
    if "seed" not in s:
        s["seed"] = sample_seed(params.seed, step, index, rnd)
    k = index % params.n_samples_per_prompt
    forced = forced_length(s["prompt"], k) is not None
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                "max_new_tokens": _budget(s, k, params) - len(s["response_ids"]),
                "stop_token_ids": list(params.stop_token_ids), "seed": s["seed"],
                **({"ignore_eos": True} if forced else {})}
    return {"id": rid, "prompt_ids": list(s["prompt"]["prompt_ids"]) + list(s["response_ids"]), "sampling": sampling}


def _append(s: dict, r: dict, step: int) -> None:
    """One segment of engine output, generated at rollout `step`, onto sample `s`."""
    if r["token_ids"]:
        s["segment_starts"].append(len(s["response_ids"]))
        s["segment_steps"].append(step)
        s["response_ids"] += r["token_ids"]
        s["rollout_log_probs"] += r["logprobs"]
        s["weight_versions"] += [r["weight_version"]] * len(r["token_ids"])
    s["num_aborts"] += r["num_aborts"]
    s["finish_reason"] = None if r["finish_reason"] == "abort" else r["finish_reason"]


def _carried_tokens(s: dict, step: int) -> int:
    """Tokens of sample `s` generated in rollouts before `step`."""
    here = [start for start, at in zip(s["segment_starts"], s["segment_steps"]) if at == step]
    return here[0] if here else len(s["response_ids"])


def _sample(s: dict, group: int, k: int, n: int, step: int, mask_offpolicy: bool, decode, eos_id: int) -> dict:
    """A rollout sample (ppo.generate.rollout's fields) of a finished buffered sample, with its
    per-token weight versions and partial_* counts."""
    prompt, ids = s["prompt"], s["response_ids"]
    carried = _carried_tokens(s, step)
    text_ids = ids[:-1] if ids and ids[-1] == eos_id else ids
    out = {"index": group * n + k, "group_index": group, "prompt": prompt["prompt"],
           "prompt_ids": list(prompt["prompt_ids"]), "label": prompt.get("label"), "messages": prompt.get("messages"),
           "metadata": prompt.get("metadata") or {}, "response_ids": list(ids),
           "rollout_log_probs": list(s["rollout_log_probs"]), "weight_versions": list(s["weight_versions"]),
           "finish_reason": s["finish_reason"], "weight_version": s["weight_versions"][-1],
           "response": decode(text_ids), "num_aborts": s["num_aborts"], "sampling_seed": s["seed"],
           "partial_carried_tokens": carried, "partial_age": step - s["start_step"]}
    if mask_offpolicy:
        out["loss_mask"] = [0] * carried + [1] * (len(ids) - carried)
    return out


SCORED_KEYS = ("index", "group_index", "prompt", "response", "label", "metadata")


def score_groups(scorers: list[ActorHandle], samples: list[dict], n: int, recover) -> None:
    """Rewards onto `samples` (whole groups of n, in order), one call per scorer with whole groups
    (a group reward function sees its group together; a scorer that dies is replaced and asked
    again); without scorers (a reward model alone, later: ppo.generate.rewards) 0 and "ok"."""
    if not scorers:
        for s in samples:
            s.update(reward=0.0, reward_status="ok")
        return
    # "index": the sample's place in `samples`, which the scorer's results name
    scored = [dict({k: s[k] for k in SCORED_KEYS}, index=j) for j, s in enumerate(samples)]
    groups = [scored[i:i + n] for i in range(0, len(scored), n)]
    chunks = [[x for g in part for x in g] for part in split_evenly(groups, len(scorers)) if part]
    for results in _call_all(scorers, "score", chunks, recover):
        for res in results:
            samples[res["index"]].update(reward=res["reward"], reward_status=res["status"])


def _call_all(roles: list[ActorHandle], method: str, chunks: list[list[dict]], recover,
              between: Callable[[], None] | None = None, **kwargs) -> list[list]:
    """Each chunk to its role's `method` at once (an empty chunk is not sent); the answers in chunk
    order. A role that dies is replaced (`recover`) and its chunk sent again; an engine that gave up
    on a request stops the rollout (RequestsFailed). `between()` runs every POLL_S meanwhile."""
    def call(i: int):
        while True:
            try:
                return getattr(roles[i], method).call(chunks[i], **kwargs)
            except ActorDied as e:
                recover(roles[i], e.incarnation)

    answers: list[list] = [[] for _ in chunks]
    pending = {i: call(i) for i, chunk in enumerate(chunks) if chunk}
    while pending:
        wait_any(list(pending.values()), timeout=POLL_S)
        for i, fut in list(pending.items()):
            if not fut.done():
                continue
            del pending[i]
            try:
                answers[i] = fut.result()
            except ActorDied as e:
                recover(roles[i], e.incarnation)
                pending[i] = call(i)
            except RemoteError as e:
                if e.exc_type == "RequestsGaveUp":
                    raise RequestsFailed(e.remote_message) from None
                raise
        if between is not None:
            between()
    return answers


def offpolicy_report(batch: dict, version: int) -> dict[str, float]:
    """rollout/partial_* off-policy metrics of a batch whose samples carry weight versions (a partial
    rollout's; none otherwise): algorithms.partial.offpolicy_metrics against the trainer's `version`."""
    if "weight_versions" not in batch:
        return {}
    metrics = offpolicy_metrics(batch["weight_versions"], batch["loss_mask"], version, batch.get("tis_weights"))
    return {f"rollout/partial_{k}": v for k, v in metrics.items()}
