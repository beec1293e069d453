"""Warm-start examples for tool use: correct calculator episodes, rendered exactly as GRPO rollouts see them.

    python scripts/make_tool_sft.py --out outputs/tool_sft.jsonl --num 300
    python -m sparserl.trainer.sft data.train_path=outputs/tool_sft.jsonl trainer.output_dir=outputs/tool_sft ...

Serves `envs/tool_use.py` on 127.0.0.1 (in this process), opens one OpenReward session per task of
`local/CalcArithmetic`'s `--split` (the `sft` split: its own seed, not the train or test tasks) through the
trainer's own session driver, and plays the episode a correct agent plays: turn 1 calls `calc` with the
question's expression (`calc_demonstration`), the real tool answers, turn 2 replies with the tool's result as
a plain message, which the real terminal tool scores. Only episodes scored 1 are kept (reasoning-gym scores
some `basic_arithmetic` tasks left to right, where the calculator's precedence gives another number).

Each kept episode gives two JSONL rows `{"prompt": <text with chat markers>, "response": <turn>}` for
`sparserl.trainer.sft` (which appends the EOS and uses a prompt with chat markers as it is): the prompt the
driver renders (tool instructions in the system message) -> the call; and that prompt, the call, its end of
turn and the tool-result observation the driver appends token by token -> the final number.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sparserl.actor.hf import load_tokenizer  # noqa: E402
from sparserl.data.dataset import PromptRow  # noqa: E402
from sparserl.rollout.episode import EnvCalls, Sample, encode_text  # noqa: E402
from sparserl.rollout.openreward.driver import ROW_KEY, OpenRewardEnvs  # noqa: E402
from sparserl.rollout.openreward.serve import ThreadServer, environment_classes  # noqa: E402
from sparserl.rollout.openreward.spec import EnvSpec  # noqa: E402
from sparserl.engines.types import Generation  # noqa: E402

ENV_FILE = "envs/tool_use.py"
ENV_NAME = "local/CalcArithmetic"


def call_text(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "\n</tool_call>"


async def episodes(url: str, tokenizer, split: str, start: int, num: int, questions: list[str], demo) -> tuple[list[dict], int]:
    spec = EnvSpec(ENV_NAME, max_turns=3, reward_reduction="sum", min_reward=0, max_reward=1)
    envs = OpenRewardEnvs([spec], url, variants={ENV_NAME: "calcarithmetic"})
    rows = [PromptRow(prompt="", answer=None, index=i, extra={ROW_KEY: {"env": ENV_NAME, "split": split, "index": i}})
            for i in range(start, start + num)]
    driver = envs.driver(tokenizer, EnvCalls(60, 16))
    eos = tokenizer.eos_token_id
    records, dropped = [], 0
    try:
        openings = await driver.open(rows, [""] * num, 1)
        for k, opening in enumerate(openings):
            if opening.status is not None:
                raise RuntimeError(f"task {start + k}: {opening.error}")
            sample = Sample(group=k, prompt_ids=opening.prompt_ids)
            call = call_text(demo(questions[start + k]))
            call_ids = encode_text(tokenizer, call) + [eos]
            gen = Generation(k, 0, opening.prompt_ids, call_ids, [0.0] * len(call_ids), "stop")
            obs_ids = await driver.step(k, sample, gen, call, last_turn=False)
            observation = tokenizer.decode(obs_ids)
            result = observation.split("<|im_start|>tool\n", 1)[-1].split("<|im_end|>", 1)[0].strip()
            answer_ids = encode_text(tokenizer, result) + [eos]
            gen2 = Generation(k, 0, opening.prompt_ids + call_ids + obs_ids, answer_ids, [0.0] * len(answer_ids), "stop")
            assert await driver.step(k, sample, gen2, result, last_turn=False) is None
            if sample.reward != 1.0:
                dropped += 1
                continue
            prompt = tokenizer.decode(opening.prompt_ids)
            records.append({"prompt": prompt, "response": call})
            records.append({"prompt": tokenizer.decode(opening.prompt_ids + call_ids + obs_ids), "response": result})
    finally:
        await driver.close(None)
    return records, dropped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSONL file to write")
    ap.add_argument("--num", type=int, default=300, help="episodes to play (each kept one gives 2 rows)")
    ap.add_argument("--start", type=int, default=0, help="first task index of the split")
    ap.add_argument("--split", default="sft")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="whose tokenizer and chat template render the text")
    args = ap.parse_args()
    classes = environment_classes(ENV_FILE)
    demo = sys.modules[classes[0].__module__].calc_demonstration
    questions = [t["question"] for t in classes[0].list_tasks(args.split)]
    if not 0 <= args.start < args.start + args.num <= len(questions):
        ap.error(f"--start {args.start} --num {args.num}: the {args.split} split has {len(questions)} tasks")
    tokenizer = load_tokenizer(args.model)
    server = ThreadServer(classes)
    try:
        records, dropped = asyncio.run(episodes(server.url, tokenizer, args.split, args.start, args.num, questions, demo))
    finally:
        server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"{len(records) // 2} episodes scored 1 ({dropped} of {args.num} dropped: the verifier disagrees with the "
          f"calculator) -> {len(records)} rows in {out}")


if __name__ == "__main__":
    main()
