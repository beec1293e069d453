"""engines/native/runner.py `use_inplace_mlps`: the engine's gated MLPs write the activation and the product over the
gate's output; the logits stay bitwise those of the stock modules, and a forward that needs gradients keeps the stock
forward."""
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from sparserl.engines.native.runner import use_inplace_mlps

CONFIGS = {
    "llama": (LlamaForCausalLM, LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2)),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                            num_attention_heads=4, num_key_value_heads=2)),
}


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_inplace_mlps_give_the_stock_logits_bitwise(arch):
    cls, config = CONFIGS[arch]
    torch.manual_seed(0)
    stock = cls(config).eval()
    patched = copy.deepcopy(stock)
    assert use_inplace_mlps(patched) == config.num_hidden_layers
    ids = torch.randint(0, config.vocab_size, (3, 41))
    with torch.inference_mode():
        assert torch.equal(stock(ids).logits, patched(ids).logits)


def test_a_forward_with_gradients_keeps_the_stock_mlp():
    cls, config = CONFIGS["llama"]
    torch.manual_seed(0)
    stock = cls(config)
    patched = copy.deepcopy(stock)
    use_inplace_mlps(patched)
    ids = torch.randint(0, config.vocab_size, (2, 17))
    for model in (stock, patched):
        model(ids).logits.square().mean().backward()
    for (name, a), b in zip(stock.named_parameters(), patched.parameters()):
        assert torch.equal(a.grad, b.grad), name


def test_models_without_a_gated_silu_mlp_are_left_alone():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    assert use_inplace_mlps(mlp) == 0
