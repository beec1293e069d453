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


def test_decode_cache_and_cuda_graphs_both_on_is_a_config_error():
    """The captured decode step keeps no decode cache: asking for both is refused with the two keys named."""
    from sparserl.config.fields import ConfigError
    from sparserl.config.load import load_config

    with pytest.raises(ConfigError, match="rollout.decode_cache=on with rollout.cuda_graphs=on"):
        load_config(["rollout.decode_cache=on", "rollout.cuda_graphs=on"])
    for graphs in ("auto", "off"):
        assert load_config(["rollout.decode_cache=on", f"rollout.cuda_graphs={graphs}"]).rollout.decode_cache == "on"


def test_an_engine_with_graphs_says_it_does_not_use_an_asked_for_decode_cache(capsys):
    """Where graphs resolve on with the decode cache asked for (cuda_graphs=auto on CUDA; `on` here, the eager replay
    on CPU), the engine says in one line that it keeps no decode cache, and keeps none."""
    from sparserl.engines.native.engine import NativeEngine
    from tests.conftest import tiny_model

    engine = NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[], cuda_graphs="on", decode_cache="on")
    said = [line for line in capsys.readouterr().out.splitlines() if "rollout.decode_cache=on is not used" in line]
    assert len(said) == 1 and not engine.runner.use_decode_cache
    NativeEngine(tiny_model("llama"), num_slots=64, eos_token_ids=[], cuda_graphs="off", decode_cache="on")
    assert "decode_cache" not in capsys.readouterr().out


def test_the_disk_check_counts_every_checkpoint_the_run_holds_at_once_and_the_export(tmp_path):
    """With checkpoints on by default a run holds trainer.keep_last of them plus the one being written, and hf/: a
    disk with room for one checkpoint but not for those is refused, naming trainer.keep_last."""
    import shutil

    from sparserl.trainer.preflight import check_free_disk, checkpoint_bytes, checkpoints_held
    from sparserl.utils.errors import UserError

    assert checkpoints_held(total_steps=30, save_every=10, keep_last=3) == 4  # steps 10, 20, 30: 3 kept + 1 written
    assert checkpoints_held(total_steps=100, save_every=10, keep_last=3) == 4
    assert checkpoints_held(total_steps=100, save_every=10, keep_last=0) == 11  # 0 keeps them all (and the end's)
    assert checkpoints_held(total_steps=30, save_every=0, keep_last=3) == 1  # only at the end
    assert checkpoints_held(total_steps=5, save_every=10, keep_last=3) == 1
    free = shutil.disk_usage(tmp_path).free
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    with open(model / "model.safetensors", "wb") as f:
        f.truncate(free // 12)  # sparse: takes no space; one checkpoint of it is about half the free space
    assert checkpoint_bytes(str(model)) <= free // 2 + 16
    check_free_disk(str(tmp_path / "run"), str(model))  # one checkpoint fits
    with pytest.raises(UserError, match=r"holds up to 4 checkpoints at once .* and its hf/ export .*lower "
                                        r"trainer.keep_last"):
        check_free_disk(str(tmp_path / "run"), str(model), checkpoints=4, export_hf=True)
