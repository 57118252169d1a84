"""Aborted requests: sglang's (per version and status class, through the fake built from its
source) and the built-in engine's (out of memory, a non-finite result) are issued again with
their seeds, counted per result, and give up after --rollout-max-request-retries, in one line.
An empty request list is answered without asking the backend; a refused flush_cache stops a
weight update before it opens; a stopped engine shuts its backend down."""

import pytest
import torch

from ppo.tiny_model import EOS_ID
from roles.rollout import EngineConfig, RolloutEngine
from roles.rollout.aborts import RequestsGaveUp
from roles.weight_sync import pack_buckets
from tests.fakes import sglang_engine
from tests.fakes.sglang_engine import OOM_RETRACT, HTTPException

DETERMINISTIC = {"enable_deterministic_inference": True}  # per-request seeds hold (sglang_backend.py)


@pytest.fixture
def fake_sglang(monkeypatch):
    return sglang_engine.install(monkeypatch, eos_id=EOS_ID)


def _requests(*prompts, seed=7):
    return [{"id": i, "prompt_ids": p, "sampling": {"max_new_tokens": 3, "seed": seed + i}}
            for i, p in enumerate(prompts)]


def _sglang(ckpt, fake_sglang, version, **kw):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", options=DETERMINISTIC, **kw))
    fake = fake_sglang.instances[-1]
    fake.version = version
    return eng, fake


# status -> how each sglang version hands the abort to a non-streaming generate (tokenizer_manager.py)
HOW = {
    "0.5.21": {None: "returned", 400: ValueError, 429: "returned", 500: HTTPException, 503: HTTPException},
    "0.5.23": {None: "returned", 400: ValueError, 429: HTTPException, 500: HTTPException, 503: HTTPException,
               600: "returned"},
}


@pytest.mark.parametrize("version", sorted(HOW))
def test_each_sglang_abort_is_issued_again_with_its_seed_and_counted(ckpt, fake_sglang, version):
    eng, fake = _sglang(ckpt, fake_sglang, version)
    clean = eng.generate(_requests([1, 2], [5]))
    for status, how in HOW[version].items():
        abort = {**OOM_RETRACT, "status_code": status}
        fake.abort_prompts[5] = [abort]  # the fake hands the abort on as that sglang version does
        if how == "returned":
            out = fake.generate(input_ids=[[5]], sampling_params=[{"max_new_tokens": 1}])
            assert out[0]["meta_info"]["finish_reason"]["type"] == "abort", status
        else:
            with pytest.raises(how, match="Out of memory even after retracting"):
                fake.generate(input_ids=[[5]], sampling_params=[{"max_new_tokens": 1}])
        fake.abort_prompts[5] = [abort]
        results = eng.generate(_requests([1, 2], [5]))
        # same seeds, same samples; a raise lost the whole batch, a returned abort only its request
        assert [r["token_ids"] for r in results] == [r["token_ids"] for r in clean], status
        assert [r["num_aborts"] for r in results] == ([0, 1] if how == "returned" else [1, 1]), status


def test_a_request_aborted_past_the_limit_stops_in_one_line_naming_it(ckpt, fake_sglang):
    eng, fake = _sglang(ckpt, fake_sglang, "0.5.23", max_request_retries=2)
    fake.abort_prompts[5] = [{**OOM_RETRACT, "status_code": None}] * 3
    with pytest.raises(RequestsGaveUp) as e:
        eng.generate(_requests([1, 2], [5]))
    assert "\n" not in str(e.value)
    assert "request id=1 was aborted 3 times" in str(e.value) and "Out of memory" in str(e.value)
    assert "--rollout-max-request-retries" in str(e.value)
    fake.abort_prompts[5] = [OOM_RETRACT] * 2  # raised (500): twice is within the limit
    assert [r["num_aborts"] for r in eng.generate(_requests([1, 2], [5]))] == [2, 2]
    fake.abort_prompts[5] = [OOM_RETRACT] * 3  # raised: it names no request, and the call lost them all
    with pytest.raises(RequestsGaveUp, match=r": all 2 requests of the call were aborted 3 times \(the last: "
                                             r"sglang HTTPException: 500: Out of memory"):
        eng.generate(_requests([1, 2], [5]))
    with pytest.raises(ValueError, match="max_request_retries=-1, expected an int >= 0"):
        RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang", max_request_retries=-1))


def test_an_empty_request_list_is_answered_without_asking_sglang(ckpt, fake_sglang):
    eng, fake = _sglang(ckpt, fake_sglang, "0.5.23")
    with pytest.raises(ValueError, match=r"^input_ids cannot be empty\.$"):  # io_struct.py:499
        fake.generate(input_ids=[], sampling_params=[])
    calls = len(fake.calls)
    assert eng.generate([]) == []
    assert eng._backend.generate([], []) == []
    assert len(fake.calls) == calls
    # nor while the weights are released, or lost to a release without a CPU backup
    saver = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, backend="sglang",
                                       options={**DETERMINISTIC, "enable_memory_saver": True}))
    saver.release(["weights", "kv_cache"])
    assert saver.generate([]) == []
    saver.resume(["weights", "kv_cache"])
    with pytest.raises(RuntimeError, match="threw their contents away"):
        saver.generate(_requests([1]))
    assert saver.generate([]) == [] and saver._backend.generate([], []) == []


def test_the_built_in_engine_answers_an_empty_list_and_retries_its_own_aborts(ckpt, monkeypatch):
    eng = RolloutEngine(EngineConfig(hf_checkpoint=ckpt, dtype="float32", max_batch_size=4))
    assert eng.generate([]) == [] and eng._backend.generate([], []) == []
    eng.release(["weights", "kv_cache"])
    assert eng.generate([]) == []  # no weights needed for nothing
    eng.resume(["weights", "kv_cache"])
    clean = eng.generate(_requests([1, 2], [5]))
    scheduler = eng._backend.scheduler
    real = scheduler.generate
    faults = ["oom", "nan"]

    def faulty(requests, seeds, board=None):
        fault = faults.pop(0) if faults else None
        if fault == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        results = real(requests, seeds, board)
        if fault == "nan":  # one request's rows went non-finite: it alone is aborted
            results[-1]["logprobs"][0] = float("nan")
        return results

    monkeypatch.setattr(scheduler, "generate", faulty)
    results = eng.generate(_requests([1, 2], [5]))
    assert [r["token_ids"] for r in results] == [r["token_ids"] for r in clean]
    assert [r["num_aborts"] for r in results] == [1, 2]  # the OOM hit both, the NaN the last one
    faults[:] = ["oom"] * 4
    with pytest.raises(RequestsGaveUp, match="all 2 requests of the call were aborted 4 times .*out of memory"):
        eng.generate(_requests([1, 2], [5]))


def test_a_refused_flush_cache_stops_the_weight_update_before_it_opens(ckpt, fake_sglang):
    eng, fake = _sglang(ckpt, fake_sglang, "0.5.23")
    weights = [(n, t) for n, t in fake.weights.items()][:2]
    bucket = next(iter(pack_buckets(weights, 1 << 30)))
    fake.pending_requests = 1  # scheduler.py:5540-5547: not idle, success False, no message
    with pytest.raises(RuntimeError, match="could not flush its cache.*still queued or running"):
        eng.update_weights(bucket)
    assert ("begin_weight_update",) not in fake.calls and fake.session is None
    fake.pending_requests = 0  # idle again: the same update goes through
    assert eng.update_weights(bucket)["num_tensors"] == 2
    eng.set_weight_version(1)
    assert fake.calls[-4:] == [("flush_cache",), ("begin_weight_update",),
                               ("update_weights", "flattened_bucket", False), ("end_weight_update",)]


def test_stopping_the_engine_shuts_its_backend_down(ckpt, fake_sglang):
    eng, fake = _sglang(ckpt, fake_sglang, "0.5.23")
    eng.on_stop()
    assert fake.calls[-1] == ("shutdown",) and fake.shut_down


class _Done:
    """A finished call, as runtime.handle.Future answers done() and result()."""

    def __init__(self, value=None, exc=None):
        self.value, self.exc = value, exc

    def done(self):
        return True

    def result(self):
        if self.exc is not None:
            raise self.exc
        return self.value


def test_the_driver_counts_aborts_and_stops_in_one_line_when_an_engine_gives_up(monkeypatch, capsys):
    from types import SimpleNamespace

    import launch
    import ppo.loop
    from ppo.loop import rollout_metrics
    from ppo.generate.rollout import RequestsFailed, SamplingParams, generate_and_score
    from runtime import RemoteError

    params = SamplingParams(n_samples_per_prompt=2, max_new_tokens=2, temperature=1.0, top_p=1.0, top_k=-1,
                            stop_token_ids=(), seed=0)
    prompts = [{"prompt": "p", "prompt_ids": [1]}]

    def engine(answer):
        return SimpleNamespace(generate=SimpleNamespace(call=lambda requests: _Done(*answer(requests))))

    ok = engine(lambda reqs: ([{"id": r["id"], "token_ids": [2], "logprobs": [-0.5], "finish_reason": "length",
                                "weight_version": 0, "num_aborts": r["id"]} for r in reqs],))
    samples = generate_and_score([ok], [], prompts, params, 0, decode=str, eos_id=0, recover=None)
    batch = {"loss_mask": torch.ones(2, 1), "scores": torch.zeros(2), "response_lens": torch.ones(2),
             "old_log_probs": torch.zeros(2, 1), "rollout_log_probs": torch.zeros(2, 1),
             "advantages": torch.zeros(2, 1), "returns": torch.zeros(2, 1)}
    assert rollout_metrics(batch, samples)["rollout/aborted_requests"] == 1  # requests 0 and 1: 0 + 1

    line = "rollout engine 0: request id=1 was aborted 4 times (the last: sglang HTTPException: 500: Out of memory)"
    gave_up = engine(lambda reqs: (None, RemoteError("rollout-0", "generate", "RequestsGaveUp", line, "traceback")))
    with pytest.raises(RequestsFailed) as e:
        generate_and_score([gave_up], [], prompts, params, 0, decode=str, eos_id=0, recover=None)
    assert str(e.value) == line

    def train(cfg, sm=None):
        raise RequestsFailed(line)

    monkeypatch.setattr(ppo.loop, "train", train)
    with pytest.raises(SystemExit) as stop:
        launch.main([])
    assert stop.value.code == 1
    assert capsys.readouterr().err == f"tandem: {line}\n"
