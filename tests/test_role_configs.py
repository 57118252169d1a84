"""Each role's typed config (ppo.setup.role_configs): built from every recipe, checked in its
__post_init__ with the field, the value and the allowed range, and sent to the role's process
as itself (runtime.wire.register_config)."""

import pytest

from ppo.config.recipes import RECIPES
from ppo.config.serialize import override
from ppo.setup.role_configs import engine_config, reward_model_config, scorer_config, trainer_config
from roles.reward.config import RewardModelConfig, ScorerConfig
from roles.rollout.config import EngineConfig
from roles.trainer.config import TrainerConfig
from runtime import wire

# the role modules register their configs for the wire, as a role's process does on start
import roles.reward.model_scorer  # noqa: F401
import roles.reward.role  # noqa: F401
import roles.rollout.engine  # noqa: F401
import roles.trainer.megatron.trainer  # noqa: F401
import roles.trainer.role  # noqa: F401


def over_the_wire(config):
    cfg = wire.WireConfig(token="t")
    enc = wire.encode(cfg, {"kind": "init", "id": 0, "src": "supervisor", "dst": "role", "method": "__init__",
                            "inc": 0, "deadline": None}, [[config], {}])
    frames = [bytes(f) for f in enc.frames]
    (args, kwargs) = wire.decode_body(cfg, wire.decode_header(cfg, frames), frames)
    return args[0]


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_recipes_role_configs_build_and_arrive_as_themselves(recipe):
    cfg = RECIPES[recipe]()
    if cfg.reward.reward_model_path is None:  # no recipe has one: give it one to build its rank's config
        cfg = override(cfg, reward_model_path="/models/rm")
    configs = [trainer_config(cfg, "ckpt", critic=critic, dtype="bfloat16") for critic in (False, True)]
    configs += [engine_config(cfg, "ckpt", engine_index=i, dtype="bfloat16") for i in range(2)]
    configs += [scorer_config(cfg), reward_model_config(cfg, dtype="bfloat16")]
    for config in configs:
        got = over_the_wire(config)
        assert got == config and type(got) is type(config)
    actor, critic = configs[:2]
    assert type(actor).__name__ == ("MegatronTrainerConfig" if cfg.training.train_backend == "megatron"
                                    else "TrainerConfig")
    assert not critic.keep_ref and not critic.use_kl_loss  # the critic holds no policy near a reference
    assert [c.engine_index for c in configs[2:4]] == [0, 1]


BASE_TRAINER = dict(hf_checkpoint="ckpt", seed=0, lr=1e-3, min_lr=0.0, lr_decay_style="constant", lr_warmup_iters=0,
                    weight_decay=0.0, betas=(0.9, 0.99), clip_grad=1.0, global_batch_size=4, micro_batch_size=2,
                    eps_clip=0.2, value_clip=None, loss_agg_mode="token-mean", use_kl_loss=False, kl_loss_coef=0.0,
                    kl_loss_type="k1", entropy_coef=0.0, temperature=1.0, keep_ref=False)


@pytest.mark.parametrize("build, message", [
    (lambda: EngineConfig(hf_checkpoint="c", backend="vllm"), "engine config: backend='vllm', expected one of"),
    (lambda: EngineConfig(hf_checkpoint="c", max_batch_size=0), "engine config: max_batch_size=0, expected an int >= 1"),
    (lambda: EngineConfig(hf_checkpoint="c", mem_fraction=1.5), r"mem_fraction=1.5, expected in \(0, 1\]"),
    (lambda: EngineConfig(hf_checkpoint="c", kv_cache_bytes=-1), "kv_cache_bytes=-1, expected a positive int"),
    (lambda: EngineConfig(hf_checkpoint="c", max_request_retries=True), "max_request_retries=True, expected an int"),
    (lambda: EngineConfig(hf_checkpoint="c", engine_index=-1), "engine_index=-1, expected an int >= 0"),
    (lambda: ScorerConfig(rm_type="nope"), "scorer config: rm_type='nope', expected a reward rule"),
    (lambda: ScorerConfig(rm_type="math", timeout_s=0), r"timeout_s=0, expected > 0"),
    (lambda: ScorerConfig(rm_type="math", num_workers=0), "num_workers=0, expected >= 1"),
    (lambda: ScorerConfig(rm_type="remote_rm"), "rm_url=None, expected the reward service's URL"),
    (lambda: ScorerConfig(rm_type="remote_rm", rm_url="http://x", max_concurrency=0), "max_concurrency=0"),
    (lambda: RewardModelConfig(path="p", dtype="int8", max_tokens=8), "reward model config: dtype='int8'"),
    (lambda: RewardModelConfig(path="p", dtype="float32", max_tokens=0), "max_tokens=0, expected >= 1"),
    (lambda: TrainerConfig(**{**BASE_TRAINER, "eps_clip": 1.5}), r"trainer config: eps_clip=1.5, expected in \(0, 1\)"),
])
def test_a_bad_value_names_its_field_value_and_range(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_roles_take_their_typed_config_not_keywords():
    from roles.reward.scorer import Scorer
    from roles.rollout.engine import RolloutEngine
    from roles.trainer.torch import ActorTrainer

    with pytest.raises(TypeError, match="takes an EngineConfig"):
        RolloutEngine({"hf_checkpoint": "ckpt"})
    with pytest.raises(TypeError, match="takes a ScorerConfig"):
        Scorer({"rm_type": "math"})
    with pytest.raises(TypeError, match="takes a TrainerConfig .* got dict"):
        ActorTrainer(dict(BASE_TRAINER))
