"""The fake-GPU ledger charges what a role really holds during a phase: a micro-batch's
activations and logits, the weight-sync buffers; a plan that does not fit fails by name."""

import pytest
import torch
from transformers import Qwen3Config

from roles.device import nbytes_of
from roles.model_spec import ModelSpec
from roles.phase_memory import layer_activation_elements, micro_batch_bytes
from roles.trainer.torch import ActorTrainer
from roles.weight_sync import SYNC_BUFFER_TAG
from runtime.fakegpu import FakeOutOfMemory, LeaseViolation, create_fake_devices
from tests.test_trainer import StubEngine, actor_train_batch, config, make_batch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QWEN3_4B = ModelSpec.from_hf(Qwen3Config(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                         vocab_size=151936))


def test_estimates_from_the_qwen3_4b_shape():
    assert layer_activation_elements(QWEN3_4B) == 4 * (2560 + 4096 + 1024 + 9728)  # 27.2 x hidden
    tokens = 4 * 2048
    train = micro_batch_bytes(QWEN3_4B, num_tokens=tokens, num_logit_tokens=0, width=2,
                              training=True, with_logits=False)
    assert train == tokens * 36 * 69632 * 2  # 41 GB: why Qwen3-4B needs recomputation or small micro-batches
    ckpt = micro_batch_bytes(QWEN3_4B, num_tokens=tokens, num_logit_tokens=0, width=2,
                             training=True, gradient_checkpointing=True, with_logits=False)
    forward = micro_batch_bytes(QWEN3_4B, num_tokens=tokens, num_logit_tokens=0, width=2,
                                training=False, with_logits=False)
    assert forward < ckpt < train / 10
    logits = micro_batch_bytes(QWEN3_4B, num_tokens=0, num_logit_tokens=tokens, width=2,
                               training=True)
    assert logits == tokens * 151936 * (2 + 4 + 4 + 4)  # bf16 logits, fp32 copy, softmax temp, fp32 grad


def _actor_on_fake_gpu(ckpt, tmp_path, monkeypatch, capacity, onload=("params", "optimizer")):
    device = create_fake_devices(tmp_path / "gpus", 1, capacity)[0]
    monkeypatch.setenv("TANDEM_FAKE_GPU_DIR", str(tmp_path / "gpus"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    actor = ActorTrainer(config(ckpt))
    device.set_lease_holder("actor")
    actor.onload(list(onload))
    return actor, device


def _charges(device, tag):
    return [h["nbytes"] for h in device.history() if h["kind"] == "usage" and h["tag"] == tag]


def test_a_plan_that_fits_is_charged_its_activations_per_micro_batch(ckpt, tmp_path, monkeypatch):
    actor, device = _actor_on_fake_gpu(ckpt, tmp_path, monkeypatch, 1 << 30)
    actor.train(actor_train_batch(actor))
    charges = _charges(device, "activations")
    assert charges and max(charges) > 0 and charges[-1] == 0  # charged while computing, then freed
    model_cfg = actor.model.config
    # the largest micro-batch of make_batch: 2 rows x the padded width, 6 response positions
    biggest = micro_batch_bytes(ModelSpec.from_hf(model_cfg), num_tokens=2 * make_batch()["input_ids"].shape[1], num_logit_tokens=2 * 6,
                                width=4, training=True)
    assert max(charges) <= biggest and max(charges) > nbytes_of(actor.model) // 100
    assert device.usage("actor", "activations") == 0


def test_a_plan_that_does_not_fit_fails_naming_role_phase_and_bytes(ckpt, tmp_path, monkeypatch):
    probe, _ = _actor_on_fake_gpu(ckpt, tmp_path / "probe", monkeypatch, 1 << 30)
    batch = actor_train_batch(probe)
    resident = nbytes_of(probe.model)
    # room for the weights and a little more, not for a micro-batch's activations and logits
    actor, device = _actor_on_fake_gpu(ckpt, tmp_path / "small", monkeypatch, resident + 4096)
    with pytest.raises(FakeOutOfMemory, match=r"actor ran out of fake GPU memory in phase 'forward' "
                                              r"\(activations: [\d.]+ KiB\).*capacity"):
        actor.compute_log_probs(make_batch())
    with pytest.raises(FakeOutOfMemory, match="phase 'train'"):
        actor.train(batch)
    assert device.usage("actor", "activations") == 0  # nothing left charged by the failed phase


def test_the_weight_sync_buffer_is_charged_to_the_sender_while_it_exists(ckpt, tmp_path, monkeypatch):
    actor, device = _actor_on_fake_gpu(ckpt, tmp_path, monkeypatch, 1 << 30)
    actor.offload(["optimizer"])
    engines = [StubEngine([], "a")]
    actor.sync_weights(engines, buffer_bytes=64 * 1024, version=1)
    # double buffering: the first buffer, then the second once a second bucket is packed; none after
    assert _charges(device, SYNC_BUFFER_TAG) == [64 * 1024, 2 * 64 * 1024, 0]
    assert device.usage("actor", SYNC_BUFFER_TAG) == 0
    device.set_lease_holder("rollout-0")  # the sender must hold its GPU to allocate there
    with pytest.raises(LeaseViolation, match=SYNC_BUFFER_TAG):
        actor.sync_weights(engines, buffer_bytes=64 * 1024, version=2)
    device.set_lease_holder("actor")
    with pytest.raises(FakeOutOfMemory, match=SYNC_BUFFER_TAG):
        actor.sync_weights(engines, buffer_bytes=2 << 30, version=2)
    actor.offload(["params"])  # offloaded weights are sent from the CPU: no device buffer
    device.set_lease_holder("rollout-0")
    actor.sync_weights(engines, buffer_bytes=64 * 1024, version=3)


def test_the_second_sync_buffer_must_fit_too(ckpt, tmp_path, monkeypatch):
    """Room for the weights and one bucket buffer but not two: the double-buffered sync
    fails on the fake GPU as it would on the real one, and leaves nothing charged."""
    buffer = 64 * 1024
    resident = nbytes_of(ActorTrainer(config(ckpt)).model)  # what the ledger charges for the weights
    assert resident > 2 * buffer  # the weights need more than one bucket
    actor, device = _actor_on_fake_gpu(ckpt, tmp_path, monkeypatch, resident + buffer + buffer // 2, onload=["params"])
    engine = StubEngine([], "a")
    with pytest.raises(FakeOutOfMemory, match=SYNC_BUFFER_TAG):
        actor.sync_weights([engine], buffer_bytes=buffer, version=1)
    assert _charges(device, SYNC_BUFFER_TAG) == [buffer, 0] and engine.version is None
    assert device.usage("actor") == resident
