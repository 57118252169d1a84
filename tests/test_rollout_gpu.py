"""Real-GPU paths of the torch rollout backend and DeviceMemory; skipped without CUDA.

Run on a GPU machine with `bash .ci/gpu` (every test marked `gpu`).
"""

import pytest
import torch

from ppo.tiny_model import build_tiny_checkpoint, load_causal_lm
from roles.device import nbytes_of
from roles.rollout import RolloutEngine
from roles.weight_sync import checksum_named_tensors, push_weights

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 14, 6, 17], [9], [7, 8, 9, 10, 11, 12, 13]]


def _reqs(**sampling):
    return [{"id": i, "prompt_ids": p, "sampling": {"max_new_tokens": 12, "ignore_eos": True, "seed": i, **sampling}}
            for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return build_tiny_checkpoint(str(root / "a"), seed=0), build_tiny_checkpoint(str(root / "b"), seed=1)


def test_generates_on_the_gpu_with_teacher_forced_logprobs(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="float32")
    assert eng._memory.kind == "cuda" and next(eng._backend.model.parameters()).is_cuda
    model = load_causal_lm(ckpts[0], "float32").cuda()
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "top_p": 0.9}):
        out = eng.generate(_reqs(**sampling))
        assert out == eng.generate(_reqs(**sampling))  # seeded: reproducible on the GPU too
        for prompt, r in zip(PROMPTS, out):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + r["token_ids"]], device="cuda")).logits[0].float()
            t = sampling["temperature"] or 1.0
            expected = torch.log_softmax(logits[len(prompt) - 1:-1] / t, -1)
            expected = expected.gather(1, torch.tensor(r["token_ids"], device="cuda")[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(r["logprobs"]), expected.cpu(), atol=1e-4, rtol=0)


def test_release_offloads_to_pinned_memory_and_resume_restores(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="bfloat16")
    before = eng.generate(_reqs(temperature=0))
    weights = nbytes_of(eng._backend.model)
    on_gpu = torch.cuda.memory_allocated()
    eng.release(["weights", "kv_cache"])
    assert on_gpu - torch.cuda.memory_allocated() >= weights
    params = list(eng._backend.model.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in params)
    with pytest.raises(RuntimeError, match="released"):
        eng.generate(_reqs())
    eng.resume(["weights", "kv_cache"])
    assert all(p.is_cuda for p in eng._backend.model.parameters())
    assert eng.generate(_reqs(temperature=0)) == before


def test_update_weights_from_cpu_buckets_into_gpu_params(ckpts):
    eng = RolloutEngine(ckpts[0], dtype="bfloat16")
    eng.release(["weights", "kv_cache"])
    eng.resume(["weights"])
    source = load_causal_lm(ckpts[1], "bfloat16").state_dict()
    push_weights(source.items(), eng.update_weights, buffer_bytes=32 * 1024)
    eng.set_weight_version(2)
    eng.resume(["kv_cache"])
    assert eng.weights_checksum() == checksum_named_tensors(source.items())
    fresh = RolloutEngine(ckpts[1], dtype="bfloat16")
    got = eng.generate(_reqs(temperature=0))
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in fresh.generate(_reqs(temperature=0))]
    assert {r["weight_version"] for r in got} == {2}
