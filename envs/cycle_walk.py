"""Cycle-walk env: a short prompt states a loop of word links; the response walks it for many steps, one numbered
line per step. The response, not the prompt, is most of the KV cache.

A prompt is one user message that lists NUM_LINKS links "a -> b" in a random order; together they form one
cycle through NUM_LINKS distinct words:

    These links form a loop:
    owl -> fox
    cup -> owl
    fox -> cup
    ... (6 lines)
    Walk the loop from fox for 48 steps, one numbered line per step.

and the target response (`make_sft_examples`) walks the loop from the start, going round it again and again:

    1. fox -> cup
    2. cup -> owl
    ...
    48. ink -> fox

Why this task: it is the regime that KV compression of rollouts is built for (and that envs/long_chain.py is not,
since its prompt grows with its response): a short prompt, kept whole in count (`rollout.kv.compress_prompt=false`),
and a response several times the KV budget. Each line needs the previous line's last word, which is recent and in
the window, and one fact of the prompt (the word that follows it). After the first lap the response also holds
every fact, as earlier lines: copies of one another and of the prompt, the redundancy that R-KV's scoring evicts,
and that a model may read by induction as well as the prompt. So compression should cost little, but not nothing:
a line whose fact was evicted from every place it was stated goes wrong, and the rest of the walk with it. That
small, compounding mismatch over a long response is what a sparse-rollout correction has to handle.

Reward: the fraction of the walk followed correctly before the first mistake. Non-empty response lines are parsed
as "[N.] a -> b" (the number is optional and not checked); the reward is k / NUM_STEPS for the largest k such that
the first k lines are exactly the first k steps of the walk. Hence 1.0 for the whole walk, partial credit that
grows with every correct step (NUM_STEPS + 1 levels, so a GRPO group has different rewards long before any sample
is perfect), and nothing after a mistake. A line that does not parse is a mistake. Lines after the last step are
ignored (`max_new_tokens` bounds the response). The row's "answer" is the walk itself, NUM_STEPS + 1 words.

Sizes (SmolLM2-135M-Instruct tokenizer and its default system prompt): 6 links and 48 steps give 78-token prompts
and a 326-token target response plus EOS (6 tokens per line up to step 9, 7 after: each digit of a line number is
a token of its own). That is 5 times a budget of 64, with the prompt 19% of the dense cache. Every word of WORDS
is one token both at the start of a line and after a space, so every link has the same shape (4 tokens per
prompt line). With `compress_prompt=false` a compression keeps at least the prompt's length (78 entries), so
budgets below that act as 78.

Measured with the native engine (fp32, temperature 1, 340 new tokens, one sample per prompt): a 6-step warm-start
(`sparserl.trainer.sft`, batch 8, lr 1e-4) scores 0.499 dense on 128 held-out prompts (53 whole walks); under
R-KV with compress_prompt off it scores 0.258 at budget 64 (which acts as 78), 0.270 at budget 80 (20% of the dense
KV kept) and 0.494 at budget 128 (34%). The mistakes come mostly in the first lap, while the next word can only be
read from the prompt. (docs/replications.md, "Sparse-RL in its own regime".)

Left out on purpose: distractor links (every fact is needed), links stated in walking order, even rotated (the
prompt would then be a copy of one lap), and checking the line numbers (they are format, not information; the
model still has to count them to stop).
"""
from __future__ import annotations

import random

from sparserl.rewards.links import extract_answer, score  # noqa: F401  (the env's extract_answer)

max_turns = 1
NUM_LINKS = 6
NUM_STEPS = 48

# One token each, both at the start of a line and after a space, in the SmolLM2 tokenizer (tested); none of
# them appears in the instruction text.
WORDS = (
    "fox", "cup", "owl", "bee", "ant", "cat", "dog", "hat", "pen", "box", "sun", "car", "bus", "egg", "ink", "jar",
    "kit", "log", "net", "pig", "rug", "van", "web", "zip", "bag", "bed", "bell", "boat", "book", "coin", "door",
    "fish", "flag", "gate", "hill", "horn", "leaf", "lion", "milk", "moon", "nest", "pipe", "ring", "rock",
    "rose", "salt", "ship", "sock", "star", "tree", "wolf", "wall", "wind", "bat", "fig", "nut", "bow", "cap",
    "fan", "hen", "ice", "jam", "pot", "tub", "coat", "corn", "dust", "iron", "lake", "mask", "nail", "park",
    "seed", "tank", "wave", "wing", "wood",
)
INTRO = "These links form a loop:"
LINK = "{a} -> {b}"
QUESTION = "Walk the loop from {start} for {n} steps, one numbered line per step."
STEP = "{i}. {a} -> {b}"


def _check_sizes(num_links: int, num_steps: int) -> None:
    if not 3 <= num_links <= len(WORDS):
        raise ValueError(f"num_links={num_links} must be in 3..{len(WORDS)} (a loop of 2 has one order only)")
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")


def _episode(rng: random.Random, num_links: int, num_steps: int) -> tuple[str, list[str]]:
    """(user message, the walk: num_steps + 1 words from the start) of one random episode."""
    _check_sizes(num_links, num_steps)
    loop = rng.sample(WORDS, num_links)  # the walk's order; it starts at loop[0]
    pairs = list(zip(loop, loop[1:] + loop[:1]))
    order = pairs[:]
    while _is_rotation(order, pairs):  # never the walking order, from any start
        rng.shuffle(order)
    links = [LINK.format(a=a, b=b) for a, b in order]
    walk = [loop[i % num_links] for i in range(num_steps + 1)]
    text = "\n".join([INTRO, *links, QUESTION.format(start=loop[0], n=num_steps)])
    return text, walk


def _is_rotation(order: list, pairs: list) -> bool:
    return any(order == pairs[i:] + pairs[:i] for i in range(len(pairs)))


def target_response(walk: list[str]) -> str:
    return "\n".join(STEP.format(i=i + 1, a=a, b=b) for i, (a, b) in enumerate(zip(walk, walk[1:])))


def make_prompts(num: int, seed: int, num_links: int = NUM_LINKS, num_steps: int = NUM_STEPS) -> list[dict]:
    """`num` rows like a data file's: {"prompt": [user message], "answer": "fox cup owl ..."} (the walk's
    num_steps + 1 words in order, the answer `score` checks against); same seed, same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        text, walk = _episode(rng, num_links, num_steps)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": " ".join(walk)})
    return rows


def make_sft_examples(num: int, seed: int, num_links: int = NUM_LINKS, num_steps: int = NUM_STEPS) -> list[dict]:
    """`num` supervised examples {"prompt", "response": the walk, "answer"}, from a stream of their own, so they
    never repeat the episodes `make_prompts` gives for the same seed."""
    rng = random.Random(f"cycle-walk-sft-{seed}")
    rows = []
    for _ in range(num):
        text, walk = _episode(rng, num_links, num_steps)
        rows.append({"prompt": [{"role": "user", "content": text}], "response": target_response(walk),
                     "answer": " ".join(walk)})
    return rows


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = extra_info.get("answer")
    if answer is None:
        raise KeyError("the cycle_walk env needs extra_info['answer'] (rows from make_prompts carry it)")
    reward = score(action, answer)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
