"""TrainLogger: training lines every log interval, evaluations always, the bar counts iterations only."""
from mm_grpo.training.logging_utils import TrainLogger


def test_evaluations_are_printed_off_the_log_interval_and_do_not_advance_the_bar(tmp_path, capsys):
    logger = TrainLogger(str(tmp_path), total_iters=30, progress_bar=True, log_interval=10)
    for it in range(1, 26):
        logger.log(it, {"reward/mean": 0.5, "loss": 0.1})
    logger.log_eval(25, {"eval/compositional": 0.37})
    logger.log(26, {"loss": float("nan"), "skip_reason": "non-finite loss"})  # skips: printed at once
    assert logger.bar.n == 26
    logger.close()
    captured = capsys.readouterr()
    err = captured.out + captured.err  # tqdm.write: stdout, the bar: stderr
    assert "iteration     10 | reward/mean 0.5" in err and "iteration     20" in err
    assert "iteration     25 | eval/compositional 0.37" in err
    assert "iteration     25 | reward/mean" not in err
    assert "iteration     26 | loss nan | SKIPPED: non-finite loss" in err
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
