"""Long-tail env: count up from a start number, one number per line, to a stated length; the lengths are heavy-tailed
(most responses short, a few 8-16 times longer), the workload partial rollouts are for (docs/training.md).

A prompt is one user message:

    Count up from 37, one number per line, 12 numbers in all.

and the target response is "37\\n38\\n...\\n48". The count is drawn per row: `SHORT` (4 to 8 numbers) with probability
1 - `LONG_FRAC`, else a long one, 8 to 16 times a short one's mean (48 to 96 numbers). With LONG_FRAC = 1/8 about one
row in eight is long, so in a step of a few dozen samples the longest is ~10x the median: a synchronous rollout
spends most of its time decoding a few samples alone.

Reward: the fraction of the count written correctly before the first mistake, k / count for the largest k such that
the first k non-empty lines are the first k numbers; lines after the count are ignored, so a response that does not
stop is not punished by the reward (`rollout.max_new_tokens` bounds it). The row's "answer" is the count's numbers
separated by spaces; `extra_info["target_len"]` is the count, and `target_tokens(row)` the target response's length
in a tokenizer's tokens (benchmarks/partial_rollouts.py caps each response there).

Left out on purpose: a length penalty (the reward says nothing about stopping), and any reasoning (the task only has
to make the lengths heavy-tailed).
"""
from __future__ import annotations

import random

max_turns = 1
SHORT = (4, 8)  # numbers in a short count
LONG_FACTOR = (8, 16)  # a long count is this many times a short one's mean
LONG_FRAC = 0.125
QUESTION = "Count up from {start}, one number per line, {count} numbers in all."


def draw_count(rng: random.Random) -> int:
    mean_short = sum(SHORT) / 2
    if rng.random() < LONG_FRAC:
        return round(mean_short * rng.uniform(*LONG_FACTOR))
    return rng.randint(*SHORT)


def make_prompts(num: int, seed: int) -> list[dict]:
    """`num` rows shaped like a data file's; same seed, same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        start, count = rng.randint(1, 99), draw_count(rng)
        rows.append({"prompt": [{"role": "user", "content": QUESTION.format(start=start, count=count)}],
                     "answer": " ".join(str(start + i) for i in range(count)), "target_len": count})
    return rows


def target_response(answer: str) -> str:
    return "\n".join(answer.split())


def target_tokens(row: dict, tokenizer) -> int:
    """The target response's length in `tokenizer`'s tokens, plus one for EOS."""
    return len(tokenizer.encode(target_response(row["answer"]), add_special_tokens=False)) + 1


def score(response: str, answer: str) -> float:
    want = answer.split()
    got = [line.strip() for line in response.splitlines() if line.strip()]
    k = 0
    while k < min(len(want), len(got)) and got[k] == want[k]:
        k += 1
    return k / len(want)


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = extra_info.get("answer")
    if answer is None:
        raise KeyError("the long_tail env needs extra_info['answer'] (rows from make_prompts carry it)")
    reward = score(action, answer)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
