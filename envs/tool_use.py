"""Two OpenReward environments for tool-use training, served locally (`env.openreward.serve=envs/tool_use.py`).

- `CalcArithmetic`: arithmetic questions from reasoning-gym (`basic_arithmetic` and `chain_sum`, small
  numbers, seeded per split), a `calc` tool that evaluates an arithmetic expression, and a terminal `submit`:
  the model's final plain message is the answer, scored by the task's own reasoning-gym verifier (1 for the
  exact number). The number read from the message is the content of `<answer>...</answer>` if present,
  else its last number.
- `GuessNumber`: a hidden integer in [1, 20]; the `guess` tool answers "higher", "lower" or "correct". A
  wrong guess earns -0.1 (the per-step penalty), the right one 1.0 and ends the game; after 6 wrong guesses
  the game ends. No terminal tool: a plain message just ends the episode. With `reward_reduction: sum` an
  episode earns 1 - 0.1 x (wrong guesses).

Train split: 1000 tasks per env (calc: 500 per family), test split: 100, sft split: 1000 for warm-start
demonstrations (`scripts/make_tool_sft.py`; three different seeds). Tasks are plain JSON, regenerated
identically on every start. `calc_demonstration(question)` is the expression a correct episode sends to `calc`.

Left out on purpose: harder reasoning-gym families (a 135M model earns nothing there) and any tool with side
effects outside the session.
"""
from __future__ import annotations

import ast
import operator
import random
import re

from pydantic import BaseModel

from openreward.environments import Environment, TextBlock, ToolOutput, terminal, tool

SPLITS = {"train": (1000, 0), "test": (100, 1), "sft": (1000, 2)}  # tasks, seed
CALC_FAMILIES = {
    "basic_arithmetic": dict(min_terms=2, max_terms=3, min_digits=1, max_digits=2, allow_parentheses=False,
                             operators=("+", "-", "*")),
    "chain_sum": dict(min_terms=2, max_terms=4, min_digits=1, max_digits=2),
}
GUESS_LOW, GUESS_HIGH, MAX_WRONG, WRONG_PENALTY = 1, 20, 6, -0.1


# ---------------------------------------------------------------- a calculator without eval()

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculate(expression: str) -> str:
    """`expression` evaluated, or an error message (never raises)."""
    text = expression.strip().rstrip("=").replace("×", "*").replace("÷", "/")
    if len(text) > 200:
        return "Error: expression too long"
    try:
        value = _eval(ast.parse(text, mode="eval"))
    except ZeroDivisionError:
        return "Error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"Error: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_number(message: str) -> str | None:
    tagged = re.findall(r"<answer>(.*?)</answer>", message, re.DOTALL)
    text = tagged[-1] if tagged else message
    found = _NUMBER.findall(text.replace(",", ""))
    if not found:
        return None
    value = float(found[-1])
    return str(int(value)) if value.is_integer() else found[-1]


_QUESTION = re.compile(r"^(?:Calculate (?P<a>.+?)\.|.*?: (?P<b>.+?) =)$", re.DOTALL)


def calc_demonstration(question: str) -> str:
    """The expression in a CalcArithmetic question ("Calculate 4 - 1." / "...problem: 4 - 1 =") -> "4 - 1"."""
    m = _QUESTION.match(question.strip())
    if m is None:
        raise ValueError(f"not a CalcArithmetic question: {question!r}")
    return m.group("a") or m.group("b")


# ---------------------------------------------------------------- the environments

class Expression(BaseModel):
    expression: str


class Answer(BaseModel):
    answer: str


class Guess(BaseModel):
    number: int


_DATASETS: dict[tuple[str, str], object] = {}


def _dataset(family: str, split: str):
    key = (family, split)
    if key not in _DATASETS:
        import reasoning_gym

        size, seed = SPLITS[split]
        _DATASETS[key] = reasoning_gym.create_dataset(family, size=size // len(CALC_FAMILIES), seed=seed,
                                                      **CALC_FAMILIES[family])
    return _DATASETS[key]


class CalcArithmetic(Environment):
    """Arithmetic with a calculator tool; the final plain message is the answer."""

    @classmethod
    def list_splits(cls):
        return list(SPLITS)

    @classmethod
    def list_tasks(cls, split: str):
        tasks = []
        for family in CALC_FAMILIES:
            for i, entry in enumerate(_dataset(family, split)):
                tasks.append({"family": family, "split": split, "index": i, "question": entry["question"],
                              "answer": str(entry["answer"])})
        return tasks

    def get_prompt(self):
        return [TextBlock(text=f"{self.task_spec['question']}\nUse the calc tool to compute it, then reply with only "
                               "the final number.")]

    @tool
    async def calc(self, params: Expression) -> ToolOutput:
        """Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses) and return its value."""
        return ToolOutput(blocks=[TextBlock(text=calculate(params.expression))])

    @terminal
    @tool
    async def submit(self, params: Answer) -> ToolOutput:
        """The final answer: a number."""
        spec = self.task_spec
        entry = _dataset(spec["family"], spec["split"])[spec["index"]]
        score = float(_dataset(spec["family"], spec["split"]).score_answer(extract_number(params.answer), entry))
        return ToolOutput(blocks=[TextBlock(text=f"score {score:g}")], reward=score, finished=True,
                          metadata={"expected": spec["answer"]})


class GuessNumber(Environment):
    """Guess the hidden number; each wrong guess costs a little."""

    def __init__(self, task_spec={}, secrets={}) -> None:  # noqa: B006 - the SDK's signature
        super().__init__(task_spec, secrets)
        self.wrong = 0

    @classmethod
    def list_splits(cls):
        return list(SPLITS)

    @classmethod
    def list_tasks(cls, split: str):
        size, seed = SPLITS[split]
        rng = random.Random(seed)
        return [{"secret": rng.randint(GUESS_LOW, GUESS_HIGH)} for _ in range(size)]

    def get_prompt(self):
        return [TextBlock(text=f"I am thinking of an integer from {GUESS_LOW} to {GUESS_HIGH}. Find it with the guess tool: "
                               f"after each guess I say higher or lower. Each wrong guess costs {-WRONG_PENALTY:g} points, "
                               f"finding it earns 1, and after {MAX_WRONG} wrong guesses the game is over.")]

    @tool
    async def guess(self, params: Guess) -> ToolOutput:
        """Guess the number; the answer is higher, lower or correct."""
        secret = self.task_spec["secret"]
        if params.number == secret:
            return ToolOutput(blocks=[TextBlock(text="correct")], reward=1.0, finished=True)
        self.wrong += 1
        hint = "higher" if params.number < secret else "lower"
        over = self.wrong >= MAX_WRONG
        text = f"{hint}; out of guesses, the number was {secret}" if over else hint
        return ToolOutput(blocks=[TextBlock(text=text)], reward=WRONG_PENALTY, finished=over)


ENVIRONMENTS = [CalcArithmetic, GuessNumber]
