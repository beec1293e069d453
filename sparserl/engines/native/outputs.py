"""How a native-engine sequence ends and what it returns: the finish reason after each sampled token (stop tokens,
EOS, stop strings, the length cap), the `Generation` a finished sequence becomes, and the default EOS ids."""
from __future__ import annotations

from sparserl.engines.native.sequence import Sequence
from sparserl.engines.types import Generation, GenerationRequest, KVStats, eos_ids


def finish_reason(seq: Sequence, tok: int, eos_token_ids: frozenset[int], tokenizer) -> str | None:
    """"stop", "length" or None (the sequence goes on) after `tok` was appended to `seq.output`."""
    p = seq.params
    if (tok in p.stop_token_ids) or (not p.ignore_eos and tok in eos_token_ids):
        return "stop"
    if p.stop_strings and hits_stop_string(seq, tokenizer):
        return "stop"
    if len(seq.output) >= p.max_new_tokens:
        return "length"
    return None


def hits_stop_string(seq: Sequence, tokenizer) -> bool:
    longest = max(len(s) for s in seq.params.stop_strings)
    # A token decodes to at least one character, so the last `longest` tokens cover any match that the newest token
    # could have completed.
    tail = tokenizer.decode(seq.output[-(longest + 1):], skip_special_tokens=False)
    return any(s in tail for s in seq.params.stop_strings)


def to_generation(seq: Sequence, req: GenerationRequest, tokenizer) -> Generation:
    text = tokenizer.decode(seq.output, skip_special_tokens=True) if tokenizer is not None else None
    kv = KVStats(peak_slots=seq.peak_slots, retained_tokens=seq.retained_at_finish, total_tokens=seq.num_tokens - 1,
                 compressions=seq.compressions, compress_s=seq.compress_s, compressed_at=list(seq.compressed_at),
                 reused_tokens=seq.reused, retractions=seq.retractions,
                 kv_budget=seq.kv.budget if seq.kv is not None else None)
    session = seq.session if seq.keep else None
    return Generation(req.request_id, seq.sample_index, seq.prompt, list(seq.output), list(seq.logps),
                      seq.finish_reason, text, kv, session)


def default_eos(model, tokenizer) -> frozenset[int]:
    gen_cfg = getattr(model, "generation_config", None)
    return eos_ids(getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None))
