"""The GRPO schedule in the Megatron training loop, single process (CPU, fp32)."""
import dataclasses
import json
import math

import pytest
import torch

from mm_grpo.families.flux.chunks import forward_backward, make_velocity_fn
from mm_grpo.recompute import EVERY_BLOCK_FLAGS
from mm_grpo.rollout import rollout
from mm_grpo.training.loop import optimizer_step
from tests.fixtures import parallel_1proc  # noqa: F401
from tests.grpo_helpers import SMOOTH_REWARD, TRAIN_PROMPTS, grpo_argv, run_grpo, write_configs
from tests.utils import assert_one_line_error


@pytest.fixture(scope="module")
def configs(tiny_pipeline_dir, tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("grpo_cfg"), tiny_pipeline_dir)


def _weights(run):
    return {n: p.detach().clone() for n, p in run.model.modules[0].named_parameters()}


@pytest.mark.parametrize("train_mbs", [1, 4])
def test_rollout_log_probs_equal_training_recomputation(parallel_1proc, configs, train_mbs):
    """Rollout (micro-batch G = 4) vs the training path's recomputation at micro-batch 1 and G."""
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=["--micro-batch-size", "4"]))
    s = run.schedule
    prompts = ["a red circle"] * 4
    cond = s.conditioning(prompts)
    x0, noise = s.noise(0, range(4))
    traj = rollout(make_velocity_fn(s.policy, cond, 4), x0, s.sigmas, s.sampler, noise=noise)
    steps = torch.arange(s.s.num_inference_steps - 1).repeat(4, 1)
    s.s = s.s.__class__(**{**s.s.__dict__, "micro_batch_size": train_mbs})
    worst = 0.0
    with torch.no_grad():
        for mb in s.micro_batches(traj, cond, torch.zeros(4), steps, list(range(4))):
            v = s.policy[0](**{k: mb[k] for k in ("hidden_states", "encoder_hidden_states",
                                                         "pooled_projections", "timestep", "img_ids",
                                                         "txt_ids", "guidance")})
            logp = s.sampler(mb["hidden_states"], v, mb["timestep"], mb["sigma_next"], x_next=mb["x_next"]).log_prob
            worst = max(worst, (logp - mb["old_log_prob"]).abs().max().item())
    assert worst <= 1e-6


def test_first_micro_batch_ratio_is_exactly_one_and_later_updates_move_it(parallel_1proc, configs):
    history, _ = run_grpo(grpo_argv(*configs, iters=1, extra=["--updates-per-rollout", "2"]))
    stats = history[0]
    assert stats["ratio_first_mb_min"] == 1.0 and stats["ratio_first_mb_max"] == 1.0
    # The second optimizer step of the same rollout sees the updated policy.
    assert stats["ratio_max"] > 1.0 or stats["ratio_min"] < 1.0
    for key in ("reward/mean", "reward/std", "reward/jpeg_compressibility", "adv/mean", "loss", "grad_norm",
                "clip_frac", "lr", "time_rollout", "time_reward", "time_train", "samples_per_second"):
        assert math.isfinite(stats[key]), key
    assert stats["skipped"] == 0.0


def test_branch_mode_trains_a_random_window_after_the_shared_prefix(parallel_1proc, configs):
    from mm_grpo.grpo import branch_window
    from mm_grpo.seeding import GRPOStream, seeded_generator
    history, run = run_grpo(grpo_argv(*configs, iters=2, extra=["--timestep-selection", "branch", "--init-same-noise",
                                                                "--window-size", "3"]))
    s = run.schedule
    windows = [branch_window(3, 6, seeded_generator(3, it, GRPOStream.BRANCH_WINDOW)) for it in range(2)]
    assert windows == [(3, 6), (0, 3)]  # seed 3: a 3-step shared prefix, then none
    for it, ((start, end), stats) in enumerate(zip(windows, history)):
        assert stats["sde_window_start"] == start
        assert torch.equal(s.trained_steps(it, s.local_samples()), torch.arange(start, end).repeat(8, 1))
        # the window's log-probs came from whole-batch forwards, as training recomputes them
        assert stats["ratio_first_mb_min"] == 1.0 == stats["ratio_first_mb_max"]


def test_resume_repeats_the_uninterrupted_run_exactly(parallel_1proc, configs, tmp_path):
    full, run_full = run_grpo(grpo_argv(*configs, iters=4))
    stale = tmp_path / "ckpt" / ".iter_0000002.tmp" / "mp_rank_01_000"  # a crashed TP2 save
    stale.mkdir(parents=True)
    (stale / "model_optim_rng.pt").write_bytes(b"partial")
    evaluate = ["--eval-interval", "2", "--eval-prompts", "1"]  # seeded noise: leaves the training draws alone
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=["--save", str(tmp_path / "ckpt"), *evaluate]))
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    ckpt_entries = lambda: sorted(p.name for p in (tmp_path / "ckpt").glob("*iter*"))  # noqa: E731
    assert ckpt_entries() == ["iter_0000002", "latest_checkpointed_iteration.txt"]  # the stale .tmp is gone
    assert [p.name for p in (tmp_path / "ckpt" / "iter_0000002").glob("mp_rank_*")] == ["mp_rank_00"]
    # resumed at --train-iters: nothing trained, nothing saved (below it: refused, tests/test_resume_points.py)
    run_grpo(grpo_argv(*configs, iters=2, extra=["--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt")]))
    assert ckpt_entries() == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=4, extra=["--load", str(tmp_path / "ckpt"), *evaluate]))
    assert run_resumed.start_iteration == 2
    rewards = [h["reward/mean"] for h in full]
    assert run_resumed.train_rewards == rewards and sorted(run_resumed.evaluations) == [0, 2, 4]  # for the figures
    assert [h["reward/mean"] for h in first + second] == rewards
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_full_fine_tuning_in_bf16_with_recompute_stays_on_policy_and_resumes_exactly(parallel_1proc, configs,
                                                                                   tmp_path):
    """Full fine-tuning under --bf16 with every block recomputed (on CPU, one TP rank): the weights stay
    the optimizer's fp32 masters and are cast for each call, the first micro-batch's ratio is exactly 1,
    and a run saved at 2 and resumed repeats the uninterrupted one bit for bit."""
    extra = ["--bf16", *EVERY_BLOCK_FLAGS]
    full, run_full = run_grpo(grpo_argv(*configs, iters=4, extra=extra))
    assert {p.dtype for p in run_full.model.modules[0].parameters()} == {torch.float32}
    assert all(h["ratio_first_mb_min"] == h["ratio_first_mb_max"] == 1.0 for h in full)
    assert all(math.isfinite(v) for h in full for v in h.values() if isinstance(v, float))
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=4, extra=extra + ["--load", str(tmp_path / "ckpt")]))
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


# flow_grpo's cps sampler (Flow-GRPO's ordered steps) and GRPO-Guard (RatioNorm and the 1/|dt|
# step weight; two updates, so the second one's ratio has moved).
RESUMED_VARIANTS = {"cps": ["--sampler", "cps", "--timestep-selection", "ordered"],
                    "guard": ["--ratio-norm", "--step-reweight", "--updates-per-rollout", "2", "--clip-range", "0.2"]}


@pytest.mark.parametrize("variant", sorted(RESUMED_VARIANTS))
def test_objective_variants_resume_exactly(parallel_1proc, configs, tmp_path, variant):
    extra = RESUMED_VARIANTS[variant]
    full, run_full = run_grpo(grpo_argv(*configs, iters=4, extra=extra))
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=extra + ["--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=4, extra=extra + ["--load", str(tmp_path / "ckpt")]))
    assert run_resumed.start_iteration == 2
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    assert min(h["grad_norm"] for h in full) > 0
    a, b = _weights(run_full), _weights(run_resumed)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_scoring_beside_the_rollout_trains_as_the_whole_batch_does(parallel_1proc, configs):
    """--reward-overlap-groups: the rollout in parts of one group, each scored in a second thread
    while the next is rolled out, gives the run of the whole batch at once, bit for bit."""
    whole, run_whole = run_grpo(grpo_argv(*configs))
    parts, run_parts = run_grpo(grpo_argv(*configs, extra=["--reward-overlap-groups", "1"]))
    assert [h["reward/mean"] for h in parts] == [h["reward/mean"] for h in whole]
    assert [h["loss"] for h in parts] == [h["loss"] for h in whole]
    a, b = _weights(run_whole), _weights(run_parts)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_scoring_beside_the_rollout_with_a_shared_prefix_rolls_out_the_same_samples(parallel_1proc, configs):
    """With a group's shared ODE prefix (--init-same-noise, branch), a part runs the prefix on one
    row per group of the part, a smaller micro-batch than the whole batch's: the same rollout up to
    rounding (compared on the rollout: Adam's first steps would turn rounding into sign flips)."""
    extra = ["--sampler", "flow_sde", "--init-same-noise", "--timestep-selection", "branch", "--window-size", "2"]
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=extra))
    schedule, prompts = run.schedule, TRAIN_PROMPTS[:run.schedule.s.prompts_per_iteration]
    whole, whole_stats = schedule.prepare(0, prompts)
    schedule.s = dataclasses.replace(schedule.s, reward_overlap_groups=1)
    parts, parts_stats = schedule.prepare(0, prompts)
    for a, b in zip(whole[0], parts[0]):
        assert torch.allclose(a["hidden_states"], b["hidden_states"], rtol=1e-4, atol=1e-5)
    assert parts_stats["reward/mean"] == pytest.approx(whole_stats["reward/mean"], abs=1e-6)


def test_non_finite_reward_or_loss_skips_the_iteration(parallel_1proc, configs):
    _, run = run_grpo(grpo_argv(*configs, iters=0))
    s, reward = run.schedule, run.schedule.reward
    before = _weights(run)

    def nan_reward(images, prompts):
        total, per = reward(images, prompts)
        return total * float("nan"), per
    s.reward = nan_reward
    stats = run.step(0)
    assert stats["skipped"] == 1.0 and "non-finite" in stats["skip_reason"]
    assert all(torch.equal(before[n], w) for n, w in _weights(run).items())

    s.reward, loss_fn = reward, s.loss_fn
    s.loss_fn = lambda v, mb: (lambda out: (out[0] * float("nan"), out[1]))(loss_fn(v, mb))
    stats = run.step(1)
    assert stats["skipped"] == 1.0
    assert all(torch.equal(before[n], w) for n, w in _weights(run).items())

    s.loss_fn = loss_fn  # training continues
    stats = run.step(2)
    assert stats["skipped"] == 0.0
    assert any(not torch.equal(before[n], w) for n, w in _weights(run).items())


def test_awm_trains_on_the_rollout_samples_renoised_to_the_trained_steps(parallel_1proc, configs):
    """--policy-loss awm: each micro-batch is the decoded sample x0 re-noised by the forward process
    to a trained step's sigma; the ode sampler (no log-probs) can train with it, PPO cannot."""
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=["--policy-loss", "awm", "--sampler", "ode"]))
    s = run.schedule
    prompts = run.prompts.next_batch(2)
    updates, stats = s.prepare(0, prompts)
    assert stats["reward/std"] > 0  # ode: the group differs by its initial noises only
    cond = s.conditioning([prompts[i // 4] for i in range(8)])
    traj = s.sample(0, None, range(8), cond)
    steps = s.trained_steps(0, range(8))
    for i, mb in enumerate(updates[0]):
        k, rows = divmod(i, 4)  # micro-batches: trained step k of samples 2j, 2j + 1
        r = torch.arange(2 * rows, 2 * rows + 2)
        sigma = s.sigmas[steps[r, k]].view(-1, 1, 1)
        torch.testing.assert_close(mb["x0"], traj.x0_hat[r])
        torch.testing.assert_close(mb["hidden_states"], (1 - sigma) * mb["x0"] + sigma * mb["noise"])
        torch.testing.assert_close(mb["timestep"], s.sigmas[steps[r, k]])
    before = _weights(run)
    m = run.model
    per_mb, step = optimizer_step(m.chunks, m.optimizer, m.scheduler, updates[0], s.loss_fn,
                                  forward_backward=forward_backward)
    out = {**s.update_statistics(per_mb), **step}
    assert out["skipped"] == 0.0 and out["fm_loss"] > 0 and "ratio_mean" not in out
    assert any(not torch.equal(before[n], w) for n, w in _weights(run).items())
    with pytest.raises(ValueError, match="ode sampler has no log-probabilities.*--policy-loss awm"):
        _error(grpo_argv(*configs, extra=["--sampler", "ode"]))
    with pytest.raises(ValueError, match="draws the same image G times"):
        _error(grpo_argv(*configs, extra=["--sampler", "ode", "--policy-loss", "awm", "--init-same-noise"]))


def test_nft_with_an_ema_old_policy_resumes_exactly(parallel_1proc, configs, tmp_path):
    """--policy-loss nft with --ema-decay: the EMA samples the rollouts (nft's old policy), follows
    DiffusionNFT's decay schedule, is what the evaluation scores, and resumes from a checkpoint exactly."""
    nft = ["--policy-loss", "nft", "--sampler", "ode", "--ema-decay", "0.5", "--ema-decay-ramp", "0.2",
           "--updates-per-rollout", "2"]
    full, run_full = run_grpo(grpo_argv(*configs, iters=4, extra=nft))
    assert [h["ema_decay"] for h in full] == [0.0, 0.2, 0.4, 0.5]
    assert all(h["skipped"] == 0.0 and h["unweighted_policy_loss"] > 0 and 0 < h["optimality_mean"] < 1
               for h in full)
    ema, policy = run_full.ema.modules[0], run_full.model.modules[0]
    assert run_full.schedule.sampling_policy[0] is ema and run_full.evaluated_policy()[0] is ema
    assert any(not torch.equal(a, b) for a, b in zip(ema.parameters(), policy.parameters()))
    first, _ = run_grpo(grpo_argv(*configs, iters=2, extra=nft + ["--save", str(tmp_path / "ckpt")]))
    second, run_resumed = run_grpo(grpo_argv(*configs, iters=4, extra=nft + ["--load", str(tmp_path / "ckpt")]))
    assert run_resumed.start_iteration == 2
    assert [h["reward/mean"] for h in first + second] == [h["reward/mean"] for h in full]
    assert [h["loss"] for h in first + second] == [h["loss"] for h in full]
    ema = lambda run: dict(run.ema.modules[0].named_parameters())  # noqa: E731
    for a, b in ((_weights(run_full), _weights(run_resumed)), (ema(run_full), ema(run_resumed))):
        assert all(torch.equal(a[n], b[n]) for n in a)
    run_grpo(grpo_argv(*configs, iters=1, extra=["--save", str(tmp_path / "ckpt_plain")]))
    with pytest.raises(ValueError, match="holds no EMA"):
        _error(grpo_argv(*configs, iters=4, extra=["--ema-decay", "0.5", "--load", str(tmp_path / "ckpt_plain")]))


def test_nft_without_ema_starts_from_the_policy_itself(parallel_1proc, configs):
    """On-policy nft: v_old is the rollout policy's velocity on each row, so at the first micro-batch
    v+ = v- = v_old = v_theta and the loss is adv_clip_max / beta times the mean over rows of the
    x0 prediction's relative error mean(e^2) / mean|e|, e = x_t - sigma v - x0."""
    _, run = run_grpo(grpo_argv(*configs, iters=0, extra=["--policy-loss", "nft", "--sampler", "ode",
                                                          "--nft-beta", "0.5"]))
    s = run.schedule
    assert run.ema is None and s.sampling_policy is s.policy
    updates, _ = s.prepare(0, run.prompts.next_batch(2))
    mb = updates[0][0]
    v = s._velocity(s.policy, mb)
    assert torch.equal(mb["old_v"], v)
    loss, _ = s.loss_fn(v, mb)
    e = (mb["hidden_states"].double() - mb["timestep"].double().view(-1, 1, 1) * v.double() - mb["x0"].double())
    relative = (e**2).flatten(1).mean(1) / e.abs().flatten(1).mean(1)
    assert loss.item() == pytest.approx(s.s.adv_clip_max / 0.5 * relative.mean().item(), rel=1e-5)


def test_ratio_norm_keeps_the_first_ratio_at_one_and_moves_later_ones(parallel_1proc, configs):
    history, _ = run_grpo(grpo_argv(*configs, iters=1, extra=["--ratio-norm", "--updates-per-rollout", "2",
                                                               "--clip-range", "0.2"]))
    stats = history[0]
    assert stats["ratio_first_mb_min"] == 1.0 == stats["ratio_first_mb_max"]
    assert stats["ratio_max"] > 1.0 or stats["ratio_min"] < 1.0
    with pytest.raises(ValueError, match="--ratio-norm normalises PPO's importance ratio"):
        _error(grpo_argv(*configs, extra=["--ratio-norm", "--policy-loss", "awm", "--sampler", "ode"]))


def test_ratio_norm_refuses_cps_whose_log_ratio_is_not_gaussian():
    """RatioNorm's bias |d|^2 / (2 std^2) is that of a Gaussian log-ratio; cps scores with Flow-GRPO's
    constant-free squared error (tests/test_samplers.py)."""
    from mm_grpo.grpo.hyperparameters import GRPOSettings
    settings = GRPOSettings(prompts_per_iteration=2, num_generations=4, ratio_norm=True, sampler="cps")
    assert_one_line_error(lambda: settings.check(dp_size=1), "--ratio-norm removes the bias of a Gaussian step's "
                          "log-ratio; cps's log-prob is Flow-GRPO's constant-free squared error: use --sampler")
    dataclasses.replace(settings, sampler="flow_sde").check(dp_size=1)


def test_step_reweight_weighs_each_steps_ppo_term_by_one_over_its_dt(parallel_1proc, configs):
    """GRPO-Guard's gradient reweighting changes the first update's loss (ratio 1: L = -mean(w A)) and
    nothing of the rollout."""
    argv = dict(iters=1, extra=["--ratio-norm"])
    plain, _ = run_grpo(grpo_argv(*configs, **argv))
    argv["extra"] = argv["extra"] + ["--step-reweight"]
    weighted, _ = run_grpo(grpo_argv(*configs, **argv))
    assert weighted[0]["reward/mean"] == plain[0]["reward/mean"]
    assert weighted[0]["loss"] != pytest.approx(plain[0]["loss"], rel=1e-3)
    with pytest.raises(ValueError, match="--step-reweight weighs PPO's per-step terms"):
        _error(grpo_argv(*configs, extra=["--step-reweight", "--policy-loss", "nft", "--sampler", "ode"]))


# --- bad input: clear errors before any work ------------------------------------------
def _error(argv):
    from mm_grpo.training.arguments import parse_args
    from mm_grpo.training.train_grpo import GRPORun
    GRPORun(parse_args(argv))


def test_missing_or_empty_prompt_file(parallel_1proc, configs, tmp_path):
    model, data = configs
    import json
    cfg = json.load(open(data))
    for prompt_file, message in ((str(tmp_path / "nope.txt"), "prompt file not found"),
                                 (str(tmp_path / "empty.txt"), "prompt file is empty")):
        (tmp_path / "empty.txt").write_text("\n\n")
        cfg["dataset_param"]["prompt_file"] = prompt_file
        (tmp_path / "data.json").write_text(json.dumps(cfg))
        with pytest.raises((FileNotFoundError, ValueError), match=message):
            _error(grpo_argv(model, str(tmp_path / "data.json")))


def test_config_paths_resolve_like_a_shell(tmp_path, monkeypatch):
    from mm_grpo.training.components import resolve_paths
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_DIR", "models/flux")
    cfg = {"ae": {"from_pretrained": "$PIPELINE_DIR"}, "predictor": {"from_pretrained": "weights/transformer"},
           "reward": [{"name": "hps", "path": "/abs/hps.pt"}], "comment": "$PIPELINE_DIR stays a string"}
    out = resolve_paths(cfg, "/configs")
    assert out["ae"]["from_pretrained"] == str(tmp_path / "models/flux")  # set in the shell: from the cwd
    assert out["predictor"]["from_pretrained"] == "/configs/weights/transformer"  # written in the JSON
    assert out["reward"][0]["path"] == "/abs/hps.pt" and out["comment"] == "$PIPELINE_DIR stays a string"
    monkeypatch.setenv("EVAL_PROMPT_FILE", "")  # grpo_flux.sh exports it empty when not given: no evaluation
    assert resolve_paths({"eval_prompt_file": "$EVAL_PROMPT_FILE"}, "/configs") == {"eval_prompt_file": ""}
    monkeypatch.delenv("PIPELINE_DIR")
    with pytest.raises(ValueError, match=r"^config ae: from_pretrained uses \$PIPELINE_DIR, which is not set in the environment$"):
        resolve_paths(cfg, "/configs")


def test_reward_errors(parallel_1proc, tiny_pipeline_dir, tmp_path):
    for reward, message in (([{"name": "hps", "path": str(tmp_path / "missing.pt")}], "missing.pt"),
                            ([{"name": "beauty"}], "beauty"),
                            # checked before any rollout, on every rank (a rank scores only its prompts)
                            ([{"name": "compositional"}], "'a purple square above a circle' is not in the shapes")):
        model, data = write_configs(tmp_path / reward[0]["name"], tiny_pipeline_dir, reward=reward)
        with pytest.raises((FileNotFoundError, ValueError), match=message):
            _error(grpo_argv(model, data))


def test_unknown_sampler_and_indivisible_batch(parallel_1proc, configs, capsys):
    with pytest.raises(SystemExit):
        _error(grpo_argv(*configs, extra=["--sampler", "euler_ancestral"]))
    assert "invalid choice: 'euler_ancestral'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"the 6 samples per iteration \(2 prompts x 3 generations\) must split"):
        _error(grpo_argv(*configs, extra=["--num-generations", "3", "--micro-batch-size", "4"]))
    with pytest.raises(ValueError, match="micro-batch size 3"):
        _error(grpo_argv(*configs, extra=["--micro-batch-size", "3"]))
    with pytest.raises(ValueError, match="branch needs --init-same-noise"):
        _error(grpo_argv(*configs, extra=["--timestep-selection", "branch"]))
    # values that would otherwise divide by zero, or fail only after a rollout or on one stage
    for extra, message in ((["--num-generations", "1"], "--num-generations must be >= 2"),
                           (["--micro-batch-size", "0"], "--micro-batch-size and --updates-per-rollout must be >= 1"),
                           (["--timestep-fraction", "0"], r"--timestep-fraction must be in \(0, 1\]"),
                           (["--clip-range", "0"], "need --clip-range > 0"),
                           (["--timestep-selection", "window", "--window-size", "7"], r"--window-size must be in \[1, 6\]"),
                           (["--sampler", "cps", "--timestep-selection", "window", "--window-size", "6"],
                            r"--window-size must be in \[1, 5\]"),
                           (["--log-interval", "0"], "--log-interval must be >= 1"),
                           (["--reward-overlap-groups", "3"], "--reward-overlap-groups 3: its 12 samples must divide "
                                                              "a data-parallel rank's 8")):
        with pytest.raises(ValueError, match=message):
            _error(grpo_argv(*configs, extra=extra))


def test_cps_never_trains_its_noiseless_last_step(parallel_1proc, configs):
    """cps's step into sigma = 0 draws no noise: Flow-GRPO's ordered selection of every step and
    a window that has slid to the end stop one step short of it."""
    _, run = run_grpo(grpo_argv(*configs, iters=1, extra=["--sampler", "cps", "--timestep-selection", "ordered",
                                                          "--timestep-fraction", "1"]))
    assert run.schedule.trained_steps(0, range(8)).tolist() == [list(range(5))] * 8
    run.schedule.s = dataclasses.replace(run.settings, timestep_selection="window")  # 3 steps, moved every 25
    assert [run.schedule.sde_window(it) for it in range(0, 100, 25)] == [(0, 3), (1, 4), (2, 5), (0, 3)]


def test_bf16_with_tensor_parallelism_is_refused_on_cpu_before_any_work(parallel_1proc, configs):
    with pytest.raises(ValueError, match="--bf16 with --tensor-model-parallel-size > 1 needs an accelerator"):
        _error(grpo_argv(*configs, extra=["--bf16", "--tensor-model-parallel-size", "2"]))


def test_a_global_batch_size_other_than_the_derived_one_is_refused_before_any_work(parallel_1proc, configs):
    """--global-batch-size means Megatron's (rows per optimizer step); the batch is given in prompts."""
    with pytest.raises(ValueError, match=r"^--global-batch-size 8 counts \(sample, trained step\) rows per optimizer "
                                         r"step, which --prompts-per-iteration 2 x --num-generations 4 x 3 trained "
                                         r"steps / --updates-per-rollout 1 make 24"):
        _error(grpo_argv(*configs, extra=["--global-batch-size", "8"]))


def test_held_out_evaluation_and_figures(parallel_1proc, tiny_pipeline_dir, tmp_path):
    """Evaluation before training and at the end (fixed ODE noise: equal weights give equal
    scores), sample grids every --save-image-interval (an evaluation of its own between the
    --eval-interval ones), and the two PNGs in the run folder."""
    smooth = write_configs(tmp_path / "cfg", tiny_pipeline_dir, reward=SMOOTH_REWARD)  # JPEG sizes are steps
    history, run = run_grpo(grpo_argv(*smooth, iters=2, extra=["--eval-interval", "2", "--eval-prompts", "2",
                                                               "--save-image-interval", "1",
                                                               "--tensorboard-dir", str(tmp_path)]))
    assert sorted(run.evaluations) == [0, 1, 2]
    assert sorted(p.name for p in (tmp_path / "samples").glob("*.png")) == ["eval_000001.png", "eval_000002.png"]
    again = run.evaluator(run.model.modules).stats
    assert again == run.evaluations[2]  # deterministic: same weights, same noise
    assert run.evaluations[0] != run.evaluations[2]  # the weights moved
    for name in ("reward_curve.png", "before_after.png"):
        with open(tmp_path / name, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    assert not list(tmp_path.glob("*.tmp.png"))
    # each evaluation's per-sample scores, whose mean is the logged one
    for it in (0, 1, 2):
        saved = json.loads((tmp_path / "eval" / f"scores_{it:06d}.json").read_text())
        assert saved["iteration"] == it and saved["prompts"] == run.evaluator.prompts[::saved["noises"]]
        cells = [v for row in saved["scores"]["reward_mean"] for v in row]
        assert len(cells) == len(run.evaluator.prompts)
        assert sum(cells) / len(cells) == pytest.approx(run.evaluations[it]["eval/reward_mean"], rel=1e-6)
