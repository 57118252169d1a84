"""Actor and critic trainers (torch backend), in-process on a tiny random Qwen3."""

import math

import pytest
import torch

from roles.device import nbytes_of
from roles.trainer.batching import plan_micro_batches
from roles.trainer.config import TrainerConfig
from roles.trainer.torch import ActorTrainer, CriticTrainer
from roles.weight_checksum import checksum_named_tensors
from roles.weight_sync import unpack_bucket
from runtime.fakegpu import LeaseViolation, create_fake_devices

N, R = 8, 6
PROMPT_LENS = torch.tensor([3, 5, 2, 4, 6, 3, 2, 5])
RESPONSE_LENS = torch.tensor([6, 2, 5, 3, 1, 4, 6, 2])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(ckpt, **overrides):
    base = dict(hf_checkpoint=ckpt, dtype="float32", seed=7, lr=1e-3, min_lr=0.0, lr_decay_style="constant",
                lr_warmup_iters=0, weight_decay=0.1, betas=(0.9, 0.98), clip_grad=1.0, global_batch_size=4,
                micro_batch_size=2, eps_clip=0.2, value_clip=0.2, loss_agg_mode="sum-of-sample-mean",
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k1", entropy_coef=0.0, temperature=1.0,
                keep_ref=False)
    return TrainerConfig(**{**base, **overrides})


def make_actor(ckpt, **overrides):
    actor = ActorTrainer(config(ckpt, **overrides))
    actor.onload(["params", "optimizer"])
    return actor


def make_critic(ckpt, **overrides):
    critic = CriticTrainer(config(ckpt, **overrides))
    critic.onload(["params", "optimizer"])
    return critic


def make_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    total = PROMPT_LENS + RESPONSE_LENS
    input_ids = torch.zeros(N, int(total.max()) + 1, dtype=torch.long)  # one spare padding column
    for i, t in enumerate(total.tolist()):
        input_ids[i, :t] = torch.randint(4, 40, (t,), generator=g)
    loss_mask = torch.ones(N, R)
    loss_mask[0, 2] = 0  # e.g. a tool-output token inside a response
    return {"input_ids": input_ids, "prompt_lens": PROMPT_LENS.clone(),
            "response_lens": RESPONSE_LENS.clone(), "loss_mask": loss_mask}


def resp_mask():
    return torch.arange(R).unsqueeze(0) < RESPONSE_LENS.unsqueeze(1)


def actor_train_batch(actor, seed=0, advantages=None):
    batch = make_batch(seed)
    batch["old_log_probs"] = actor.compute_log_probs(batch)["log_probs"]
    g = torch.Generator().manual_seed(seed + 100)
    batch["advantages"] = torch.randn(N, R, generator=g) if advantages is None else advantages
    return batch


def grads_at_step(trainer):
    """Record every param's grad each time the optimizer steps (before it steps)."""
    captured = []
    step = trainer._core.optimizer.step

    def capturing_step(*args, **kwargs):
        captured.append({n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        return step(*args, **kwargs)

    trainer._core.optimizer.step = capturing_step
    return captured


# ---- forward ------------------------------------------------------------------------------


def test_log_probs_match_a_direct_full_sequence_computation(ckpt):
    actor = make_actor(ckpt, temperature=0.7, max_tokens_per_gpu=20, micro_batch_size=None)
    batch = make_batch()
    got = actor.compute_log_probs(batch)["log_probs"]
    assert got.shape == (N, R) and got.dtype == torch.float32
    with torch.no_grad():
        for i in range(N):
            p, r = int(PROMPT_LENS[i]), int(RESPONSE_LENS[i])
            ids = batch["input_ids"][i : i + 1, : p + r]
            logits = actor.model(input_ids=ids).logits[0].float() / 0.7  # [p + r, V]
            expected = torch.log_softmax(logits[p - 1 : p + r - 1], -1).gather(-1, ids[0, p:, None])[:, 0]
            torch.testing.assert_close(got[i, :r], expected, rtol=1e-5, atol=1e-5)
            assert torch.all(got[i, r:] == 0)
    packed = dict(batch, input_ids=torch.cat([batch["input_ids"][i, : int(t)] for i, t in
                                              enumerate(PROMPT_LENS + RESPONSE_LENS)]))
    torch.testing.assert_close(actor.compute_log_probs(packed)["log_probs"], got, rtol=1e-5, atol=1e-5)


def test_values_are_read_at_the_state_before_each_response_token(ckpt):
    critic = make_critic(ckpt)
    batch = make_batch()
    values = critic.compute_values(batch)["values"]
    assert values.shape == (N, R) and torch.all(values[~resp_mask()] == 0)
    with torch.no_grad():
        p, r = int(PROMPT_LENS[0]), int(RESPONSE_LENS[0])
        hidden = critic.model.backbone(input_ids=batch["input_ids"][:1, : p + r]).last_hidden_state[0]
        expected = critic.model.value_head(hidden[p - 1 : p + r - 1])[:, 0]
    torch.testing.assert_close(values[0, :r], expected, rtol=1e-5, atol=1e-5)
    # Changing response token 2 leaves the values before it (r <= 2) and changes the ones after.
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, p + 2] += 1
    values2 = critic.compute_values(changed)["values"]
    torch.testing.assert_close(values2[0, :3], values[0, :3])
    assert not torch.allclose(values2[0, 3:r], values[0, 3:r])


def test_value_head_init_is_seeded_normal_002_with_zero_bias(ckpt):
    a, b = CriticTrainer(config(ckpt)), CriticTrainer(config(ckpt))
    c = CriticTrainer(config(ckpt, seed=8))
    assert torch.equal(a.model.value_head.weight, b.model.value_head.weight)
    assert not torch.equal(a.model.value_head.weight, c.model.value_head.weight)
    assert torch.all(a.model.value_head.bias == 0)
    assert 0.005 < a.model.value_head.weight.std().item() < 0.05


# ---- training -----------------------------------------------------------------------------


def test_ppo_step_with_positive_advantages_raises_those_log_probs(ckpt):
    actor = make_actor(ckpt, lr=1e-3, global_batch_size=N)
    batch = actor_train_batch(actor, advantages=torch.ones(N, R))
    metrics = actor.train(batch)
    after = actor.compute_log_probs(batch)["log_probs"]
    valid = resp_mask() & (batch["loss_mask"] != 0)
    gain = (after - batch["old_log_probs"])[valid]
    assert gain.mean() > 0.05 and (gain > 0).float().mean() > 0.9
    assert metrics["skipped_nonfinite"] == 0 and metrics["lr"] == 1e-3
    assert metrics["pg_loss"] == pytest.approx(-1.0, abs=1e-5)  # ratio 1 at the first step
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert set(metrics) == {"pg_loss", "pg_clipfrac", "ppo_kl", "grad_norm", "lr", "skipped_nonfinite"}
    assert actor._core.step == 1


def test_critic_training_reduces_value_loss_on_a_fixed_batch(ckpt):
    critic = make_critic(ckpt, lr=3e-3, value_clip=None)
    batch = make_batch()
    batch["old_values"] = critic.compute_values(batch)["values"]
    batch["returns"] = torch.linspace(-1, 1, R).expand(N, R).clone()
    losses = [critic.train(batch)["value_loss"] for _ in range(5)]
    assert losses[-1] < 0.5 * losses[0], losses
    metrics = critic.train(batch)
    assert set(metrics) == {"value_loss", "value_clipfrac", "grad_norm", "lr", "skipped_nonfinite"}


@pytest.mark.parametrize("mode", ["sum-of-sample-mean", "token-mean", "seq-mean-token-mean",
                                  "seq-mean-token-sum"])
def test_dynamic_micro_batches_give_the_same_loss_and_gradients_as_one_big_batch(ckpt, mode):
    """Gradient accumulation: micro-batch losses use the mini-batch's counts and sum up exactly."""
    settings = dict(loss_agg_mode=mode, global_batch_size=N, clip_grad=0.0, entropy_coef=0.01,
                    use_kl_loss=True, keep_ref=True, kl_loss_coef=0.1, kl_loss_type="k3")
    whole = make_actor(ckpt, micro_batch_size=N, **settings)
    split = make_actor(ckpt, micro_batch_size=None, max_tokens_per_gpu=16, **settings)
    batch = actor_train_batch(whole)
    # Different old log-probs from the current ones, so ratio, KL and clipping are all non-trivial.
    batch["old_log_probs"] = batch["old_log_probs"] + 0.3 * torch.randn(N, R, generator=torch.Generator().manual_seed(1))
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.2
    grads_whole, grads_split = grads_at_step(whole), grads_at_step(split)
    m_whole, m_split = whole.train(batch), split.train(batch)
    assert len(plan_micro_batches((PROMPT_LENS + RESPONSE_LENS).tolist(), max_tokens=16)) >= 3
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy_loss", "kl_loss", "grad_norm"):
        assert m_split[key] == pytest.approx(m_whole[key], rel=1e-4, abs=1e-6), key
    for name, g in grads_whole[0].items():
        torch.testing.assert_close(grads_split[0][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_nonfinite_loss_skips_the_update_and_leaves_weights_bit_identical(ckpt):
    actor = make_actor(ckpt, global_batch_size=N)
    batch = actor_train_batch(actor)
    batch["advantages"][3, 0] = float("nan")
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    metrics = actor.train(batch)
    assert metrics["skipped_nonfinite"] == 1
    assert actor._core.step == 0 and not actor._core.optimizer.state
    for name, p in actor.model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None
    batch["advantages"][3, 0] = 1.0  # the next finite batch trains normally
    assert actor.train(batch)["skipped_nonfinite"] == 0 and actor._core.step == 1


def test_under_mps_a_trainer_whose_gemms_come_out_wrong_stops_before_its_update(ckpt, monkeypatch):
    """Side by side under MPS each train call first checks a few GEMMs (roles.compute_check:
    cuBLAS leaves outputs unwritten at some shares, with no error): wrong ones stop the call,
    naming the role, before the weights change. Without MPS nothing is checked."""
    import roles.compute_check as cc

    actor = make_actor(ckpt, global_batch_size=N)
    batch = actor_train_batch(actor)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    monkeypatch.setattr(cc, "under_mps", lambda: True)
    monkeypatch.setenv(cc.MPS_SHARE_ENV, "100")
    monkeypatch.setattr(cc, "wrong_gemms", lambda device, matmul, shapes: [("wgrad", *shapes[0])])
    with pytest.raises(cc.ComputeWrong, match=r"^actor: in its MPS client \(100% of the SMs\) 1 of 9 bf16 GEMMs came "
                                              r"out wrong \(the first: the wgrad GEMM of a linear of 134 x 64 -> 256"):
        actor.train(batch)
    assert actor._core.step == 0 and actor.state == "onloaded"
    assert all(torch.equal(p, before[n]) for n, p in actor.model.named_parameters())
    monkeypatch.setattr(cc, "under_mps", lambda: False)
    assert actor.train(batch)["skipped_nonfinite"] == 0 and actor._core.step == 1


def test_masked_out_nan_does_not_poison_the_loss(ckpt):
    actor = make_actor(ckpt, global_batch_size=N)
    batch = actor_train_batch(actor)
    batch["advantages"][~resp_mask()] = float("nan")  # padding may hold anything
    batch["old_log_probs"][0, 2] = float("-inf")  # loss_mask is 0 there
    metrics = actor.train(batch)
    assert metrics["skipped_nonfinite"] == 0 and math.isfinite(metrics["pg_loss"])


def test_training_is_deterministic_for_a_seed(ckpt):
    results = []
    for _ in range(2):
        actor = make_actor(ckpt, entropy_coef=0.01)
        metrics = actor.train(actor_train_batch(actor))
        results.append((metrics, actor.weights_checksum()))
    assert results[0] == results[1]


def test_log_entropy_reports_entropy_without_changing_the_update(ckpt):
    runs = []
    for log_entropy in (False, True):
        actor = make_actor(ckpt, log_entropy=log_entropy)
        metrics = actor.train(actor_train_batch(actor))
        runs.append((metrics, actor.weights_checksum()))
    (plain, plain_weights), (logged, logged_weights) = runs
    assert plain_weights == logged_weights
    assert {k: v for k, v in logged.items() if k != "entropy_loss"} == plain
    vocab = ActorTrainer(config(ckpt)).model.config.vocab_size
    assert 0 < logged["entropy_loss"] <= math.log(vocab)


def test_gradient_checkpointing_gives_the_same_update(ckpt):
    checksums = []
    for gc in (False, True):
        critic = make_critic(ckpt, gradient_checkpointing=gc)
        batch = make_batch()
        batch.update(old_values=critic.compute_values(batch)["values"], returns=torch.ones(N, R))
        critic.train(batch)
        checksums.append(checksum_named_tensors(critic.model.named_parameters()))
    assert checksums[0] == checksums[1]


@pytest.mark.parametrize("renamed", [True, False], ids=["activation_checkpointing", "gradient_checkpointing"])
def test_checkpointing_is_enabled_under_either_transformers_name(ckpt, renamed):
    """Recent transformers 5.x calls it activation_checkpointing_enable; the GPU image's 5.x
    only has gradient_checkpointing_enable (the missing name broke the torch trainer there)."""
    from transformers import AutoModelForCausalLM

    from roles.trainer.torch.model import enable_checkpointing

    model = AutoModelForCausalLM.from_pretrained(ckpt)
    calls = []
    if not renamed:
        # The older transformers: only the old name, doing the work itself under the old keyword.
        def old_name(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)
            self._activation_checkpointing_enable(gradient_checkpointing_kwargs)  # what the old call did

        model.__class__ = type("OlderTransformers", (model.__class__,),
                               {"activation_checkpointing_enable": None, "gradient_checkpointing_enable": old_name})
    assert not model.is_gradient_checkpointing
    enable_checkpointing(model)
    assert model.is_gradient_checkpointing
    assert calls == ([] if renamed else [{"use_reentrant": False}])


# ---- reference copy -----------------------------------------------------------------------


def test_no_reference_copy_without_keep_ref(ckpt):
    actor = make_actor(ckpt)
    assert actor._ref_params is None
    with pytest.raises(RuntimeError, match="keep_ref=True"):
        actor.compute_ref_log_probs(make_batch())


def test_ref_log_probs_stay_those_of_the_initial_policy(ckpt):
    actor = make_actor(ckpt, keep_ref=True)
    batch = actor_train_batch(actor, advantages=torch.ones(N, R))
    initial = batch["old_log_probs"]
    torch.testing.assert_close(actor.compute_ref_log_probs(batch)["log_probs"], initial, rtol=0, atol=0)
    actor.train(batch)
    trained = actor.compute_log_probs(batch)["log_probs"]
    assert not torch.allclose(trained, initial)
    torch.testing.assert_close(actor.compute_ref_log_probs(batch)["log_probs"], initial, rtol=0, atol=0)
    torch.testing.assert_close(actor.compute_log_probs(batch)["log_probs"], trained, rtol=0, atol=0)


# ---- memory -------------------------------------------------------------------------------


def test_offload_onload_account_params_optimizer_and_grads_on_fake_gpu(ckpt, tmp_path, monkeypatch):
    device = create_fake_devices(tmp_path / "gpus", 1, 1 << 30)[0]
    monkeypatch.setenv("TANDEM_FAKE_GPU_DIR", str(tmp_path / "gpus"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    actor = ActorTrainer(config(ckpt))
    assert device.usage("actor") == 0  # built without the lease: nothing on the device yet
    with pytest.raises(RuntimeError, match="onload"):
        actor.compute_log_probs(make_batch())
    with pytest.raises(LeaseViolation):
        actor.onload(["params"])

    device.set_lease_holder("actor")
    params = nbytes_of(actor.model)
    actor.onload(["params", "optimizer", "grads"])
    assert device.usage("actor", "params") == params
    assert device.usage("actor", "optimizer") == 0  # AdamW state does not exist before the first step
    actor.train(actor_train_batch(actor))
    weight_bytes = sum(p.numel() * 4 for p in actor.model.parameters())
    optimizer_bytes = device.usage("actor", "optimizer")
    assert optimizer_bytes == 2 * weight_bytes  # float32 exp_avg + exp_avg_sq
    assert device.usage("actor", "grads") == 0  # freed after the step
    grad_peak = [h["nbytes"] for h in device.history() if h["kind"] == "usage" and h["tag"] == "grads"]
    assert max(grad_peak) == weight_bytes

    report = actor.offload(["optimizer", "grads"])
    assert report["ledger"] == {"params": params}
    assert device.usage("actor") == params  # bf16 weights stay for the weight sync
    actor.offload(["params"])
    assert device.usage("actor") == 0

    device.set_lease_holder("rollout")
    actor.offload(["params"])  # shrinking never needs the lease
    with pytest.raises(LeaseViolation):
        actor.onload(["optimizer"])
    device.set_lease_holder("actor")
    actor.onload(["params", "optimizer"])
    assert device.usage("actor", "optimizer") == optimizer_bytes
    assert actor.train(actor_train_batch(actor))["skipped_nonfinite"] == 0


# ---- weights ------------------------------------------------------------------------------


class _Done:
    def __init__(self, value=None):
        self.value = value

    def result(self, timeout=None):
        return self.value


class _Method:
    def __init__(self, fn):
        self.call = lambda *args: _Done(fn(*args))


class StubEngine:
    """Receives buckets like a rollout engine: copies each tensor out before acking."""

    def __init__(self, log, name):
        self.weights, self.version = {}, None
        self.update_weights = _Method(lambda bucket: self._update(bucket, log, name))
        self.set_weight_version = _Method(lambda v: setattr(self, "version", v))

    def _update(self, bucket, log, name):
        log.append((name, tuple(bucket["names"])))
        for tensor_name, view in unpack_bucket(bucket):
            self.weights[tensor_name] = view.clone()


def test_sync_weights_makes_engine_checksums_equal(ckpt):
    actor = make_actor(ckpt, dtype="bfloat16")
    actor.train(actor_train_batch(actor))
    log = []
    engines = [StubEngine(log, "a"), StubEngine(log, "b")]
    stats = actor.sync_weights(engines, buffer_bytes=64 * 1024, version=3)
    expected = actor.weights_checksum()
    assert set(expected) == {n for n, _ in actor.model.named_parameters()}
    assert "model.embed_tokens.weight" in expected and "lm_head.weight" in expected
    for engine in engines:
        assert engine.version == 3
        assert checksum_named_tensors(engine.weights.items()) == expected
        assert all(t.dtype == torch.bfloat16 for t in engine.weights.values())
    assert stats["buckets"] > 1 and stats["bytes"] == sum(p.numel() * 2 for p in actor.model.parameters())
    # every bucket went to both engines, in order (tests/test_weight_sync.py: how many are in flight)
    assert [name for name, _ in log] == ["a", "b"] * stats["buckets"]


# ---- checkpoints --------------------------------------------------------------------------


def test_save_and_load_resume_training_exactly(ckpt, tmp_path):
    actor = make_actor(ckpt, lr_decay_style="linear", lr_decay_iters=10)
    actor.train(actor_train_batch(actor, seed=1))
    actor.save(str(tmp_path / "ckpt"))
    actor.save(str(tmp_path / "ckpt"))  # overwriting an existing checkpoint is atomic too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    batch = actor_train_batch(actor, seed=2)
    continued = actor.train(batch)

    resumed = make_actor(ckpt, lr_decay_style="linear", lr_decay_iters=10)
    info = resumed.load(str(tmp_path / "ckpt"))
    assert info["step"] == 2
    assert resumed.train(batch) == continued
    assert resumed.weights_checksum() == actor.weights_checksum()

    critic = make_critic(ckpt)
    critic_batch = make_batch()
    critic_batch.update(old_values=critic.compute_values(critic_batch)["values"], returns=torch.ones(N, R))
    critic.train(critic_batch)
    critic.save(str(tmp_path / "critic"))
    other = make_critic(ckpt, seed=99)
    other.load(str(tmp_path / "critic"))
    torch.testing.assert_close(other.compute_values(critic_batch)["values"],
                               critic.compute_values(critic_batch)["values"], rtol=0, atol=0)
