"""The reward model and DPO: losses against hand computations in float64 (values and gradients), a packed pair
equal to its sequences alone, pair planning, the reward model's export (full and LoRA) scored by Hugging Face's
own class, and a pair file without chosen/rejected columns."""
import math

import pytest
import torch

from sparserl.algo.preference import bradley_terry, dpo_loss
from tests.conftest import tiny_model

C = [0.3, -1.2, 2.0]
R = [0.5, -2.0, -0.25]


def sig(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_bradley_terry_is_the_hand_computation_in_float64():
    c = torch.tensor(C, dtype=torch.float64, requires_grad=True)
    r = torch.tensor(R, dtype=torch.float64, requires_grad=True)
    loss, m = bradley_terry(c, r)
    loss.backward()
    assert loss.item() == pytest.approx(sum(-math.log(sig(a - b)) for a, b in zip(C, R)), abs=1e-12)
    # d/dc -log sig(c - r) = -(1 - sig(c - r)); d/dr = +(1 - sig(c - r))
    assert c.grad.tolist() == pytest.approx([-(1 - sig(a - b)) for a, b in zip(C, R)], abs=1e-12)
    assert r.grad.tolist() == pytest.approx([1 - sig(a - b) for a, b in zip(C, R)], abs=1e-12)
    assert m["rm/accuracy"].item() == 2 and m["rm/margin"].item() == pytest.approx(sum(C) - sum(R), abs=1e-12)


@pytest.mark.parametrize("name", ["sigmoid", "ipo"])
def test_dpo_and_ipo_are_the_hand_computations_in_float64(name):
    beta = 0.25
    pc, pr, qc, qr = [-10.0, -4.0, -7.5], [-9.0, -6.5, -7.0], [-9.5, -5.0, -8.0], [-9.2, -6.0, -6.0]
    tensors = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (pc, pr)]
    loss, m = dpo_loss(name, beta, *tensors, torch.tensor(qc, dtype=torch.float64), torch.tensor(qr, dtype=torch.float64))
    loss.backward()
    h = [(a - b) - (c - d) for a, c, b, d in zip(pc, pr, qc, qr)]
    if name == "sigmoid":
        want = sum(-math.log(sig(beta * x)) for x in h)
        dh = [-beta * (1 - sig(beta * x)) for x in h]
    else:
        want = sum((x - 1 / (2 * beta)) ** 2 for x in h)
        dh = [2 * (x - 1 / (2 * beta)) for x in h]
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert tensors[0].grad.tolist() == pytest.approx(dh, abs=1e-12)  # dh/dlogp_c = 1
    assert tensors[1].grad.tolist() == pytest.approx([-x for x in dh], abs=1e-12)  # dh/dlogp_r = -1
    rewards_c = [beta * (a - b) for a, b in zip(pc, qc)]
    rewards_r = [beta * (a - b) for a, b in zip(pr, qr)]
    assert m["dpo/chosen_reward"].item() == pytest.approx(sum(rewards_c), abs=1e-12)
    assert m["dpo/accuracy"].item() == sum(a > b for a, b in zip(rewards_c, rewards_r)) == 2


PROMPT, CHOSEN, REJECTED = [5, 9, 3, 7, 1], [11, 12, 13, 14], [21, 22, 23]


def test_a_packed_pair_gives_each_sequence_its_own_logprobs_and_score():
    from sparserl.actor.logprobs import PackedSeqs, packed_logprobs
    from sparserl.actor.reward import add_score_head, packed_scores

    model = tiny_model(dtype=torch.float64)
    add_score_head(model, seed=3)
    model.score.double()
    cpu = torch.device("cpu")
    pair = PackedSeqs([PROMPT + CHOSEN, PROMPT + REJECTED], [len(PROMPT)] * 2)
    alone = [PackedSeqs([PROMPT + x], [len(PROMPT)]) for x in (CHOSEN, REJECTED)]
    together, _ = packed_logprobs(model, pair, cpu)  # the prompt once, both responses after it
    scores = packed_scores(model, pair, cpu)
    for row, seqs in enumerate(alone):
        logp, _ = packed_logprobs(model, seqs, cpu)
        n = logp.shape[1]
        assert torch.allclose(together[row, :n], logp[0], atol=1e-12, rtol=0)
        assert torch.allclose(scores[row], packed_scores(model, seqs, cpu)[0], atol=1e-12, rtol=0)
    # the score is the head on the last token's hidden state of a plain forward
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([PROMPT + REJECTED])).last_hidden_state[0, -1]
    assert scores[1, 0].item() == pytest.approx((model.score.weight[0] @ hidden).item(), abs=1e-10)


def test_pairs_are_never_split_across_micro_batches():
    from sparserl.actor.reward import PairPlanning
    from sparserl.trainer.pairs import Pair, pair_batch

    planner = PairPlanning()
    planner.max_tokens = 30
    pairs = [Pair([1] * p, [2] * c, [3] * r) for p, c, r in [(10, 15, 12), (4, 3, 3), (8, 30, 2), (5, 5, 6)]]
    batch = pair_batch(pairs)
    plan = planner._plan(batch, list(range(len(batch))))
    assert sorted(i for mb in plan for i in mb) == list(range(8))
    for mb in plan:
        assert all(i % 2 == 0 and i + 1 in mb for i in mb[0::2]), plan
    # the 40-token pair (8 + 30 + 2, over the bound) has a micro-batch of its own
    assert [4, 5] in plan


def test_a_pair_file_without_chosen_and_rejected_is_one_line(tmp_path):
    from sparserl.trainer.pairs import read_pairs
    from sparserl.utils.errors import UserError

    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "2+2?", "chosen": "4", "rejected": "5"}\n{"prompt": "1+1?", "response": "2"}\n')
    with pytest.raises(UserError) as e:
        read_pairs(str(path), "data.train_path", "prompt")
    msg = str(e.value)
    assert "\n" not in msg and "row 1" in msg and "'chosen'" in msg and "'response'" in msg, msg


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_the_reward_model_trains_and_exports_a_classifier_with_the_same_scores(tmp_path, monkeypatch, lora_rank):
    from transformers import AutoModelForSequenceClassification

    from sparserl.actor.reward import RewardModel, export_reward_model
    from sparserl.config.load import load_config
    from sparserl.parallel import ParallelDims, init_distributed, teardown
    from sparserl.trainer.pairs import Pair, pair_batch
    from sparserl.trainer.rm import BTLoss

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    tiny_model().save_pretrained(tmp_path / "ckpt")
    cfg = load_config([f"trainer.output_dir={tmp_path / 'out'}", f"actor.lora.rank={lora_rank}"])
    info = init_distributed("cpu")
    try:
        mesh = ParallelDims.from_world(1, 1).build_mesh("cpu")
        rm = RewardModel(str(tmp_path / "ckpt"), mesh, info.device, dtype="float32", compute_dtype="float32", lr=1e-2,
                         lora=cfg.actor.lora, seed=1)
        batch = pair_batch([Pair(PROMPT, CHOSEN, REJECTED), Pair([4, 4, 8], [30, 31], [40, 41, 42, 43])])
        before = rm.scores(batch)
        head = rm.model.score.weight.detach().clone()
        loss = BTLoss()
        rm.accumulate_gradients(batch, loss, list(range(4)), with_entropy=False)
        norm, applied = rm._step()
        after = rm.scores(batch)
        assert applied and norm > 0 and not torch.equal(head, rm.model.score.weight.detach())
        assert loss.sums["rm/loss"].item() == pytest.approx(bradley_terry(before[0::2].double(), before[1::2].double())[0].item(), abs=1e-5)
        assert (after[0::2] - after[1::2]).sum() > (before[0::2] - before[1::2]).sum()  # the step moved the margins up
        export_reward_model(cfg, rm, None, 0)
    finally:
        teardown()
    hf = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out" / "hf").eval()
    with torch.no_grad():
        theirs = [hf(torch.tensor([ids])).logits[0, 0].item() for ids in batch.ids]
    assert theirs == pytest.approx(after.tolist(), abs=1e-5)
