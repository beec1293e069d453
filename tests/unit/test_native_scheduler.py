"""The native scheduler on its own (plain Python, no model): reserve vs optimistic admission, the retraction order,
what a retraction gives back, and the errors that replace a deadlock."""
import pytest

from sparserl.engines.native.scheduler import Scheduler
from sparserl.engines.native.sequence import Sequence, Status
from sparserl.engines.native.slot_pool import PoolExhausted, SlotPool
from sparserl.engines.types import SamplingParams


def seq(i: int, prompt_len: int, max_new: int, request: int | None = None) -> Sequence:
    params = SamplingParams(max_new_tokens=max_new)
    return Sequence(i, i if request is None else request, 0, [1 + i] * prompt_len, params, prompt_len + max_new - 1)


def forward(sched: Scheduler, batch, ends: dict[int, int] | None = None) -> list[Sequence]:
    """What the engine does after a step, without a model: count the computed tokens, draw one token for every
    sequence whose tokens all went through, retire those at their length (or at `ends[seq_id]` new tokens)."""
    for s in batch.decode + batch.prefill:
        s.num_cached += s.num_pending
    for s in batch.forks:
        s.num_cached = len(s.prompt)
    drawn = [s for s in batch.decode + batch.prefill + batch.forks if s.num_cached == s.num_tokens]
    for s in drawn:
        s.output.append(3)
        if len(s.output) >= (ends or {}).get(s.seq_id, s.params.max_new_tokens):
            sched.finish(s, "length")
    return drawn


def run(sched: Scheduler, seqs: list[Sequence], ends=None, max_steps=500) -> list:
    for s in seqs:
        sched.add(s)
    trace = []
    while sched.has_work():
        batch = sched.schedule()
        assert len(batch), "no progress"
        trace.append(batch)
        assert sched.pool.num_used <= sched.pool.num_slots
        forward(sched, batch, ends)
        max_steps -= 1
        assert max_steps > 0, "did not finish"
    assert sched.pool.num_free == sched.pool.num_slots and sched.reserved == 0
    return trace


def ids(seqs) -> list[int]:
    return [s.seq_id for s in seqs]


def test_reserve_admits_on_the_worst_case_and_never_retracts():
    sched = Scheduler(SlotPool(40), admission="reserve")
    seqs = [seq(i, 4, 16) for i in range(4)]  # 19 slots each at worst: two fit 40
    trace = run(sched, seqs, ends={i: 2 for i in range(4)})  # they end early, but reservation cannot know
    assert ids(trace[0].prefill) == [0, 1]
    assert sched.peak_running == 2 and sched.retractions == 0


def test_optimistic_admits_on_the_current_need_and_matches_reserve_when_the_pool_holds_every_worst_case():
    early = {i: 2 for i in range(4)}
    sched = Scheduler(SlotPool(40))
    trace = run(sched, [seq(i, 4, 16) for i in range(4)], ends=early)
    assert ids(trace[0].prefill) == [0, 1, 2, 3] and sched.peak_running == 4 and sched.retractions == 0
    # A pool that holds every worst case: both rules give the same schedule, step for step.
    schedules = []
    for admission in ("reserve", "optimistic"):
        sched = Scheduler(SlotPool(4 * 19), admission=admission)
        schedules.append([(ids(b.decode), ids(b.prefill)) for b in run(sched, [seq(i, 4, 16) for i in range(4)])])
    assert schedules[0] == schedules[1]


def test_the_watermark_stays_free_at_admission():
    sched = Scheduler(SlotPool(100), watermark=0.2)  # 20 slots kept free by an optimistic admission
    for i in range(5):
        sched.add(seq(i, 20, 50))  # worst case 69 each: only the first fits on it
    batch = sched.schedule()
    assert ids(batch.prefill) == [0, 1, 2, 3]  # a fifth prompt would leave 0 < 20 free
    assert sched.pool.num_free == 20


def test_the_youngest_are_retracted_first_and_the_oldest_always_decodes():
    sched = Scheduler(SlotPool(24), watermark=0.0)
    seqs = [seq(i, 4, 20) for i in range(4)]  # 23 slots each at worst; the four prompts (16) fit at once
    for s in seqs:
        sched.add(s)
    retractions = []
    while sched.has_work():
        before = list(sched.running)
        batch = sched.schedule()
        # Retracted: the youngest running ones, youngest first; never the oldest; a step that retracts admits nothing.
        assert ids(batch.retracted) == ids(before[1:][::-1][: len(batch.retracted)])
        if batch.retracted:
            assert not batch.prefill and not batch.forks
            assert ids(sched.waiting)[: len(batch.retracted)] == ids(batch.retracted[::-1])  # oldest at the front
        retractions.append(ids(batch.retracted))
        forward(sched, batch)
    first = next(r for r in retractions if r)
    assert first == [3] and retractions.index(first) == 3  # 16, 20, 24 slots, then the fourth step needs 4 more
    assert all(len(s.output) == 20 for s in seqs) and seqs[0].retractions == 0
    assert sched.retractions == sum(s.retractions for s in seqs) > 1
    assert sched.pool.num_free == 24 and sched.reserved == 0


def test_a_retraction_gives_everything_back_and_queues_in_age_order():
    sched = Scheduler(SlotPool(30), watermark=0.0)
    seqs = [seq(i, 5, 20) for i in range(5)]  # five prompts of 5 fit 30 slots; then 5 x 6 = 30
    for s in seqs:
        sched.add(s)
    forward(sched, sched.schedule())
    forward(sched, sched.schedule())
    batch = sched.schedule()  # each holds 6 slots and needs a 7th: the youngest goes
    four = seqs[4]
    assert ids(batch.retracted) == [4] and ids(sched.waiting) == [4]
    assert four.status is Status.WAITING and four.slots == [] and four.num_cached == 0 and four.fork_of is None
    assert four.output == [3, 3] and four.retractions == 1 and four.recomputed == 6
    assert four.num_pending == 7  # its prompt and both samples go through the model again
    forward(sched, batch)
    batch = sched.schedule()  # 4 x 7 = 28 held, 4 needed with 2 free
    assert ids(batch.retracted) == [3] and ids(sched.waiting) == [3, 4]


def test_a_forked_sibling_is_never_led_by_a_resumed_sequence():
    sched = Scheduler(SlotPool(200))
    resumed, sibling = seq(0, 4, 8, request=7), seq(1, 4, 8, request=7)
    sibling.prompt = list(resumed.prompt)
    resumed.output = [3, 3]  # retracted earlier: prompt + output are prefilled again
    sched.add(resumed)
    sched.add(sibling)
    batch = sched.schedule()
    assert ids(batch.prefill) == [0, 1] and not batch.forks
    assert len(resumed.slots) == 6 and len(sibling.slots) == 4


def test_sequences_that_cannot_be_retracted_are_admitted_on_their_worst_case():
    sched = Scheduler(SlotPool(40), watermark=0.0)
    a, pinned, b, c = seq(0, 4, 30), seq(1, 4, 4), seq(2, 4, 30), seq(3, 4, 8)
    pinned.retractable = c.retractable = False
    for s in (a, pinned, b, c):
        sched.add(s)
    batch = sched.schedule()
    # a: worst case 33 fits; pinned: 33 + 7 = 40 fits; b: admitted on its prompt; c (11): 40 + 33 + 11 > 40 waits.
    assert ids(batch.prefill) == [0, 1, 2] and ids(sched.waiting) == [3]
    trace = [batch]
    forward(sched, batch)
    trace += run(sched, [])
    retracted = {i for t in trace for i in ids(t.retracted)}
    assert retracted and retracted <= {0, 2} and 0 not in retracted
    assert [len(s.output) for s in (a, pinned, b, c)] == [30, 4, 30, 8]


def test_held_slots_that_nothing_frees_raise_instead_of_spinning():
    pool = SlotPool(20)
    pool.allocate(10)  # held by sessions nothing may drop (no make_room)
    sched = Scheduler(pool, held=10, watermark=0.0)
    sched.add(seq(0, 3, 12))  # worst case 14 > 20 - 10: admitted on its prompt
    for _ in range(8):  # 3 prompt slots, then 7 decode steps fill the 10 free slots
        forward(sched, sched.schedule())
    with pytest.raises(PoolExhausted, match=r"cannot hold the next tokens.*10 held by sessions.*rollout.kv_memory"):
        sched.schedule()


def test_a_sequence_larger_than_the_pool_is_refused_up_front():
    with pytest.raises(ValueError, match="needs up to 23 KV slots but the pool has 20"):
        Scheduler(SlotPool(20)).add(seq(0, 4, 20))
    with pytest.raises(ValueError, match="admission"):
        Scheduler(SlotPool(20), admission="greedy")
