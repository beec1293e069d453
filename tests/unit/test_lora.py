"""LoRA actors (actor/lora.py) on plain tiny models, one process, no process group: injection and its errors, the
merged walk against peft's own merge, adapters off, the tensor-parallel split of adapted modules, adapter folders
(written here, read by peft and by `python -m sparserl.eval`'s model resolution), adapter-only checkpoints, and the
trainer's input checks. The sharded actor (FSDP2, TP, native-engine parity, resume, export) is tests/distributed/test_lora_dist.py.
"""
import json

import pytest
import torch

from sparserl.actor import checkpoint, lora
from sparserl.config import LoRAConfig
from sparserl.utils.errors import UserError
from tests.conftest import tiny_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def spec(rank=4, **kw) -> LoRAConfig:
    return LoRAConfig(**{"rank": rank, "alpha": 16.0, "dropout": 0.0, "target_modules": TARGETS, **kw})


def adapted(family="llama", seed=0, **kw):
    """A tiny model with adapters whose B is not zero (as after training), so merging changes the weights."""
    model = tiny_model(family, seed=seed)
    lora.inject(model, spec(**kw), seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)
    return model


def peft_merged(model) -> dict[str, torch.Tensor]:
    """peft's own merge of an injected model: every LoRA layer merged and unwrapped (a deep copy)."""
    import copy

    from peft.tuners.tuners_utils import BaseTunerLayer

    m = copy.deepcopy(model)
    for name, module in list(m.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent, _, child = name.rpartition(".")
            setattr(m.get_submodule(parent), child, module.get_base_layer())
    return m.state_dict()


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v biases ride along with their weights
def test_only_adapters_train_and_the_merged_walk_is_peft_merge_under_original_names(family):
    model = adapted(family)
    base_names = list(tiny_model(family).state_dict())
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(lora.is_adapter_key(n) for n in trained)
    assert len(trained) == 2 * len(TARGETS) * 2  # A and B of 7 projections in 2 layers
    merged = dict(lora.merged_state(model))
    want = peft_merged(model)
    assert sorted(merged) == sorted(base_names) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(merged[k], v, rtol=0, atol=1e-6)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           model.model.layers[0].self_attn.q_proj.base_layer.weight)
    half = dict(lora.merged_state(model, dtype=torch.bfloat16))
    assert all(half[k].dtype == torch.bfloat16 and torch.equal(half[k], merged[k].to(torch.bfloat16)) for k in merged)
    assert list(lora.merged_state(model, keep=False)) == [(k, None) for k in merged]


def test_adapters_off_is_the_base_model_and_keeps_requires_grad():
    base = tiny_model("llama", seed=0)
    model = adapted("llama", seed=0)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        want = base(ids).logits
        assert not torch.allclose(model(ids).logits, want)
        with lora.adapters_off(model):
            torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
        assert not torch.allclose(model(ids).logits, want)
    assert all(p.requires_grad == lora.is_adapter_key(n) for n, p in model.named_parameters())


def test_adapter_init_is_seeded_and_b_starts_at_zero():
    a, b = tiny_model("llama"), tiny_model("llama")
    lora.inject(a, spec(), seed=3)
    torch.manual_seed(123)  # the global stream does not matter
    lora.inject(b, spec(), seed=3)
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n
        if ".lora_B." in n:
            assert not x.any()


@pytest.mark.parametrize("targets, expect", [
    (["nothing_here"], "actor.lora.target_modules=['nothing_here']"),
    (["lm_head"], "the LM head (lm_head) cannot take an adapter"),
    (["embed_tokens"], "adapters go on linear layers only"),
])
def test_bad_target_modules(targets, expect):
    with pytest.raises(UserError, match=expect.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        lora.inject(tiny_model("llama"), spec(target_modules=targets))


def test_all_linear_adapts_the_seven_projections():
    model = tiny_model("llama")
    lora.inject(model, spec(target_modules=["all-linear"]))
    assert sorted({n.rsplit(".", 1)[-1] for n in lora.lora_layers(model)}) == sorted(TARGETS)


def test_tensor_parallel_split_of_adapted_modules():
    model = adapted("llama")
    attn = model.model.layers[0].self_attn
    col = lora.tp_targets("q", attn.q_proj, "colwise")
    assert [(n, s) for n, _, s in col] == [("q.base_layer", "colwise"), ("q.lora_A.default", "replicate"),
                                           ("q.lora_B.default", "colwise")]
    row = lora.tp_targets("o", attn.o_proj, "rowwise")
    assert [(n, s) for n, _, s in row] == [("o.base_layer", "rowwise"), ("o.lora_A.default", "rowwise"),
                                           ("o.lora_B.default", "replicate")]
    norm = model.model.layers[0].input_layernorm
    assert lora.tp_targets("n", norm, "replicate") == [("n", norm, "replicate")]
    with pytest.raises(ValueError, match="adapters are split only on colwise / rowwise"):
        lora.tp_targets("q", attn.q_proj, "vocab_head")


def test_adapter_folder_loads_in_peft_and_in_eval(tmp_path, tiny_checkpoint):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sparserl.eval.model import resolve_eval_model

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
    lora.inject(model, spec(), seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.05)
    merged = dict(lora.merged_state(model))
    folder = tmp_path / "run" / "hf"
    lora.save_adapter(folder, spec(), lora.base_model_name(str(tiny_checkpoint)), dict(lora.adapter_state(model)))
    config = json.loads((folder / lora.CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
    assert config["base_model_name_or_path"] == str(tiny_checkpoint.resolve())
    # peft reads it as its own
    back = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_checkpoint), str(folder)).merge_and_unload()
    for k, v in back.state_dict().items():
        torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6)
    # eval: the folder itself, and the run folder holding it as hf/
    for given in (folder, folder.parent):
        resolved = resolve_eval_model(str(given))
        assert resolved.path == str(tiny_checkpoint.resolve()) and resolved.adapter == folder
        got = dict(resolved.weights())
        assert sorted(got) == sorted(merged)
        for k, v in got.items():
            torch.testing.assert_close(v, merged[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("damage, expect", [
    ("no_weights", "has no adapter_model.safetensors"),
    ("pickle", "adapter_model.bin is a pickle file"),
    ("not_lora", "describes a IA3 adapter"),
    ("no_base", "has no base_model_name_or_path"),
    ("missing_base", "base_model_name_or_path=/nonexistent/base cannot be found"),
    ("bad_json", "adapter_config.json is not readable JSON"),
])
def test_bad_adapter_folders_one_line_errors(tmp_path, damage, expect):
    from sparserl.eval.model import resolve_eval_model

    folder = tmp_path / "adapter"
    model = tiny_model("llama")
    lora.inject(model, spec())
    lora.save_adapter(folder, spec(), "smollm2-135m-instruct", dict(lora.adapter_state(model)))
    cfg_file = folder / lora.CONFIG_FILE
    cfg = json.loads(cfg_file.read_text())
    if damage in ("no_weights", "pickle"):
        (folder / lora.WEIGHTS_FILE).unlink()
        if damage == "pickle":
            (folder / "adapter_model.bin").write_bytes(b"x")
    elif damage == "not_lora":
        cfg_file.write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    elif damage == "no_base":
        cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": None}))
    elif damage == "missing_base":
        cfg_file.write_text(json.dumps({**cfg, "base_model_name_or_path": "/nonexistent/base"}))
    else:
        cfg_file.write_text("{not json")
    with pytest.raises(UserError, match=expect) as err:
        resolve_eval_model(str(folder))
    assert f"model.path={folder}" in str(err.value) and "\n" not in str(err.value)


def test_adapter_checkpoint_holds_only_adapters_and_refuses_other_settings(tmp_path):
    def make(seed, rank=4, with_adapters=True):
        model = tiny_model("llama", seed=0)
        if with_adapters:
            lora.inject(model, spec(rank=rank), seed=seed)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        return model, opt

    def train_step(model, opt):
        model(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()

    model, opt = make(seed=0)
    train_step(model, opt)
    path = checkpoint.save(tmp_path, 1, model, opt, {"step": 1}, rank=0)
    import torch.distributed.checkpoint as dcp

    keys = [k for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(lora.is_adapter_key(k) for k in keys)
    assert len(keys) == 2 * len(TARGETS) * 2

    fresh, fresh_opt = make(seed=5)
    assert checkpoint.load(path, fresh, fresh_opt) == {"step": 1}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    train_step(model, opt)
    train_step(fresh, fresh_opt)  # the next step from the restored adapters and moments is the same step
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))

    with pytest.raises(UserError, match=r"holds LoRA adapters \(actor.lora.rank > 0\), but this run trains a fully"):
        checkpoint.load(path, *make(seed=0, with_adapters=False))
    with pytest.raises(UserError, match=r"is \[4, 64\] in the checkpoint but \[8, 64\] in this run"):
        checkpoint.load(path, *make(seed=0, rank=8))


def test_trainer_input_checks(tmp_path):
    from sparserl.config.load import load_config
    from sparserl.trainer.preflight import check_lora, check_not_adapter

    with pytest.raises(UserError, match=r"actor.lora.dropout=0.1 with parallel.tp=2"):
        load_config(["actor.lora.rank=8", "actor.lora.dropout=0.1", "parallel.tp=2"])  # a cross-key check
    check_lora(load_config(["actor.lora.rank=8", "actor.lora.dropout=0.1"]))
    folder = tmp_path / "hf"
    lora.save_adapter(folder, spec(), "smollm2-135m-instruct", {})
    with pytest.raises(UserError, match="a LoRA adapter folder, not a full model to train from"):
        check_not_adapter(str(folder))
    check_not_adapter(str(tmp_path))
