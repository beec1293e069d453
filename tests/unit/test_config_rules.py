"""The config rule table against the schema and the registries it mirrors, and the preflight checks of model
files and disk space (called directly; tests/process/test_bad_inputs.py runs the command line's bad inputs)."""
import dataclasses

import pytest
import torch

from sparserl.config.checks import RANGES, RULES


def test_enum_names_are_declared_with_their_fields_and_ranges_are_not_enums():
    """An enum's names live in its field's metadata only: the hand-written table has no enum left."""
    from sparserl.config import Config
    from sparserl.config.load import group_type

    def fields(cls=Config, prefix=""):
        for f in dataclasses.fields(cls):
            sub = group_type(cls, f.name)
            yield from fields(sub, f"{prefix}{f.name}.") if sub is not None else [(f"{prefix}{f.name}", f)]

    declared = {key for key, f in fields() if f.metadata.get("choices")}
    assert not declared & set(RANGES)
    assert declared <= set(RULES) and {k for k, r in RULES.items() if r.names} - {"trainer.resume"} <= declared
    for key, f in fields():
        assert f.metadata.get("help") or key in ("eval.top_p", "eval.max_new_tokens"), f"{key} has no help text"


def test_listed_names_match_their_registries():
    from sparserl.actor.hf import DTYPES
    from sparserl.algo import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG, POLICY_LOSSES
    from sparserl.data.dataset import ANSWER_EXTRACTORS, CHAT_TEMPLATE_MODES
    from sparserl.kv import POLICIES, VARIANTS  # the package registers the built-in policies
    from sparserl.utils.logging import WANDB_MODES

    names = lambda key: set(RULES[key].names)  # noqa: E731
    assert names("rollout.kv.algorithm") == {"none", *POLICIES}
    assert names("rollout.kv.variant") == set(VARIANTS)
    assert names("algo.adv_estimator") == set(ADV_ESTIMATORS)
    assert names("algo.loss_agg") == set(LOSS_AGG)
    assert names("algo.kl.estimator") == set(KL_ESTIMATORS)
    assert names("algo.policy_loss") == set(POLICY_LOSSES)
    assert names("model.dtype") == set(DTYPES) and names("rollout.dtype") == {"auto", *DTYPES}
    assert names("logger.wandb.mode") == set(WANDB_MODES)
    assert names("data.answer_extract") == set(ANSWER_EXTRACTORS)
    assert names("data.apply_chat_template") == set(CHAT_TEMPLATE_MODES)
    from sparserl.rollout.tool_parsers import TOOL_PARSERS

    assert names("env.openreward.tool_parser") == set(TOOL_PARSERS)


def test_pickle_weights_need_opt_in_and_a_full_disk_is_refused(tmp_path):
    """Preflight: a model folder with only pickle weights is refused unless allowed; an output folder whose disk
    cannot hold one checkpoint (a sparse 8 TB weight file stands in for a huge model) is refused."""
    from sparserl.trainer.preflight import check_free_disk, check_weight_files, checkpoint_bytes
    from sparserl.utils.errors import UserError

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    torch.save({"w": torch.zeros(2)}, pickled / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pickle files \(pytorch_model.bin\), which can run code.*model.allow_pickle_weights=true"):
        check_weight_files(str(pickled), allow_pickle=False)
    check_weight_files(str(pickled), allow_pickle=True)

    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    with open(huge / "model.safetensors", "wb") as f:
        f.truncate(8 * 2**40)  # sparse: takes no space
    assert checkpoint_bytes(str(huge)) == 8 * 2**40 // 2 * 12
    check_weight_files(str(huge), allow_pickle=False)
    with pytest.raises(UserError, match=r"trainer.output_dir=.*GiB free on its disk, but one checkpoint of this model takes about 49152.00 GiB"):
        check_free_disk(str(tmp_path / "run"), str(huge))
    check_free_disk(str(tmp_path / "run"), str(pickled))  # no safetensors: no estimate, no refusal
