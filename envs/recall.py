"""Recall env: facts stated early, filler after them, a question at the end whose answer is one of the facts.

A prompt is one user message:

    Remember these codes.
    The code for blue is 41. The code for red is 17. The code for gold is 63. The code for pink is 28.
    <FILLER_SENTENCES neutral sentences, drawn at random, no numbers and no colour words>
    What is the code for red? Answer in the form: The code for red is N.

and the target response (`make_sft_examples`) restates the question and gives the number:
"The code for red is 17." The reward is 1 when the first integer of the response is the asked code, else 0:
the first, because only the restatement comes before it, and a response that lists every code it remembers
must not be paid for the lucky last one.

Why this task: with `rollout.kv.compress_prompt=true`, a KV budget well under the prompt length and a short
`divide_length` (prompt + 1 >= budget + divide_length), the first decode step compresses the cache below the
prompt, so the facts can be evicted before the answer is
written; R-KV scores entries mostly by non-redundancy (lambda 0.1) and the fact sentences look alike, so
they are at risk. Dense attention still sees every fact. Random guessing among the facts earns
1 / NUM_FACTS.

Sizes (SmolLM2-135M-Instruct tokenizer, the default system prompt of its chat template): with NUM_FACTS = 4
and FILLER_SENTENCES = 6 a prompt is 154-163 tokens (12 sentences: 220-231), the target response 10 tokens
plus EOS. Both are module constants and keyword arguments of `make_prompts` / `make_sft_examples` (the
trainer calls them with defaults; a script that wants other sizes writes the rows to a JSONL file and passes
data.train_path, as benchmarks/replicate_sparse_rl.py does).

Measured with the native engine (bf16, temperature 1, 24 new tokens, 32 prompts x 2-4 samples): the plain
model earns 0.05 dense (it rarely answers in the asked form) and 0.00 under R-KV budget 48; after a
12-step warm-start (`sparserl.trainer.sft`, batch 8, lr 1e-4) it earns 0.95 dense, and with
compress_prompt, divide_length 16 and an R-KV budget of 48 / 64 / 96 entries 0.18 / 0.21 / 0.36 (SnapKV,
which scores by the question's attention, 0.59 / 0.61 / 0.72; StreamingLLM, which keeps only sinks and
recent tokens, 0.00).

Left out on purpose: distractor numbers in the filler (they would test reading, not memory) and multi-hop
questions; both are one keyword away if a harder variant is wanted.
"""
from __future__ import annotations

import random
import re

max_turns = 1
NUM_FACTS = 4
FILLER_SENTENCES = 6
CODE_LOW, CODE_HIGH = 10, 99

# One token each (with a leading space) in the SmolLM2 tokenizer, so every fact has the same shape.
KEYS = ("blue", "red", "green", "pink", "gold", "gray", "brown", "black", "white", "orange", "purple", "silver")
INTRO = "Remember these codes."
FACT = "The code for {key} is {code}."
QUESTION = "What is the code for {key}? Answer in the form: The code for {key} is N."
RESPONSE = "The code for {key} is {code}."
FILLER = (
    "The river bends twice before it reaches the old mill.",
    "A quiet wind moved through the tall grass all afternoon.",
    "Someone left a stack of letters on the kitchen table.",
    "The library closes early on the last day of every month.",
    "Bread rises faster when the room is warm and still.",
    "The train stopped at a small station near the hills.",
    "Most of the visitors arrived after the rain had cleared.",
    "The garden path was lined with smooth flat stones.",
    "A cat slept on the windowsill while the kettle boiled.",
    "The market sells fresh fish only in the early morning.",
    "Clouds gathered over the harbor and the boats came in.",
    "The teacher wrote a long sentence on the board.",
    "An old clock in the hallway ticks a little too loudly.",
    "The bridge was painted again after the long winter.",
    "Children played a game of tag in the village square.",
    "The baker keeps the recipe in a locked wooden box.",
    "Snow covered the road, so the bus took another route.",
    "The museum added a new room for maps and globes.",
    "A farmer counted the sheep before closing the gate.",
    "The lighthouse keeper climbs the stairs every evening.",
    "Fresh paint dries slowly when the air is damp.",
    "The choir practiced the same song until it was perfect.",
    "A small boat drifted along the edge of the lake.",
    "The hotel lobby smelled of coffee and polished wood.",
    "Nobody remembered who planted the apple tree by the fence.",
    "The mail carrier whistles the same tune on every street.",
    "A strong lamp hung above the workbench in the shed.",
    "The festival ended with music and a long parade.",
    "Thin ice formed on the pond during the cold night.",
    "The students carried their books across the courtyard.",
    "A pair of swans nested near the reeds by the shore.",
    "The shop on the corner repairs shoes and umbrellas.",
)
_INT = re.compile(r"-?\d+")


def _episode(rng: random.Random, num_facts: int, filler_sentences: int) -> tuple[str, str, str, list[int], list[str]]:
    """(user message, asked key, its code, every code, every key) of one random episode."""
    if not 1 <= num_facts <= len(KEYS):
        raise ValueError(f"num_facts={num_facts} must be in 1..{len(KEYS)}")
    if not 0 <= filler_sentences <= len(FILLER):
        raise ValueError(f"filler_sentences={filler_sentences} must be in 0..{len(FILLER)}")
    keys = rng.sample(KEYS, num_facts)
    codes = rng.sample(range(CODE_LOW, CODE_HIGH + 1), num_facts)
    asked = rng.randrange(num_facts)
    facts = " ".join(FACT.format(key=k, code=c) for k, c in zip(keys, codes))
    filler = " ".join(rng.sample(FILLER, filler_sentences))
    parts = [INTRO, facts, filler, QUESTION.format(key=keys[asked])]
    text = "\n".join(p for p in parts if p)
    return text, keys[asked], str(codes[asked]), codes, keys


def make_prompts(num: int, seed: int, num_facts: int = NUM_FACTS, filler_sentences: int = FILLER_SENTENCES) -> list[dict]:
    """`num` rows like a data file's: {"prompt": [user message], "answer": "17", "key": "red"}; same seed, same rows."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num):
        text, key, answer, _, _ = _episode(rng, num_facts, filler_sentences)
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": answer, "key": key})
    return rows


def make_sft_examples(num: int, seed: int, num_facts: int = NUM_FACTS, filler_sentences: int = FILLER_SENTENCES) -> list[dict]:
    """`num` supervised examples {"prompt": [user message], "response": "The code for red is 17.", "answer": "17"}.

    Drawn from a stream of their own, so they never repeat the episodes `make_prompts` gives for the same seed.
    """
    rng = random.Random(f"recall-sft-{seed}")
    rows = []
    for _ in range(num):
        text, key, answer, _, _ = _episode(rng, num_facts, filler_sentences)
        rows.append({"prompt": [{"role": "user", "content": text}], "response": RESPONSE.format(key=key, code=answer),
                     "answer": answer})
    return rows


def extract_answer(response: str) -> str | None:
    """The code the response gives: its first integer (what `score` checks)."""
    first = _INT.search(response)
    return None if first is None else str(int(first.group(0)))


def score(response: str, answer: str) -> float:
    given = extract_answer(response)
    return 1.0 if given is not None and int(given) == int(answer) else 0.0


async def step(state: str, action: str, extra_info: dict) -> dict:
    answer = extra_info.get("answer")
    if answer is None:
        raise KeyError("the recall env needs extra_info['answer'] (rows from make_prompts carry it)")
    reward = score(action, answer)
    return {"next_state": None, "reward": reward, "score": reward, "done": True, "extra_info": extra_info}
