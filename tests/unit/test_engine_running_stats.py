"""`EngineStats.mean_running` / `running_sum`: the sequences in each of the native engine's forward steps, on a tiny
random model, against the engine's own step trace; a pool that binds runs fewer at once under reservation."""
from sparserl.engines.native.engine import NativeEngine
from sparserl.engines.types import GenerationRequest, SamplingParams
from tests.conftest import tiny_model

PROMPTS = [[1, 5, 7], [2, 8, 4, 4], [9, 3, 6, 1, 2], [4, 4, 10], [6, 11, 12, 13], [7, 2]]


def run(num_slots, admission):
    engine = NativeEngine(tiny_model("llama"), num_slots=num_slots, eos_token_ids=[], admission=admission)
    engine.trace = []
    params = SamplingParams(temperature=1.0, max_new_tokens=12, n=2, seed=1)
    engine.generate([GenerationRequest(p, params, i) for i, p in enumerate(PROMPTS)])
    return engine.stats(), engine.trace


def test_mean_running_counts_the_sequences_of_every_forward_step():
    for slots, admission in ((4096, "optimistic"), (40, "reserve"), (40, "optimistic")):
        st, trace = run(slots, admission)
        per_step = [len(t.decoding) + len(t.admitted) for t in trace]  # retracted ones gave their slots back first
        assert st.forward_steps == len(trace) and st.running_sum == sum(per_step)
        assert st.mean_running == sum(per_step) / len(per_step) and st.peak_running == max(per_step)
    big, _ = run(4096, "optimistic")
    tight, _ = run(40, "reserve")  # 40 slots hold 2 worst cases of up to 16 entries
    assert big.peak_running == 12 and tight.peak_running == 2
    assert tight.mean_running <= 2 < big.mean_running
    st, _ = run(40, "reserve")
    st.running_sum, st.forward_steps = 0, 0
    assert st.mean_running == 0.0  # nothing counted: no division by zero
