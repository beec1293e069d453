"""Guess-the-number env: a small multi-turn example (an observation back each turn, `done=False` until it ends).

The prompt asks for a whole number from LOW to HIGH. Each turn the model answers; the env reads the answer's
last integer and replies, as the next user message, "Higher." or "Lower." (or asks for a number when there is
none), until the guess is right or `max_turns` turns are used. The reward comes at the end: 1.0 for a right
guess at turn 1, `TURN_DECAY` less for each turn after it, 0 when the turns run out, so a policy that uses the
hints earns more than one that guesses blindly (a blind guesser that never repeats itself finds the number
within 4 turns 4 times in 10; halving the range with the hints finds it every time).

What it shows an env writer (the contract is sparserl/utils/envload.py's docstring):
- `state` is the conversation text so far (chat markers included), `action` this turn's response without its
  end-of-turn token; a turn that goes on returns `next_state = state + action + observation`, where the
  observation closes the assistant turn, adds the user message and opens the next assistant turn in the
  model's chat format (ChatML and Llama-3 markers are recognised from the state; other prompts get a plain
  "User:/Assistant:" turn). The trainer masks the observation's tokens out of the loss.
- Per-trajectory memory lives in `extra_info` (here the turn count): return a new dict, never mutate the one
  passed in, since the `n` samples of a prompt start from the same row.
- The reward of each step is summed; `score` (the last step's) is what evaluation reports.

Train on it with `env.path=envs/guess_number.py env.max_turns=4` (prompts come from `make_prompts`).
"""
from __future__ import annotations

import random

from sparserl.rewards.math import extract_last_integer

max_turns = 4
LOW, HIGH = 1, 10
TURN_DECAY = 0.2
QUESTION = (f"I am thinking of a whole number from {LOW} to {HIGH}. Guess it. After each guess I will tell you "
            "whether my number is higher or lower. Answer with just the number.")


def make_prompts(num: int, seed: int) -> list[dict]:
    """`num` rows like a data file's: {"prompt": [user message], "answer": "7"}; same seed, same rows."""
    rng = random.Random(seed)
    return [{"prompt": [{"role": "user", "content": QUESTION}], "answer": str(rng.randint(LOW, HIGH))}
            for _ in range(num)]


def extract_answer(response: str) -> str | None:
    """The guess a response makes: its last integer."""
    value = extract_last_integer(response)
    return None if value is None else str(value)


def user_turn(state: str, message: str) -> str:
    """The text that ends the assistant's turn, says `message` as the user and opens the assistant's next turn."""
    if "<|im_start|>" in state:  # ChatML (SmolLM2, Qwen): the newline after the generated <|im_end|>
        return f"\n<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    if "<|start_header_id|>" in state:  # Llama 3: the generated <|eot_id|> closed the turn
        return f"<|start_header_id|>user<|end_header_id|>\n\n{message}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    return f"\nUser: {message}\nAssistant:"


async def step(state: str, action: str, extra_info: dict) -> dict:
    if "answer" not in extra_info:
        raise KeyError("the guess_number env needs extra_info['answer'] (rows from make_prompts carry it)")
    secret, turn = int(extra_info["answer"]), int(extra_info.get("turn", 0)) + 1
    info = {**extra_info, "turn": turn}
    guess = extract_last_integer(action)
    if guess == secret:
        reward = max(0.0, 1.0 - TURN_DECAY * (turn - 1))
        return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": info}
    if turn >= max_turns:
        return {"next_state": None, "reward": 0.0, "score": 0.0, "done": True, "extra_info": info}
    hint = "Answer with just a number." if guess is None else ("Higher." if secret > guess else "Lower.")
    return {"next_state": state + action + user_turn(state, hint), "reward": 0.0, "score": 0.0, "done": False,
            "extra_info": info}
