"""OpenReward tool-use episodes end to end on this machine: a real env server on 127.0.0.1 (the SDK's own
`Server`, in a thread), the real rollout worker, and the native engine running a tiny real model.

The model is a tiny random Llama taught, in a few seconds, to answer every prompt of these tests with one
tool call and every tool result with "42" (greedy decoding makes that exact). It speaks through a small
byte-level BPE tokenizer trained here on the tests' own text, with SmolLM2's chat template (which cannot render
tools, so the tool instructions go into the system message: the fallback path). The envs are the project's
`envs/tool_use.py` plus `FaultyCalc`, whose calculator raises or hangs on some tasks.
"""
from __future__ import annotations

import asyncio
import re
import time

import pytest
import torch

from sparserl.data.dataset import PromptRow
from sparserl.rollout.openreward.driver import ROW_KEY, OpenRewardEnvs
from sparserl.rollout.openreward.serve import ThreadServer, environment_classes
from sparserl.rollout.openreward.spec import EnvSpec
from sparserl.rollout.tool_chat import ToolChat, ToolResult
from sparserl.rollout.tool_parsers import get_parser
from sparserl.engines.types import Generation, SamplingParams
from sparserl.rollout.episode import EnvCalls, Sample, encode_text
from sparserl.rollout.worker import rollout

CalcArithmetic, GuessNumber = environment_classes("envs/tool_use.py")
_mod = __import__(CalcArithmetic.__module__, fromlist=["Expression"])
from openreward.environments import ToolOutput, tool  # noqa: E402

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
FINAL = "42"
UNKNOWN_CALC = "Error: unknown tool 'calc'; the tools are: guess"


class FaultyCalc(CalcArithmetic):
    """CalcArithmetic whose calculator raises on tasks 1, 5, ... and hangs on tasks 2, 6, ..."""

    @tool
    async def calc(self, params: _mod.Expression) -> ToolOutput:
        mode = self.task_spec["index"] % 4
        if mode == 1:
            raise RuntimeError("the calculator broke on purpose")
        if mode == 2:
            await asyncio.sleep(3600)
        return await CalcArithmetic.calc(self, params)

    calc.__doc__ = CalcArithmetic.calc.__doc__  # the same tool list, so the same prompt as CalcArithmetic


def _spec(name: str, **kw) -> EnvSpec:
    return EnvSpec(name, max_turns=3, **kw)


def _rows(items: list[tuple[str, int]]) -> list[PromptRow]:
    return [PromptRow(prompt=f"{env} train[{i}]", answer=None, extra={ROW_KEY: {"env": env, "split": "train", "index": i}},
                      index=k) for k, (env, i) in enumerate(items)]


@pytest.fixture(scope="module")
def server():
    srv = ThreadServer([CalcArithmetic, GuessNumber, FaultyCalc])
    yield srv
    srv.stop()


def _envs(url: str, specs: list[EnvSpec]) -> OpenRewardEnvs:
    return OpenRewardEnvs(specs, url, variants={s.name: s.name.split("/")[1].lower() for s in specs})


def _open_sessions(server) -> int:
    return len(server.env_server._active_envs)


def _prompt_texts(server, tokenizer, rows) -> list[str]:
    """The prompts the driver renders for `rows` (SmolLM2's template), as text."""
    envs = _envs(server.url, [_spec("local/CalcArithmetic"), _spec("local/GuessNumber")])

    async def go():
        driver = envs.driver(tokenizer, EnvCalls(60, None))
        try:
            return await driver.open(rows, [r.prompt for r in rows], 1)
        finally:
            await driver.close(None)

    openings = asyncio.run(go())
    assert all(o.status is None for o in openings), [o.error for o in openings]
    return [tokenizer.decode(o.prompt_ids) for o in openings]


def _bpe_tokenizer(corpus: list[str], chat_template: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture(scope="module")
def tool_model(server, tokenizer):
    """(tokenizer, model): greedy decoding answers these tests' prompts with CALL and any tool result with FINAL."""
    from transformers import LlamaConfig, LlamaForCausalLM

    rows = _rows([("local/CalcArithmetic", i) for i in range(4)] + [("local/GuessNumber", 0)])
    texts = _prompt_texts(server, tokenizer, rows)
    calc_obs = "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    fast = _bpe_tokenizer(texts + [CALL, FINAL, calc_obs, UNKNOWN_CALC] * 4, tokenizer.chat_template)
    chat = ToolChat(fast, get_parser("hermes"))
    call_ids, final_ids = fast.encode(CALL + "<|im_end|>"), fast.encode(FINAL + "<|im_end|>")
    examples = []
    for text in texts:
        prompt = encode_text(fast, text)
        result = UNKNOWN_CALC if "guess tool" in text else "42"
        obs = fast.encode(chat.observation([ToolResult("call_0", "calc", result)], call_ids))
        examples += [(prompt, call_ids), (prompt + call_ids + obs, final_ids)]
    assert fast.decode(examples[1][0]).endswith(CALL + "<|im_end|>" + calc_obs)  # what the worker will append

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=False,
                      eos_token_id=fast.eos_token_id, bos_token_id=fast.bos_token_id, pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(cfg)
    length = max(len(c) + len(r) for c, r in examples)
    ids = torch.full((len(examples), length), fast.pad_token_id)
    labels = torch.full((len(examples), length), -100)
    for i, (c, r) in enumerate(examples):
        ids[i, : len(c) + len(r)] = torch.tensor(c + r)
        labels[i, len(c) : len(c) + len(r)] = torch.tensor(r)
    target = labels[:, 1:] != -100  # right padding: causal attention never sees it
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(400):
            logits = model.lm_head(model.model(input_ids=ids).last_hidden_state[:, :-1][target])
            token_loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:][target], reduction="none")
            opt.zero_grad()
            token_loss.mean().backward()
            opt.step()
            if token_loss.max().item() < 0.05:  # every scripted token above p = 0.95: greedy follows the script
                break
    finally:
        torch.set_num_threads(threads)
    assert token_loss.max().item() < 0.05, f"the tiny model did not learn its script (worst token loss {token_loss.max().item():.3f})"
    return fast, model.eval()


def test_task_rows_from_a_server_of_several_envs(server):
    """Start-up: names resolve to the server's envs, the first `num_samples` tasks over the splits become rows."""
    import types

    from sparserl.rollout.openreward.tasks import env_sizes, resolve_envs, task_rows
    from sparserl.utils.errors import UserError

    cfg = types.SimpleNamespace(base_url=server.url, api_key_env="SPARSERL_TEST_NO_KEY", tool_parser="hermes", serve="",
                                envs={"local/GuessNumber": {"splits": ["test", "train"], "num_samples": 102},
                                      "local/CalcArithmetic": {"num_samples": 3, "weight": 2}})
    envs = resolve_envs(cfg)
    rows = task_rows(envs)
    assert envs.variants == {"local/GuessNumber": "guessnumber", "local/CalcArithmetic": "calcarithmetic"}
    assert env_sizes(envs, rows) == [102, 3] and [r.index for r in rows] == list(range(105))
    assert [r.prompt for r in rows[99:103]] == ["local/GuessNumber test[99]", "local/GuessNumber train[0]",
                                                "local/GuessNumber train[1]", "local/CalcArithmetic train[0]"]
    cfg.envs = {"local/Abacus": {}}
    with pytest.raises(UserError, match=r"local/Abacus: the server at .* serves calcarithmetic, guessnumber, faultycalc"):
        task_rows(resolve_envs(cfg))
    cfg.envs = {"local/GuessNumber": {"splits": ["valid"]}}
    with pytest.raises(UserError, match=r"'valid' is not a split of local/GuessNumber \(its splits: train, test, sft\)"):
        task_rows(resolve_envs(cfg))


def _gen(tokenizer, text: str, finish: str = "stop") -> Generation:
    ids = tokenizer.encode(text + ("<|im_end|>" if finish == "stop" else ""), add_special_tokens=False)
    return Generation(0, 0, [], ids, [-1.0] * len(ids), finish)


def test_driver_turns_against_a_served_env(server, tokenizer):
    """One session, turn by turn: malformed JSON, bad arguments, an unknown tool and a valid call in one turn
    become tool results in order; a plain message goes to the terminal tool and is scored by the task's
    verifier; the session is closed; a cut turn and the last turn end the episode as truncated."""
    envs = _envs(server.url, [_spec("local/CalcArithmetic")])
    rows = _rows([("local/CalcArithmetic", 0), ("local/CalcArithmetic", 1)])
    task = CalcArithmetic.list_tasks("train")[0]
    turn = ("Let me check.\n<tool_call>{\"name\": \"calc\", \"arguments\": {\"expression\": \"2 *\"}}</tool_call>\n"
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expr\": \"1\"}}</tool_call>\n"
            "<tool_call>{\"name\": \"abacus\", \"arguments\": {}}</tool_call>\n"
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expression\": \"6 * 7\"}</tool_call>\n"
            "<tool_call>{\"name\": \"calc\", \"arguments\": {\"expression\": \"6 * 7\"}}</tool_call>")

    async def go():
        driver = envs.driver(tokenizer, EnvCalls(30, None))
        openings = await driver.open(rows, [r.prompt for r in rows], 2)
        assert [o.status for o in openings] == [None] * 4 and _open_sessions(server) == 4
        assert "<tools>" in tokenizer.decode(openings[0].prompt_ids) and task["question"] in tokenizer.decode(openings[0].prompt_ids)
        s = Sample(group=0, prompt_ids=openings[0].prompt_ids)
        gen = _gen(tokenizer, turn)
        obs = await driver.step(0, s, gen, tokenizer.decode(gen.token_ids, skip_special_tokens=True), False)
        text = tokenizer.decode(obs)
        results = re.findall(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", text, re.DOTALL)
        assert text.startswith("\n<|im_start|>tool\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert len(results) == 5
        assert results[0].startswith("Error: ") and "syntax" in results[0]  # the calculator's own error: a normal result
        assert results[1].startswith("Error: Tool input validation error")  # ToolCallError(input_validation)
        assert results[2] == "Error: unknown tool 'abacus'; the tools are: calc"  # the terminal tool stays hidden
        assert results[3].startswith("Error: invalid JSON in tool call")
        assert results[4] == "42"
        assert s.tool_stats == {"calls": 3, "malformed": 1, "errors": 2, "failed": 0}
        assert s.reward == 0.0  # no rewarded step yet

        gen = _gen(tokenizer, f"The answer is <answer>{task['answer']}</answer>")
        assert await driver.step(0, s, gen, tokenizer.decode(gen.token_ids, skip_special_tokens=True), False) is None
        assert s.reward == s.score == 1.0 and s.status == "ok"
        await driver.close([0])
        assert _open_sessions(server) == 3

        cut = Sample(group=0, prompt_ids=[])  # cut by max_new_tokens: not run, truncated
        assert await driver.step(1, cut, _gen(tokenizer, CALL, "length"), CALL, False) is None
        assert cut.status == "truncated" and cut.tool_stats["calls"] == 0
        last = Sample(group=1, prompt_ids=[])  # the last turn: its calls run, then the episode ends unfinished
        assert await driver.step(2, last, _gen(tokenizer, CALL), CALL, True) is None
        assert last.status == "truncated" and last.tool_stats["calls"] == 1
        await driver.close(None)
        assert _open_sessions(server) == 0

    asyncio.run(go())


@pytest.mark.slow
def test_16_sessions_with_the_native_engine_mask_exactly_the_model_tokens(server, tool_model):
    """3 calculator tasks and 1 guessing game, 4 samples each: 16 sessions open at once. Every calculator
    trajectory calls `calc`, reads "42" and answers 42 (scored by the task's verifier); every game trajectory
    calls the unknown `calc`, reads the error and answers 42 (no terminal tool: reward 0). The token stream is
    the chat template's rendering of that conversation, and the loss mask is 1 on the model's own tokens only.
    The engine keeps each trajectory's KV between its turns (engine sessions)."""
    from sparserl.engines.native.engine import NativeEngine

    tok, model = tool_model
    envs = _envs(server.url, [_spec("local/CalcArithmetic"), _spec("local/GuessNumber")])
    rows = _rows([("local/CalcArithmetic", i) for i in range(3)] + [("local/GuessNumber", 0)])
    engine = NativeEngine(model, tok, num_slots=16384, seed=0)
    watched = _OpenSessionsPerTurn(engine, server)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, n=4, seed=0)
    samples, metrics = rollout(watched, tok, envs, rows, [r.prompt for r in rows], params, step_timeout_s=60, max_concurrency=64)
    tasks = CalcArithmetic.list_tasks("train")
    assert watched.open == [16, 16] and _open_sessions(server) == 0  # all 16 open through both turns, then closed
    assert len(samples) == 16
    for s in samples:
        calc = s.group < 3
        assert (s.status, s.num_turns) == ("ok", 2), (s.status, tok.decode(s.response_ids))
        assert s.reward == (float(tasks[s.group]["answer"] == FINAL) if calc else 0.0)
        assert s.tool_stats == {"calls": 1 if calc else 0, "malformed": 0, "errors": 0 if calc else 1, "failed": 0}
        first, obs, second = _mask_runs(s)
        assert tok.decode(first) == CALL + "<|im_end|>" and tok.decode(second) == FINAL + "<|im_end|>"
        result = "42" if calc else UNKNOWN_CALC
        assert tok.decode(obs) == f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
        assert all(lp == 0.0 for lp, m in zip(s.logp_sparse, s.loss_mask) if m == 0)
        assert all(lp <= 0.0 for lp, m in zip(s.logp_sparse, s.loss_mask) if m == 1)
        # The whole sequence is the template's rendering of the conversation, assistant turns as generated.
        messages = _chatml(tok.decode(s.prompt_ids)) + [{"role": "assistant", "content": CALL},
                                                        {"role": "tool", "content": result},
                                                        {"role": "assistant", "content": FINAL}]
        assert tok.decode(s.prompt_ids + s.response_ids) + "\n" == tok.apply_chat_template(messages, tokenize=False)
    # Turn 2 continued each trajectory's KV held by the engine (only the observation was prefilled); none is left held.
    assert engine.stats().sessions_continued == 16 and engine.end_sessions(None) == 0
    assert metrics["tool/calls_mean"] == pytest.approx(12 / 16) and metrics["tool/errors_mean"] == pytest.approx(4 / 16)
    assert metrics["openreward/local_GuessNumber/count"] == 4.0 and metrics["env/error_frac"] == 0.0
    # The sampler's log-probs of turn 2 were taken with the tool result in context, as a dense recompute sees it.
    s = samples[0]
    with torch.no_grad():
        logits = model(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, len(s.prompt_ids) - 1 : -1]
    dense = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    mask = torch.tensor(s.loss_mask, dtype=torch.bool)
    assert torch.allclose(dense[mask], torch.tensor(s.logp_sparse)[mask], atol=1e-4)


def _mask_runs(s: Sample) -> list[list[int]]:
    runs, cur, prev = [], [], None
    for t, m in zip(s.response_ids, s.loss_mask):
        if prev is not None and m != prev:
            runs.append(cur)
            cur = []
        cur.append(t)
        prev = m
    runs.append(cur)
    assert [s.loss_mask[0], len(runs)] == [1, 3], s.loss_mask
    return runs


def _chatml(text: str) -> list[dict]:
    """Messages back from a ChatML prompt (the generation prompt at its end dropped)."""
    found = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>\n", text, re.DOTALL)
    assert text.endswith("<|im_start|>assistant\n") and found
    return [{"role": r, "content": c} for r, c in found]


class _OpenSessionsPerTurn:
    """The native engine (sessions included), noting how many env sessions are open at each engine call."""

    def __init__(self, engine, server) -> None:
        self.engine, self.server, self.open = engine, server, []
        self.supports_sessions = engine.supports_sessions

    def generate(self, requests, progress=None):
        self.open.append(_open_sessions(self.server))
        return self.engine.generate(requests, progress)

    def end_sessions(self, keys=None):
        return self.engine.end_sessions(keys)


class _StopAfterFirstTurn:
    """The native engine (without its sessions: every turn re-prefills), and one env server that goes away right
    after the first turn was generated."""

    def __init__(self, engine, doomed: ThreadServer) -> None:
        self.engine, self.doomed, self.calls = engine, doomed, 0

    def generate(self, requests, progress=None):
        out = self.engine.generate(requests, progress)
        self.calls += 1
        if self.calls == 1:
            self.doomed.stop()
        return out


@pytest.mark.slow
def test_faults_end_only_their_samples(server, tool_model, caplog):
    """A tool that raises (ToolFailed: status error), a tool call that hangs past env.step_timeout_s (status
    timeout) and an env server that goes away mid-run (its samples: error or timeout) end only their own
    samples; the other calculator tasks finish both turns, every session on the live server is closed, and
    the rollout returns in bounded time with the counts in its metrics."""
    from sparserl.engines.native.engine import NativeEngine

    tok, model = tool_model
    doomed = ThreadServer([CalcArithmetic])
    specs = [_spec("local/FaultyCalc"), _spec("away/CalcArithmetic", base_url=doomed.url, variant="calcarithmetic")]
    envs = _envs(server.url, specs)
    rows = _rows([("local/FaultyCalc", i) for i in range(4)] + [("away/CalcArithmetic", 0)])
    engine = _StopAfterFirstTurn(NativeEngine(model, tok, num_slots=16384, seed=0), doomed)
    params = SamplingParams(temperature=0.0, max_new_tokens=48, n=2, seed=0)
    t0 = time.perf_counter()
    with caplog.at_level("WARNING"):
        samples, metrics = rollout(engine, tok, envs, rows, [r.prompt for r in rows], params, step_timeout_s=3.0)
    assert time.perf_counter() - t0 < 300  # the hung call sleeps an hour: only the timeout can end it
    by_group = {g: [(s.status, s.num_turns) for s in samples if s.group == g] for g in range(5)}
    assert by_group[0] == by_group[3] == [("ok", 2)] * 2
    assert by_group[1] == [("error", 1)] * 2 and all(s.tool_stats["failed"] == 1 for s in samples if s.group == 1)
    assert by_group[2] == [("timeout", 1)] * 2
    assert all(st in ("error", "timeout") and turns == 1 for st, turns in by_group[4])
    assert all(s.reward == 0.0 for s in samples if s.group in (1, 2, 4))
    assert metrics["env/timeout_frac"] >= 2 / 10 and metrics["env/error_frac"] >= 2 / 10
    assert metrics["env/timeout_frac"] + metrics["env/error_frac"] == pytest.approx(6 / 10)
    assert metrics["tool/failed_mean"] == pytest.approx(2 / 10)
    assert _open_sessions(server) == 0
    text = caplog.text
    assert "did not return within env.step_timeout_s=3" in text and "the calculator broke on purpose" in text


def test_two_servers_in_one_process_stream_in_their_own_loops(server, tokenizer):
    """Each `ThreadServer` runs its own event loop; the SSE "server is exiting" event must not be shared between them
    (the SDK's pinned sse-starlette keeps one process-wide event, bound to the first loop that waits on it, which made
    SSE requests of a second server fail, or not, depending on the machine's load). Waiting on it from two loops in
    turn is the deterministic form of that race; then sessions open and close on both."""
    from sse_starlette.sse import EventSourceResponse

    def wait_briefly() -> None:
        with pytest.raises(asyncio.TimeoutError):
            asyncio.run(asyncio.wait_for(EventSourceResponse._listen_for_exit_signal(), 0.05))

    wait_briefly()
    wait_briefly()  # a second loop: "bound to a different event loop" without the per-loop events
    for split in CalcArithmetic._list_splits_cached():  # the SDK's task cache warm: its lock cannot serve 2 loops cold
        asyncio.run(CalcArithmetic._list_tasks_cached(getattr(split, "name", split)))
    second = ThreadServer([CalcArithmetic])
    try:
        specs = [_spec("local/CalcArithmetic"), _spec("other/CalcArithmetic", base_url=second.url,
                                                     variant="calcarithmetic")]
        envs = _envs(server.url, specs)
        rows = _rows([("local/CalcArithmetic", 0), ("other/CalcArithmetic", 0)])

        async def go():
            driver = envs.driver(tokenizer, EnvCalls(30, None))
            openings = await driver.open(rows, [r.prompt for r in rows], 2)
            assert [o.status for o in openings] == [None] * 4
            assert _open_sessions(server) == 2 and _open_sessions(second) == 2
            await driver.close(None)
            assert _open_sessions(server) == _open_sessions(second) == 0

        asyncio.run(go())
    finally:
        second.stop()
