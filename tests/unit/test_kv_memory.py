"""`rollout.kv_memory`: its syntax, bytes per entry against the engine's own pool, the pool it sizes for both engines,
the start-up line, and a memory that holds no sequence as one `error:` line."""
import pytest
import torch

from sparserl.config.fields import ConfigError
from sparserl.config.load import load_config
from sparserl.engine_options.build import pool_slots, sglang_options
from sparserl.engine_options.sizing import SequenceSize, memory_slots, pool_line, pool_is_sized
from sparserl.utils.kv_memory import KVMemory, entry_bytes, parse_kv_memory
from sparserl.engines.native.engine import NativeEngine
from sparserl.utils.errors import run_main
from tests.conftest import tiny_config, tiny_model

MB = 2**20


@pytest.mark.parametrize("text, want", [
    ("64MB", KVMemory(nbytes=64 * MB)), ("1.5GB", KVMemory(nbytes=3 * 2**29)), ("512kib", KVMemory(nbytes=2**19)),
    ("2GiB", KVMemory(nbytes=2**31)), ("64", KVMemory(nbytes=64 * MB)), ("1", KVMemory(nbytes=MB)),
    ("0.5MB", KVMemory(nbytes=MB // 2)), ("0.3", KVMemory(fraction=0.3)), ("0", KVMemory()), (64, KVMemory(nbytes=64 * MB)),
])
def test_the_forms_of_kv_memory(text, want):
    assert parse_kv_memory(text) == want
    assert parse_kv_memory(text).is_set == (text not in ("0",))


@pytest.mark.parametrize("text", ["", "abc", "-1", "3TB", "64 M B", "nan"])
def test_bad_kv_memory_is_one_config_error_naming_the_key(text):
    with pytest.raises(ConfigError, match=rf"rollout.kv_memory={text or ''}.*must be a size \(64MB"):
        load_config([f"rollout.kv_memory={text}"])


def test_kv_memory_and_kv_pool_tokens_are_not_given_together_and_a_fraction_needs_cuda():
    with pytest.raises(ConfigError, match="rollout.kv_memory=64 and rollout.kv_pool_tokens=100 both size the KV pool"):
        load_config(["rollout.kv_memory=64", "rollout.kv_pool_tokens=100"])
    with pytest.raises(ConfigError, match="rollout.kv_memory=0.3 is a fraction.*parallel.device=cuda"):
        load_config(["rollout.kv_memory=0.3", "parallel.device=cpu"])
    with pytest.raises(ConfigError, match="rollout.admission=reserve with rollout.engine=sglang"):
        load_config(["rollout.admission=reserve", "rollout.engine=sglang"])
    assert not pool_is_sized(load_config([])) and pool_is_sized(load_config(["rollout.kv_memory=8MB"]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_bytes_is_the_engines_bytes_per_slot(dtype):
    engine = NativeEngine(tiny_model("llama", dtype=dtype), num_slots=8)
    # tiny_config: 2 layers, 2 KV heads, head dim 64 / 4 = 16
    assert engine.stats().kv_bytes_per_slot == entry_bytes(2, 2, 16, dtype.itemsize) == 2 * 2 * 2 * 16 * dtype.itemsize
    cache = engine.runner.k_cache[0]
    assert sum(t[: 8].nbytes for t in engine.runner.k_cache + engine.runner.v_cache) == 8 * entry_bytes(2, 2, 16, dtype.itemsize)
    assert cache.dtype == dtype


@pytest.fixture
def model_dir(tmp_path):
    tiny_config("llama").save_pretrained(tmp_path)  # config.json is all the sizing reads
    return str(tmp_path)


def cfg_of(*overrides):
    return load_config(["rollout.dtype=float32", *overrides])


def test_kv_memory_sizes_the_pool_of_both_engines(model_dir):
    cpu = torch.device("cpu")
    cfg = cfg_of("rollout.kv_memory=1MB", "rollout.max_new_tokens=64")
    per_entry = 2 * 2 * 2 * 16 * 4  # fp32: 512 B
    slots = pool_slots(cfg, 30, 4, model_dir, cpu)
    assert slots == MB // per_entry == 2048
    assert sglang_options(cfg, "cpu", slots).max_total_tokens == 2048  # SGLang's own option, the same entries
    bf16 = cfg_of("rollout.kv_memory=1MB", "rollout.dtype=bfloat16")
    assert pool_slots(bf16, 30, 4, model_dir, cpu) == 4096
    # Unset: kv_pool_tokens, else every sequence of the step densely, as before.
    assert pool_slots(cfg_of("rollout.kv_pool_tokens=300"), 30, 4, model_dir, cpu) == 300
    assert pool_slots(cfg_of("rollout.max_new_tokens=64", "rollout.n=2"), 30, 4, model_dir, cpu) == 4 * 2 * (30 + 64)


def test_the_start_up_line_counts_dense_and_compressed_sequences():
    cfg = cfg_of("rollout.max_new_tokens=100")
    line = pool_line(cfg, 2048, 512, SequenceSize(28, 100))
    assert line.startswith("KV pool 1.0 MB (kv_dtype auto: float32) = 2048 entries x 512 B: 16 dense sequences of 28 + "
                           "100 tokens (127 entries each)")
    assert "compressed" not in line and line.endswith("admission optimistic")
    sparse = cfg_of("rollout.max_new_tokens=100", "rollout.kv.algorithm=rkv", "rollout.kv.budget=32",
                    "rollout.kv.divide_length=16", "rollout.kv.window=4", "rollout.admission=reserve")
    line = pool_line(sparse, 2048, 512, SequenceSize(28, 100))
    # The compression bound: max(prompt, budget) + divide_length = 48 entries, 42 of them in 2048.
    assert ", 42 compressed ones (rkv budget 32: at most 48 entries each); admission reserve" in line


def test_a_memory_that_holds_no_sequence_is_one_error_line(model_dir, capsys):
    cfg = cfg_of("rollout.kv_memory=32KB", "rollout.max_new_tokens=64")  # 64 entries of 512 B
    with pytest.raises(SystemExit) as exit_:
        run_main(lambda: memory_slots(cfg, model_dir, torch.device("cpu"), SequenceSize(30, 64)))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: rollout.kv_memory=32KB (32.0 KB) holds 64 KV entries of 512 B")
    assert "one dense sequence of the longest prompt (30 tokens) + max_new_tokens 64 needs 93" in err
    assert "raise rollout.kv_memory to at least 0.05MB" in err  # 93 x 512 B = 46.5 KB
    assert memory_slots(cfg_of("rollout.kv_memory=0.05MB", "rollout.max_new_tokens=64"), model_dir,
                        torch.device("cpu"), SequenceSize(30, 64)) == 102
    # The same memory holds a compressed sequence: its bound is what must fit.
    sparse = cfg_of("rollout.kv_memory=32KB", "rollout.max_new_tokens=64", "rollout.kv.algorithm=rkv",
                    "rollout.kv.budget=32", "rollout.kv.divide_length=16", "rollout.kv.window=4")
    assert memory_slots(sparse, model_dir, torch.device("cpu"), SequenceSize(30, 64)) == 64
    with pytest.raises(Exception, match="is a fraction of the free device memory, but the engine runs on cpu"):
        memory_slots(cfg_of("rollout.kv_memory=0.5"), model_dir, torch.device("cpu"), SequenceSize(30, 64))


def test_the_start_up_lines_say_what_the_kv_policy_does_and_a_budget_never_reached():
    """On the default task's sizes (44-token prompts, 48 new tokens): the sparse preset's budget is never reached, a
    divide_length past the response cap never compresses, README's sparse command compresses; each case in a line."""
    from sparserl.config.load import load_config
    from sparserl.engine_options.sizing import SequenceSize, kv_policy_lines

    longest = SequenceSize(prompt=44, max_new_tokens=48)

    def lines(*overrides):
        return kv_policy_lines(load_config(list(overrides)), longest)

    (dense,) = lines()
    assert "dense" in dense and "kv figure stays at 100%" in dense
    first, never = lines("+preset=sparse_rl", "rollout.kv.budget=128")
    assert "rkv, budget 128 entries" in first and "the console's kv figure is the share of a dense cache" in first
    assert "rollout.kv.budget=128 is never reached" in never and "at most 91 entries" in never
    _, late = lines("+preset=sparse_rl", "rollout.kv.budget=48")  # divide_length 128: past the 48-token cap
    assert "rollout.kv.divide_length=128 is not below rollout.max_new_tokens=48" in late
    assert len(lines("+preset=sparse_rl", "rollout.kv.budget=48", "rollout.kv.divide_length=8")) == 1
    (auto, never_auto) = lines("+preset=sparse_rl", "rollout.kv.budget=auto")
    assert "budget auto (64-1024, from 1024)" in auto and "never reached" in never_auto
