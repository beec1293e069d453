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


@pytest.mark.parametrize("override, message", [
    ("rollout.engine=sglang", "rollout.partial.enable=true with rollout.engine=sglang: only the native engine"),
    ("env.max_turns=3", "rollout.partial.enable=true with env.max_turns=3: multi-turn episodes are not carried"),
    ("algo.dynamic_sampling.enable=true", "with algo.dynamic_sampling.enable=true"),
    ("rollout.partial.finish_frac=0", "rollout.partial.finish_frac=0.0: must be in (0, 1]"),
])
def test_what_partial_rollouts_do_not_combine_with_is_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(ON + [override])
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_multi_turn_env_module_is_refused_when_the_loop_is_built():
    import types

    from sparserl.engines.types import SamplingParams
    from sparserl.rollout.partial import PartialRollouts, PartialSettings

    env = types.SimpleNamespace(max_turns=4)  # an env module that sets its own turns (env.max_turns=1 in the config)
    with pytest.raises(ValueError, match="needs a single-turn env module"):
        PartialRollouts(None, None, env, SamplingParams(), PartialSettings())
    PartialRollouts(None, None, types.SimpleNamespace(max_turns=1), SamplingParams(), PartialSettings())
