"""`rollout.partial.*`: what partial rollouts do not combine with is refused at start-up with one line naming the
key and the way out."""
import pytest

from sparserl.config.fields import ConfigError
from sparserl.config.load import load_config

ON = ["rollout.partial.enable=true"]


def test_partial_rollouts_load_with_their_settings():
    cfg = load_config(ON + ["rollout.partial.finish_frac=0.6", "rollout.partial.max_staleness=3"])
    assert (cfg.rollout.partial.finish_frac, cfg.rollout.partial.max_staleness) == (0.6, 3)
    assert load_config(["rollout.engine=sglang"]).rollout.partial.enable is False  # off: nothing refused
    assert load_config(ON + ["env.max_turns=3"]).env.max_turns == 3  # multi-turn episodes are carried
    assert load_config(ON + ["rollout.engine=sglang"]).rollout.engine == "sglang"  # both engines stop and resume


@pytest.mark.parametrize("override, message", [
    ("algo.dynamic_sampling.enable=true", "with algo.dynamic_sampling.enable=true"),
    ("rollout.partial.finish_frac=0", "rollout.partial.finish_frac=0.0: must be in (0, 1]"),
])
def test_what_partial_rollouts_do_not_combine_with_is_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ON + [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_an_env_with_its_own_driver_is_refused_when_the_loop_is_built_and_turns_follow_the_env():
    import types

    from sparserl.engines.types import SamplingParams
    from sparserl.rollout.partial import PartialRollouts, PartialSettings

    driven = types.SimpleNamespace(driver=lambda: None)  # OpenReward's envs drive their own remote sessions
    with pytest.raises(ValueError, match="needs an env module"):
        PartialRollouts(None, None, driven, SamplingParams(), PartialSettings())
    # an env module's own max_turns wins over the config's (env.max_turns), as in the synchronous loop
    assert PartialRollouts(None, None, types.SimpleNamespace(max_turns=4), SamplingParams(), PartialSettings(),
                           max_turns=1).turns == 4
    assert PartialRollouts(None, None, types.SimpleNamespace(), SamplingParams(), PartialSettings(), max_turns=3).turns == 3
