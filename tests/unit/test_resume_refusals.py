"""A resume that would drop saved work silently is refused with one line naming the key: samples in flight with
`rollout.partial.enable=false`, a trained critic with `critic.enable=false` (checked on the loaded trainer state,
before the registry restores anything)."""
import pytest
import torch

from sparserl.config.load import load_config
from sparserl.trainer.critic import CriticStep
from sparserl.trainer.partial import by_dp_rank, refuse_dropping
from sparserl.utils.errors import UserError


def group(*ended: bool) -> dict:
    return {"state": "s", "started": 1, "seed": 7, "seed_index": 0,
            "members": [{"sample_index": i, "ended": e, "kv_budget": None, "sample": {}} for i, e in enumerate(ended)]}


def test_samples_in_flight_are_not_dropped_by_a_resume_without_partial_rollouts():
    state = {"step": 3, "partial": by_dp_rank([(0, True, [group(True, False)]), (1, True, [group(False, False)])], 2)}
    with pytest.raises(UserError) as e:
        refuse_dropping(state, "ckpt", None)
    assert "3 samples in flight" in str(e.value) and "rollout.partial.enable=true" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="1 samples in flight"):
        refuse_dropping({"partial": [group(True, False)]}, "ckpt", None)  # a flat list, as saved before per-rank lists
    # Nothing in flight (or nothing saved): nothing to refuse; with partial rollouts on the registry loads them.
    for fine in ({"step": 3}, {"partial": by_dp_rank([(0, True, [group(True, True)])], 1)}, {"partial": []}):
        refuse_dropping(fine, "ckpt", None)
    refuse_dropping(state, "ckpt", object())


def test_a_trained_critic_is_not_dropped_by_a_resume_without_one():
    off = CriticStep(load_config([]), "", None, torch.device("cpu"))  # critic.enable=false: no model is built
    assert not off.enabled
    with pytest.raises(UserError) as e:
        off.refuse_dropping({"step": 2, "critic_scheduler": {}}, "ckpt")
    assert "critic.enable=true" in str(e.value) and "\n" not in str(e.value)
    off.refuse_dropping({"step": 2}, "ckpt")  # saved without a critic
