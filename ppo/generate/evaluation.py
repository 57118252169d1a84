"""Evaluation on held-out prompt sets, as miles does it (its eval flags, schedule and metric names).

When: before the first rollout unless --skip-eval-before-train, and after every
--eval-interval rollouts, right after the weight sync, once the engines hold the new weights
and their KV cache again (ppo.loop). Where: on the rollout engines and reward scorers, the
same `generate_and_score` as a rollout; never the trainers.

An eval leaves training untouched, bit for bit: its prompts come from their own files (every
line, in file order, no shuffling), and every request carries its own seed, drawn from a
stream of its own (`eval_seed`: the rollout seed and the set's name), so neither the
training data order nor any training sample's seed changes.

Metrics per set NAME, under miles' names (miles/ray/rollout/metrics.py `log_eval_rollout_data`):

    eval/NAME                    mean reward
    eval/NAME-pass@k             k = 1, 2, 4, ... up to --n-samples-per-eval-prompt: the unbiased
                                 estimator 1 - C(n-c, k) / C(n, k) per prompt (c of its n samples
                                 scored 1), averaged over prompts (miles: reward == 1 is correct)
    eval/NAME/response_len/mean  (and /median, /max, /min) response tokens, EOS included
    eval/NAME-truncated_ratio    share of responses cut at the length limit
    eval/NAME-none_reward_ratio  share the scorer failed on (scored 0, as miles counts them)

miles logs an eval after rollout s at step s, so its eval before training and the one after
the first rollout share step 0. Tandem tags an eval with the step whose rollout samples from
the same weights: 0 before training, s + 1 after rollout s.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ppo.generate.sessions import session_ends
from ppo.config import PPOConfig
from ppo.prompts.dataset import PromptDataset
from ppo.generate.rollout import SamplingParams, generate_and_score
from ppo.generate.stops import stop_token_ids


@dataclass(frozen=True, kw_only=True)
class EvalSet:
    """One --eval-prompt-data set, loaded: every prompt of its file, in file order."""

    name: str
    path: str
    prompts: list[dict]  # {"prompt", "prompt_ids", "label", "metadata"}; metadata carries the rm_type
    sampling: SamplingParams


def eval_seed(rollout_seed: int, name: str) -> int:
    """The base seed of a set's requests: a stream apart from the rollouts' (base --rollout-seed)."""
    digest = hashlib.blake2b(f"eval:{rollout_seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fallback(value, default):
    return default if value is None else value


def eval_sampling(cfg: PPOConfig, name: str, stop_ids: tuple[int, ...]) -> SamplingParams:
    """A set's sampling: each --eval-* setting, or the rollout's where it is unset (as miles)."""
    e, r = cfg.evaluation, cfg.rollout
    return SamplingParams(
        n_samples_per_prompt=e.n_samples_per_eval_prompt,
        max_new_tokens=_fallback(e.eval_max_response_len, r.rollout_max_response_len),
        temperature=_fallback(e.eval_temperature, r.rollout_temperature),
        top_p=_fallback(e.eval_top_p, r.rollout_top_p), top_k=_fallback(e.eval_top_k, r.rollout_top_k),
        stop_token_ids=stop_ids, seed=eval_seed(r.rollout_seed, name))


def load_eval_sets(cfg: PPOConfig, paths: list[tuple[str, str]], tok) -> list[EvalSet]:
    """The sets of `paths` ((name, jsonl) from `ppo.setup.generated.resolve_eval_paths`), tokenized. A
    bad line raises ValueError("FILE:LINE: ...") as a bad --prompt-data line does."""
    e, r = cfg.evaluation, cfg.rollout
    rm_types = e.eval_rm_type or ()
    sets = []
    for i, (name, path) in enumerate(paths):
        data = PromptDataset(path, input_key=_fallback(e.eval_input_key, r.input_key),
                             label_key=_fallback(e.eval_label_key, r.label_key), tokenizer=tok,
                             apply_chat_template=r.apply_chat_template, shuffle=False,
                             skip_bad_samples=r.skip_bad_samples)
        prompts = data.next_batch(len(data))
        rm_type = rm_types[0] if len(rm_types) == 1 else rm_types[i] if rm_types else None
        if rm_type is not None:  # as miles' EvalDatasetConfig.inject_metadata: the scorer reads it
            for p in prompts:
                p["metadata"]["rm_type"] = rm_type
        sets.append(EvalSet(name=name, path=str(Path(path)), prompts=prompts,
                            sampling=eval_sampling(cfg, name, stop_token_ids(cfg, tok))))
    return sets


def evaluate(engines, scorers, sets: list[EvalSet], step: int, *, decode, eos_id: int,
             recover, rollout=generate_and_score) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Generate and score every set on the engines (which hold the weights to judge); returns
    (metrics of all sets, samples by set). `step` is the eval's tag: it seeds the requests, so
    each eval draws fresh samples and a re-run of the same eval the same ones. `rollout`: the
    training rollout's (ppo.generate.setup.rollout_function), so a tool-using policy is judged
    with its tools."""
    metrics, samples = {}, {}
    for s in sets:
        samples[s.name] = rollout(engines, scorers, s.prompts, s.sampling, step,
                                  decode=decode, eos_id=eos_id, recover=recover)
        # a response is a session: an agent's records other than its latest are not answers (ppo.generate.sessions)
        metrics |= set_metrics(s.name, session_ends(samples[s.name]), s.sampling.n_samples_per_prompt)
    # all sets' response tokens, EOS included: with perf/eval_time, the eval's throughput (bench.iteration)
    metrics["eval/response_tokens"] = float(sum(len(x["response_ids"]) for v in samples.values() for x in v))
    return metrics, samples


def set_metrics(name: str, samples: list[dict], n: int) -> dict[str, float]:
    """miles' eval metrics of one set; `samples` in request order, `n` per prompt."""
    rewards = [float(s["reward"]) for s in samples]
    lens = [len(s["response_ids"]) for s in samples]
    out = {f"eval/{name}": sum(rewards) / len(rewards)}
    groups = [rewards[g:g + n] for g in range(0, len(rewards), n)]
    for k in pass_k_values(n):
        out[f"eval/{name}-pass@{k}"] = sum(pass_at_k(n, sum(r == 1 for r in g), k) for g in groups) / len(groups)
    out |= {f"eval/{name}/response_len/mean": sum(lens) / len(lens),
            f"eval/{name}/response_len/median": float(statistics.median(lens)),
            f"eval/{name}/response_len/max": float(max(lens)), f"eval/{name}/response_len/min": float(min(lens)),
            f"eval/{name}-truncated_ratio": sum(s["finish_reason"] == "length" for s in samples) / len(samples),
            f"eval/{name}-none_reward_ratio": sum(s["reward_status"] != "ok" for s in samples) / len(samples)}
    return out


def pass_k_values(n: int) -> list[int]:
    """The k reported for n samples per prompt: the powers of two up to n (miles' choice)."""
    return [2 ** i for i in range(int(math.log2(n)) + 1)]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with c correct of n samples (Chen et al. 2021):
    the chance that k of the n drawn without replacement hold a correct one."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def due_before_training(cfg: PPOConfig, step: int) -> bool:
    """miles' train.py: evaluate the initial weights before rollout 0 unless told not to. A
    resumed (or recovered) run does not: its weights were evaluated, if due, before the stop,
    so a resume logs the same lines as the run it continues."""
    e = cfg.evaluation
    return e.eval_interval is not None and step == 0 and not e.skip_eval_before_train


def due_after(cfg: PPOConfig, step: int) -> bool:
    """miles' should_run_periodic_action: after rollout `step` (0-based) when step + 1 is a
    multiple of --eval-interval."""
    e = cfg.evaluation
    return e.eval_interval is not None and (step + 1) % e.eval_interval == 0
