"""Math env: reward 1 when the response's last `\\boxed{}` answer equals `extra_info["answer"]`, else 0.

Single turn. The check runs with math-verify in a worker process under a time limit
(`sparserl.rewards.math`); a check that times out or crashes scores 0 and is flagged in `extra_info`.
Use it with the MATH-style data files (`data.answer_key` = `label` for the training sets, `answer` for
MATH-500). Left out on purpose: format rewards and length penalties.
"""
from __future__ import annotations

from sparserl.rewards.math import averify_answer, extract_boxed

max_turns = 1
TIMEOUT_S = 5.0


def extract_answer(response: str) -> str | None:
    """The answer the response gives: its last `\\boxed{}` (what `step` checks)."""
    return extract_boxed(response)


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = extra_info.get("answer")
    if answer is None:
        raise KeyError("the math env needs a reference answer: set data.answer_key to the answer column")
    verdict = await averify_answer(action, str(answer), timeout_s=TIMEOUT_S)
    reward = 1.0 if verdict else 0.0
    return {
        "next_state": None,
        "reward": reward,
        "score": reward,
        "done": True,
        "extra_info": {**extra_info, "verify_timed_out": verdict is None},
    }
