"""Logged samples with 2 processes: `balance_ranks` trains some of rank 0's rows on rank 1, whose logp_old comes
back to rank 0, and the records still match what the loss received there (sparserl/trainer/samples.py), also when
the ranks rolled out different numbers of samples (as under partial rollouts: rank 1 must send back the rows rank 0
picks from its own count)."""
from tests.process.test_samples_run import check_records_match_loss, run_step


def test_records_of_rows_trained_on_another_rank(tiny_checkpoint, tmp_path):
    records, loss = run_step(tiny_checkpoint, tmp_path, "fused", nproc=2)
    assert check_records_match_loss(records, loss) == {0, 1}


def test_records_when_the_ranks_rolled_out_different_numbers_of_samples(tiny_checkpoint, tmp_path):
    records, loss = run_step(tiny_checkpoint, tmp_path, "fused", 2, "uneven")
    assert len(records) == 12  # all of rank 0's 3 prompts x 4 samples (trainer.log_samples=64)
    assert check_records_match_loss(records, loss) == {0, 1}
