"""Tool calls read from model text, episode rewards from env steps, and the `env.openreward.envs` checks.

Pure functions: no model, no server. The expected values are worked out by hand in the comments.
"""
from __future__ import annotations

import pytest

from sparserl.rollout.openreward.rewards import episode_reward
from sparserl.rollout.openreward.spec import EnvSpec, parse_envs
from sparserl.rollout.tool_parsers import MalformedCall, ToolCall, get_parser, parse_hermes, parse_llama3_json, parse_mistral
from sparserl.utils.errors import UserError

CALC = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6 * 7"}}\n</tool_call>'


def test_hermes_one_valid_call():
    turn = parse_hermes(CALC)
    assert turn.items == [ToolCall("calc", {"expression": "6 * 7"}, "call_0")]
    assert turn.content == "" and not turn.malformed


def test_hermes_several_calls_in_order_with_text_around_and_after():
    text = ('Let me compute.\n<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}}</tool_call>\n'
            '<tool_call>{"name": "guess", "arguments": {"number": 7}}</tool_call> And then I answer.')
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("calc", {"expression": "1+2"}, "call_0"), ToolCall("guess", {"number": 7}, "call_1")]
    # the text outside the blocks is the content: "Let me compute.\n" + "\n" + " And then I answer."
    assert turn.content == "Let me compute.\n\n And then I answer."


def test_hermes_malformed_json_and_bad_shapes_become_errors_in_place():
    text = ('<tool_call>{"name": "calc", "arguments": {"expression": "1+2"}</tool_call>'  # one closing brace missing
            '<tool_call>{"arguments": {}}</tool_call>'  # no name
            '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>'  # arguments not an object
            '<tool_call>["calc"]</tool_call>'  # not an object at all
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')  # double-encoded: fine
    items = parse_hermes(text).items
    assert [type(x) for x in items] == [MalformedCall, MalformedCall, MalformedCall, MalformedCall, ToolCall]
    assert items[0].error.startswith("invalid JSON in tool call: Expecting ',' delimiter")
    assert items[1].error == 'a tool call needs a "name" string'
    assert items[2].error == 'the "arguments" of calc must be a JSON object, got list'
    assert items[3].error == "a tool call must be a JSON object, got list"
    assert items[4] == ToolCall("calc", {"expression": "2*3"}, "call_0")  # ids count the well-formed calls


def test_hermes_unknown_tool_names_pass_through_and_unclosed_call_is_parsed():
    # The parser does not know the env's tools: an unknown name is the session's to refuse (tested with a server).
    turn = parse_hermes('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>')
    assert turn.calls == [ToolCall("abacus", {}, "call_0")]
    turn = parse_hermes('I will call it. <tool_call>\n{"name": "calc", "arguments": {"expression": "3"}}')  # no closing tag
    assert turn.calls == [ToolCall("calc", {"expression": "3"}, "call_0")] and turn.content == "I will call it."
    assert parse_hermes("The answer is 42.").items == [] and parse_hermes("The answer is 42.").content == "The answer is 42."


def test_other_formats():
    turn = parse_mistral('Sure.[TOOL_CALLS][{"name": "calc", "arguments": {"expression": "2+2"}}, {"name": "f", "arguments": {}}] ok')
    assert turn.calls == [ToolCall("calc", {"expression": "2+2"}, "call_0"), ToolCall("f", {}, "call_1")]
    assert turn.content == "Sure. ok"
    assert isinstance(parse_mistral("[TOOL_CALLS][{oops").items[0], MalformedCall)
    assert parse_llama3_json('{"name": "calc", "parameters": {"expression": "5"}}').calls == [ToolCall("calc", {"expression": "5"}, "call_0")]
    assert parse_llama3_json("The answer is 5").items == []
    assert isinstance(parse_llama3_json('{"name": "calc", "parameters": ').items[0], MalformedCall)
    with pytest.raises(ValueError, match="unknown tool parser 'xml'; choose one of hermes, mistral, llama3_json"):
        get_parser("xml")


STEPS = [0.5, None, -0.2, 1.0]  # a step without a reward, then a penalty, then the win


@pytest.mark.parametrize("reduction, nonterminal, expected", [
    ("sum", 0.0, 1.3),     # 0.5 + 0 - 0.2 + 1.0
    ("mean", 0.0, 0.325),  # 1.3 / 4
    ("max", 0.0, 1.0),
    ("min", 0.0, -0.2),
    ("sum", -0.1, 1.2),    # 0.5 - 0.1 - 0.2 + 1.0
    ("mean", -0.1, 0.3),   # 1.2 / 4
    ("min", -0.5, -0.5),   # the unrewarded step is now the lowest
    ("max", 2.0, 2.0),
])
def test_episode_reward_reductions(reduction, nonterminal, expected):
    spec = EnvSpec("a/b", reward_reduction=reduction, nonterminal_reward=nonterminal)
    assert episode_reward(STEPS, spec) == pytest.approx(expected)


def test_episode_reward_clamps_and_empty_episodes():
    assert episode_reward(STEPS, EnvSpec("a/b", max_reward=1.0)) == 1.0  # sum 1.3 clamped down
    assert episode_reward(STEPS, EnvSpec("a/b", reward_reduction="min", min_reward=0.0)) == 0.0  # -0.2 clamped up
    assert episode_reward(STEPS, EnvSpec("a/b", min_reward=-1.0, max_reward=2.0)) == pytest.approx(1.3)  # inside: kept
    assert episode_reward([], EnvSpec("a/b", reward_reduction="mean")) == 0.0  # no steps: nothing earned
    assert episode_reward([], EnvSpec("a/b", min_reward=0.5)) == 0.5
    assert episode_reward([None, None], EnvSpec("a/b", nonterminal_reward=-0.05)) == pytest.approx(-0.1)


def test_env_specs_from_config_maps():
    specs = parse_envs({"local/CalcArithmetic": {"weight": 2, "splits": ["train", "test"], "num_samples": 8.0},
                        "org/Guess": None})
    assert specs[0] == EnvSpec("local/CalcArithmetic", splits=("train", "test"), num_samples=8, weight=2.0)
    assert specs[1] == EnvSpec("org/Guess") and specs[1].short == "org_Guess"
    with pytest.raises(UserError, match=r"unknown key env\.openreward\.envs\.a/b\.wieght; did you mean weight\?"):
        parse_envs({"a/b": {"wieght": 2}})
    with pytest.raises(UserError, match=r"env\.openreward\.envs\.a/b\.reward_reduction='median': must be one of sum, mean, max, min"):
        parse_envs({"a/b": {"reward_reduction": "median"}})
    with pytest.raises(UserError, match=r"'Calc' is not an environment name of the form Org/Name"):
        parse_envs({"Calc": {}})
    with pytest.raises(UserError, match=r"min_reward=1 must be <= max_reward=0"):
        parse_envs({"a/b": {"min_reward": 1, "max_reward": 0}})
    with pytest.raises(UserError, match=r"weight=0: must be a number > 0"):
        parse_envs({"a/b": {"weight": 0}})


def test_config_keys_of_openreward():
    from sparserl.config.load import load_config

    cfg = load_config(["env.openreward.envs={local/CalcArithmetic: {weight: 2}, local/GuessNumber: {}}",
                       "env.openreward.serve=envs/tool_use.py"])
    assert cfg.env.openreward.envs == {"local/CalcArithmetic": {"weight": 2}, "local/GuessNumber": {}}
    with pytest.raises(UserError, match=r"unknown config key 'env.openreward.bse_url'; did you mean env.openreward.base_url"):
        load_config(["env.openreward.bse_url=http://x"])
    with pytest.raises(UserError, match=r"env\.openreward\.envs\.local/Calc\.max_turn; did you mean max_turns"):
        load_config(["env.openreward.envs={local/Calc: {max_turn: 2}}"])
    with pytest.raises(UserError, match=r"env\.openreward\.envs is a map; give its entries as one value"):
        load_config(["env.openreward.envs.x.weight=2"])


def test_env_weights_set_the_mix_of_every_batch():
    from sparserl.data.prompt_sampler import MixtureSampler

    # 10 calculator rows (0-9) and 4 game rows (10-13), weights 2:1, 6 prompts per step over 2 ranks: every step
    # takes 6 * 2/3 = 4 calculator rows and 2 game rows, and the two ranks split the same global batch.
    ranks = [MixtureSampler([10, 4], [2, 1], 6, r, 2, seed=0) for r in range(2)]
    for _ in range(5):
        b0, b1 = ranks[0].next(), ranks[1].next()
        assert b0.global_indices == b1.global_indices and b0.local_indices + b1.local_indices == b0.global_indices
        assert sum(i >= 10 for i in b0.global_indices) == 2
    # 1:1:1 over 4 prompts: 4/3 each per step; the remainders carry over: (2,1,1), (1,2,1), (1,1,2), then again.
    m = MixtureSampler([5, 5, 5], [1, 1, 1], 4)
    assert [m.quotas() for _ in range(4)] == [[2, 1, 1], [1, 2, 1], [1, 1, 2], [2, 1, 1]]
    # 2:1 over 5 prompts: 10/3 and 5/3 per step; after 30 steps exactly 100 and 50.
    m = MixtureSampler([7, 3], [2, 1], 5, seed=1)
    assert [sum(x) for x in zip(*(m.quotas() for _ in range(30)))] == [100, 50]
    # a resumed sampler continues the same sequence
    a = MixtureSampler([10, 4], [2, 1], 6, seed=3)
    for _ in range(3):
        a.next()
    b = MixtureSampler([10, 4], [2, 1], 6, seed=3)
    b.load_state_dict(a.state_dict())
    assert [a.next().global_indices for _ in range(3)] == [b.next().global_indices for _ in range(3)]
    with pytest.raises(ValueError, match="resuming would change the mix"):
        MixtureSampler([10, 4], [1, 1], 6, seed=3).load_state_dict(a.state_dict())


# A small ChatML template that renders tools itself (as Qwen-style templates do): schemas in a system block, tool
# results as <tool_response> blocks in one user turn, consecutive results merged.
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NO_TOOL_ROLE = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
                "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _with_template(smollm2_tokenizer_dir, template):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    tok.chat_template = template
    return tok


def test_tools_rendered_by_a_template_that_knows_them(smollm2_tokenizer_dir, tokenizer):
    from sparserl.rollout.tool_chat import ToolChat, ToolResult, tool_schema

    calc = tool_schema("calc", "Evaluate.", {"title": "Expr", "type": "object", "required": ["expression"],
                                             "properties": {"expression": {"title": "Expression", "type": "string"}}})
    assert calc["function"]["parameters"] == {"type": "object", "required": ["expression"],
                                               "properties": {"expression": {"type": "string"}}}  # titles dropped
    user = [{"role": "user", "content": "What is 6 * 7?"}]
    tok = _with_template(smollm2_tokenizer_dir, TOOLS_TEMPLATE)
    chat = ToolChat(tok, get_parser("hermes"))
    assert chat.native_tools and chat.end_of_turn == "<|im_end|>\n"  # what the template writes after a message
    prompt = chat.prompt(user, [calc], terminal="submit")
    assert prompt == tok.apply_chat_template(user, tools=[calc], add_generation_prompt=True, tokenize=False)
    assert prompt.startswith('<|im_start|>system\nTools:\n{"type": "function"') and "You can call tools" not in prompt
    turn = tok.encode(CALC + "<|im_end|>", add_special_tokens=False)
    two = [ToolResult("call_0", "calc", "42"), ToolResult("call_1", "calc", "Error: division by zero", True)]
    assert chat.observation(two, turn) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n"
                                           "Error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a turn that ended without the end-of-turn token (a stop string) is closed first
    assert chat.observation(two[:1], turn[:-1]).startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42")

    fallback = ToolChat(tokenizer, get_parser("hermes"))  # SmolLM2's own template ignores tools=
    assert not fallback.native_tools
    prompt = fallback.prompt(user, [calc], terminal="submit: The final answer.")
    assert prompt.startswith("<|im_start|>system\nYou can call tools. Their signatures, one JSON object per line:\n<tools>\n"
                             '{"type": "function", "function": {"name": "calc"')
    assert "ends the episode (submit: The final answer.)" in prompt and prompt.endswith(
        "<|im_start|>user\nWhat is 6 * 7?<|im_end|>\n<|im_start|>assistant\n")

    no_role = ToolChat(_with_template(smollm2_tokenizer_dir, NO_TOOL_ROLE), get_parser("hermes"))
    assert no_role.observation(two[:1], turn) == ('\n<|im_start|>user\n<tool_response>\n{"name": "calc", "content": "42"}\n'
                                                  '</tool_response><|im_end|>\n<|im_start|>assistant\n')
