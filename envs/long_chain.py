"""Long-chain env: follow a chain of word links stated in the prompt, one numbered line per link.

A prompt is one user message that lists NUM_LINKS links "a -> b" in a random order; together they form one
chain through NUM_LINKS + 1 distinct words, each word used once:

    Each line below links a word to the next word. Together the lines form one chain.
    cup -> owl
    fox -> cup
    ... (30 lines)
    Start at fox and follow all 30 links. Write one line per link, numbered, in the form: 1. word -> next word

and the target response (`make_sft_examples`) walks the chain from the start:

    1. fox -> cup
    2. cup -> owl
    ...
    30. ink -> bee

Why this task: every line needs a different fact of the prompt, and the order in which the facts are needed
(the chain) is unrelated to the order in which they are stated, so the whole prompt stays needed until the
last line. With NUM_LINKS = 30 the response is ~200 tokens (6-7 per line: number, dot, word, arrow, word,
newline) and carries 30 tokens that can only be read from the prompt: the word after each arrow. A
compressed KV cache that has evicted the link a line needs makes that line wrong, and every later line
continues from the wrong word, so a small per-token mismatch compounds over the rest of the response, as
in long reasoning. Each step is an induction-style copy ("x ->" is followed by the word the prompt puts
after "x ->"), which a 135M model learns from a short supervised warm-start.

Reward: the fraction of the chain followed correctly before the first mistake. Non-empty response lines
are parsed as "[N.] a -> b" (the number is optional and not checked); the reward is k / NUM_LINKS for the
largest k such that the first k lines are exactly the first k links of the chain, in order. Hence 1.0 for
the whole chain, partial credit that grows with every correct step (NUM_LINKS + 1 levels, so a GRPO group
has different rewards long before any sample is perfect), and nothing for steps after a mistake: those
would follow another chain than the one asked for. A line that does not parse is a mistake. Lines after
the last link are ignored (the response length is reported separately; `max_new_tokens` bounds it).

Sizes (SmolLM2-135M-Instruct tokenizer and its default system prompt): 30 links give 199-token prompts
and a 201-token target response plus EOS. Every word of WORDS is one token both at the start of a line and
after a space, so every link has the same shape (4 tokens per prompt line).

Measured with the native engine (fp32, temperature 1, 240 new tokens, 16 prompts, one sample each): the plain
model scores 0.00 (it does not write links); after a 4-step warm-start (`sparserl.trainer.sft`, batch 8, lr
1e-4) 0.39 dense, with 2 of 16 whole chains, and 0.19 under R-KV with budget 192, divide_length 32 and
compress_prompt off (the cache held at the 199-entry prompt size plus at most 32, 51% of the sequence kept).

Left out on purpose: distractor links outside the chain (every fact is needed, which is the point), cycles
(a word seen before would let a line copy from the response instead of the prompt), and checking the line
numbers (they are format, not information).
"""
from __future__ import annotations

import random

from sparserl.rewards.links import extract_answer, score  # noqa: F401  (the env's extract_answer)

max_turns = 1
NUM_LINKS = 30

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
INTRO = "Each line below links a word to the next word. Together the lines form one chain."
LINK = "{a} -> {b}"
QUESTION = ("Start at {start} and follow all {n} links. Write one line per link, numbered, "
            "in the form: 1. word -> next word")
STEP = "{i}. {a} -> {b}"


def _episode(rng: random.Random, num_links: int) -> tuple[str, list[str]]:
    """(user message, the chain: num_links + 1 words from the start) of one random episode."""
    if not 1 <= num_links < len(WORDS):
        raise ValueError(f"num_links={num_links} must be in 1..{len(WORDS) - 1}")
    chain = rng.sample(WORDS, num_links + 1)
    links = [LINK.format(a=a, b=b) for a, b in zip(chain, chain[1:])]
    rng.shuffle(links)
    text = "\n".join([INTRO, *links, QUESTION.format(start=chain[0], n=num_links)])
    return text, chain


def target_response(chain: list[str]) -> str:
    return "\n".join(STEP.format(i=i + 1, a=a, b=b) for i, (a, b) in enumerate(zip(chain, chain[1:])))


def make_prompts(num: int, seed: int, num_links: int = NUM_LINKS) -> list[dict]:
    """`num` rows like a data file's: {"prompt": [user message], "answer": "fox cup owl ..."} (the chain's
    words in order, the answer `score` checks against); same seed, same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        text, chain = _episode(rng, num_links)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": " ".join(chain)})
    return rows


def make_sft_examples(num: int, seed: int, num_links: int = NUM_LINKS) -> list[dict]:
    """`num` supervised examples {"prompt", "response": the walked chain, "answer"}, from a stream of their own,
    so they never repeat the episodes `make_prompts` gives for the same seed."""
    rng = random.Random(f"long-chain-sft-{seed}")
    rows = []
    for _ in range(num):
        text, chain = _episode(rng, num_links)
        rows.append({"prompt": [{"role": "user", "content": text}], "response": target_response(chain),
                     "answer": " ".join(chain)})
    return rows


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = extra_info.get("answer")
    if answer is None:
        raise KeyError("the long_chain env needs extra_info['answer'] (rows from make_prompts carry it)")
    reward = score(action, answer)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
