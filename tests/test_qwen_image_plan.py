"""`mm-grpo plan --model qwen-image`: the parameter counts against the built model (two sizes, pipeline
stages, TP by layout.py's rules, LoRA's adapters) and diffusers' 20B model, the frozen parts against
diffusers' VAE and transformers' Qwen2.5-VL, the FLOPs against torch's counter, the activation terms
against what autograd saves on one block and the peaks of a whole model's training forward + backward
and rollout forward (true CFG too) on CPU, and the command line."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bench.bench_parallel_memory import BlockLiveMeter, SavedActivationMeter
from mm_grpo.families.qwen_image import plan as q
from mm_grpo.families.qwen_image.transformer import QwenImageConfig
from mm_grpo.plan.devices import device
from mm_grpo.plan.formulas import Layout
from mm_grpo.recompute import EVERY_BLOCK, recompute_fields
from mm_grpo.tools.plan import main
from tests.fixtures import parallel_1proc  # noqa: F401

GB = 10 ** 9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 0.10  # FLUX's planner test's bar (tests/test_plan.py)
TINY = QwenImageConfig.preset("tiny")
# Mid-size: 4 heads of 64 (D = 256), 3 blocks, packed latents of 64 channels as the 20B model's.
MID = QwenImageConfig(in_channels=64, out_channels=16, num_layers=3, attention_head_dim=64, num_attention_heads=4,
                      joint_attention_dim=128, axes_dims_rope=(16, 24, 24))
LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # the attention and MLP linears


class Adapter:
    """LoRA on one single-rank linear as layers.py calls it (`_with_adapter`): out + B (A x), B (A x)
    accumulated into the frozen linear's output by addmm (FLUX's lora.Adapter on one rank)."""
    enabled = True

    def add_to(self, layer, x, out):
        h = F.linear(x, layer.lora_A.weight.to(out.dtype))
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]),
                           layer.lora_B.weight.to(out.dtype).t())
        return flat.view(out.shape)


def add_lora(model, r: int, bf16: bool):
    """Adapters of rank r on LORA_TARGETS, the base frozen (in bf16 under bf16 but its norm weights)."""
    model.requires_grad_(False)
    for name, layer in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in LORA_TARGETS:
            out_features, in_features = layer.weight.shape
            layer.lora_A = torch.nn.Linear(in_features, r, bias=False)
            layer.lora_B = torch.nn.Linear(r, out_features, bias=False)
            layer.adapter = Adapter()
    if bf16:
        for name, p in model.named_parameters():
            if not p.requires_grad and (p.dim() >= 2 or name.endswith(".bias")):
                p.data = p.data.to(torch.bfloat16)
    return model


def _model(config, stage=0, pp=1):
    from mm_grpo.families.qwen_image.transformer import QwenImageTransformer, transformer_config
    torch.manual_seed(0)
    return QwenImageTransformer(config, transformer_config(config), stage == 0, stage == pp - 1,
                                q.stage_range(config, pp, stage))


# --- parameters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, stage, pp", [(TINY, 0, 1), (TINY, 0, 2), (TINY, 1, 2), (MID, 0, 1), (MID, 0, 2),
                                              (MID, 1, 2), (MID, 1, 3), (MID, 2, 3)],
                         ids=["tiny", "tiny-pp2-first", "tiny-pp2-last", "mid", "mid-pp2-first", "mid-pp2-last",
                              "mid-pp3-middle", "mid-pp3-last"])
def test_parameter_count_matches_the_built_model(parallel_1proc, config, stage, pp):
    """stage_params (counted by hand) equals the parameters of the stage QwenImageTransformer builds
    (mid's 3 blocks over PP 2: 1 + 2, stage_blocks' uneven split), and its LoRA adapters those put
    on its attention and MLP linears."""
    model = _model(config, stage, pp)
    assert q.stage_params(config, 1, pp, stage)[0] == sum(p.numel() for p in model.parameters())
    r = 8
    add_lora(model, r, bf16=False)
    adapters = sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert q.stage_params(config, 1, pp, stage, lora_rank=r)[1] == adapters > 0


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_shares_follow_the_layout_rules(parallel_1proc, tp):
    """A TP rank's count equals layout.py's rules applied to the whole model's tensors: column splits
    a tensor, row splits a weight's columns, replicated keeps it whole."""
    from mm_grpo.families.qwen_image.transformer import layout
    model = _model(MID)
    full = dict(model.named_parameters())
    share = {"column": lambda t: t.numel() // tp, "row": lambda t: t.numel() // tp, "replicated": lambda t: t.numel()}
    expected = sum(share[rule.shard](full[rule.megatron]) for rule in layout.stage_rules(MID))
    assert q.stage_params(MID, tp, 1, 0)[0] == expected


def test_the_20b_count_is_diffusers_model():
    """QwenImageConfig.preset("qwen-image") counts what diffusers' QwenImageTransformer2DModel holds."""
    from diffusers import QwenImageTransformer2DModel
    config = QwenImageConfig.preset("qwen-image")
    with torch.device("meta"):
        reference = QwenImageTransformer2DModel(**config.to_diffusers_config())
    assert q.total_params(config) == sum(p.numel() for p in reference.parameters()) == 20_430_401_088


def test_the_frozen_parts_are_the_libraries_models():
    """The VAE (diffusers' AutoencoderKLQwenImage at its defaults, Qwen-Image's vae config) and
    Qwen2.5-VL-7B-Instruct (transformers' class at its config), counted on the meta device."""
    from diffusers import AutoencoderKLQwenImage
    with torch.device("meta"):
        vae = AutoencoderKLQwenImage()
    assert q.QWEN_IMAGE_VAE_PARAMS == sum(p.numel() for p in vae.parameters())
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584),
        tie_word_embeddings=False)
    with torch.device("meta"):
        encoder = transformers.Qwen2_5_VLForConditionalGeneration(config)
    params = {n: p.numel() for n, p in encoder.named_parameters()}
    assert q.QWEN25_VL_7B_PARAMS == sum(params.values())
    assert q.QWEN25_VL_7B_LANGUAGE_PARAMS == sum(v for n, v in params.items() if ".visual." not in f".{n}")


def test_vae_decode_constants_against_a_measured_decode():
    """The decode's live set per output pixel (the slope between 64 and 128 px) and its convolution
    FLOPs per pixel, on diffusers' AutoencoderKLQwenImage with random weights (fp32, CPU)."""
    from diffusers import AutoencoderKLQwenImage
    from torch.utils.flop_counter import FlopCounterMode

    from bench.plan_validate import LiveTensorMeter
    torch.manual_seed(0)
    vae = AutoencoderKLQwenImage().eval()
    peaks = {}
    for px in (64, 128):
        meter = LiveTensorMeter()
        with torch.no_grad(), meter:
            vae.decode(torch.randn(1, 16, 1, px // 8, px // 8))
        peaks[px] = meter.peak / 4  # values
    assert (peaks[128] - peaks[64]) / (128 ** 2 - 64 ** 2) == pytest.approx(q.VAE_DECODE_VALUES_PER_PIXEL, rel=0.01)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        vae.decode(torch.randn(1, 16, 1, 8, 8))
    assert counter.get_total_flops() / 64 ** 2 == q.VAE_DECODE_FLOPS_PER_PIXEL


# --- FLOPs ---------------------------------------------------------------------------------------
def _inputs(config, text, grid, batch, seed=0, masked=True):
    """Forward kwargs: packed latents on a `grid`, prompts of `text` tokens (the second one shorter,
    padded and masked, when `masked`)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, text, dtype=torch.long)
    if masked and batch > 1:
        mask[1, text * 3 // 4:] = 0
    return dict(hidden_states=torch.randn(batch, grid[0] * grid[1], config.in_channels, generator=g),
                encoder_hidden_states=torch.randn(batch, text, config.joint_attention_dim, generator=g),
                encoder_hidden_states_mask=mask if masked else None, timestep=torch.rand(batch, generator=g),
                img_shapes=[[(1, *grid)]] * batch)


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_flops_are_torch_flop_counters(parallel_1proc, lora_rank):
    """sample_flops' forward and backward equal torch's FlopCounterMode on the model (attention on the
    math path, whose products the counter sees), full fine-tuning and LoRA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = _model(MID)
    if lora_rank:
        add_lora(model, lora_rank, bf16=False)
    inputs = _inputs(MID, 24, (8, 12), 1, masked=False)
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as forward:
            out = model(**inputs)
        with FlopCounterMode(display=False) as backward:
            out.sum().backward()
    counted = q.sample_flops(MID, q.Job(height=8 * 16, width=12 * 16, text_tokens=24, lora_rank=lora_rank))
    assert (forward.get_total_flops(), backward.get_total_flops()) == (counted.forward, counted.backward)


def test_true_cfg_doubles_the_transformer_work():
    config, comps, layout = QwenImageConfig.preset("qwen-image"), q.components(), Layout(tp=2, pp=2, dp=2)
    npu = device("atlas-800t-a2")
    on, off = (q.Job(lora_rank=64, true_cfg_scale=s).on(layout) for s in (4.0, 1.0))
    t_on, t_off = (q.iteration_time(config, comps, j, layout, npu, 0.4) for j in (on, off))
    assert t_on.parts["rollout"] == pytest.approx(2 * t_off.parts["rollout"])
    assert t_on.parts["train"] == pytest.approx(2 * t_off.parts["train"])
    m_on, m_off = (q.rank_memory(config, comps, j, layout).for_stage(0).terms for j in (on, off))
    assert m_on["activations_per_microbatch"] == pytest.approx(2 * m_off["activations_per_microbatch"])
    assert m_on["rollout_forward"] == pytest.approx(2 * m_off["rollout_forward"])
    assert m_on["vae_decode"] == m_off["vae_decode"] and off.image_tokens == 4096  # 1024 px: a 64 x 64 grid


# --- memory ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_block_terms_match_what_autograd_saves(parallel_1proc, bf16, lora_rank):
    """On one block (D = 256, 4 heads; 64 text tokens, 10 of them masked, and 512 / 1024 image
    tokens), per token and hidden unit: the bytes autograd saves (block_activation_bytes; the model's
    last block, varying its text tokens, the attention part alone), the recomputed backward's
    working set (BACKWARD_WORKING_BYTES_PER_TOKEN) and the no-grad forward's live set
    (rollout_forward_working_bytes)."""
    from torch.utils.checkpoint import checkpoint

    from mm_grpo import kernels
    config = MID.replace(num_layers=2, bf16=bf16)
    model = _model(config)
    if lora_rank:
        add_lora(model, lora_rank, bf16)
    dtype, D = (torch.bfloat16 if bf16 else torch.float32), config.hidden_size
    params = list(model.parameters())

    def measure(block, text, image_grid):
        image = image_grid[0] * image_grid[1]
        rope = kernels.rope_table(*model.rope(((1, *image_grid),), text, torch.device("cpu")))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(text + image, 1, D, generator=g).to(dtype).requires_grad_(True)
        vec = torch.randn(1, D, generator=g).to(dtype).requires_grad_(not lora_rank)
        mask = torch.ones(1, text + image, dtype=torch.bool)
        mask[:, text - 10:text] = False
        saved = SavedActivationMeter(params + [rope])
        with saved():
            block(x, text, vec, rope, mask)
        live = BlockLiveMeter(params + [rope, x, vec, mask])
        with live:
            y = checkpoint(block, x, text, vec, rope, mask, use_reentrant=False)
            y.backward(torch.ones_like(y))
        no_grad = BlockLiveMeter(params + [rope, x, vec, mask])
        with torch.no_grad(), no_grad:
            block(x, text, vec, rope, mask)
        out = x.numel() * x.element_size()
        return saved.peak, live.peak - saved.peak, no_grad.peak + out

    small, large = measure(model.blocks[0], 64, (16, 32)), measure(model.blocks[0], 64, (32, 32))
    slope = [(b - a) / 512 / D for a, b in zip(small, large)]
    counted = q.block_activation_bytes(config, 1, lora_rank, 2 if bf16 else 4)
    # equal but for the LayerNorm statistics (bf16 on CPU, counted fp32 as on GPUs): 8 bytes a token and norm
    assert slope[0] == pytest.approx((counted.attention + counted.tail) / D, abs=0.1)
    assert slope[1] == pytest.approx(q.BACKWARD_WORKING_BYTES_PER_TOKEN[2 if bf16 else 4, bool(lora_rank)], abs=0.2)
    jobs = [q.Job(height=h, width=512, text_tokens=64, micro_batch_size=1, lora_rank=lora_rank, bf16=bf16,
                  true_cfg_scale=1) for h in (256, 512)]  # one pass of 512 and 1024 image tokens
    live = [q.rollout_forward_working_bytes(config, j, Layout()) for j in jobs]
    assert slope[2] == pytest.approx((live[1] - live[0]) / 512 / D, abs=0.2)
    # the last block's text tokens: the attention part only
    last = [measure(model.blocks[1], text, (16, 16))[0] for text in (64, 128)]
    assert (last[1] - last[0]) / 64 / D == pytest.approx(counted.attention / D, abs=0.1)


CASES = [  # (bf16, LoRA rank, recompute, true CFG scale)
    (False, 0, False, 1.0), (True, 0, True, 1.0), (True, 8, False, 1.0), (True, 8, True, 4.0)]


@pytest.mark.parametrize("bf16, lora_rank, recompute, scale", CASES,
                         ids=["fp32-full", "bf16-full-recompute", "bf16-lora", "bf16-lora-recompute-cfg"])
def test_training_and_rollout_peaks_within_10_percent(parallel_1proc, bf16, lora_rank, recompute, scale):
    """One micro-batch of 2 samples (32 text tokens, the second prompt's last 8 masked; 512 image
    tokens) through the mid-size model (3 blocks) as the denoiser runs it, true CFG too: the peak of
    the live tensors of its training forward + backward (the gradients allocated before, as the
    trainer's main gradients are) against activations_at_peak + recompute_bytes +
    backward_working_bytes, and of its rollout velocity against rollout_forward_working_bytes."""
    from mm_grpo.families.qwen_image.denoiser import QwenImageDenoiser
    config = MID.replace(bf16=bf16, **recompute_fields(EVERY_BLOCK if recompute else None))
    model = _model(config)
    if lora_rank:
        add_lora(model, lora_rank, bf16)
    params = list(model.parameters())
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    grid, text, batch = (16, 32), 32, 2
    inputs = _inputs(config, text, grid, batch, seed=3)
    g = torch.Generator().manual_seed(4)
    negative = (torch.randn(1, 5, config.joint_attention_dim, generator=g), torch.ones(1, 5, dtype=torch.long))
    job = q.Job(height=grid[0] * 16, width=grid[1] * 16, text_tokens=text, micro_batch_size=batch,
                lora_rank=lora_rank, recompute=recompute, bf16=bf16, true_cfg_scale=scale)
    denoiser = QwenImageDenoiser(job.height, job.width, config.in_channels, scale, negative if scale > 1 else None)
    cond = denoiser.conditioning((inputs["encoder_hidden_states"], inputs["encoder_hidden_states_mask"]), None,
                                 torch.device("cpu"))
    rows = dict(cond, hidden_states=inputs["hidden_states"], timestep=inputs["timestep"])
    weight = torch.randn(batch, grid[0] * grid[1], config.output_channels, generator=g)
    with torch.no_grad():
        denoiser.forward(model, rows)  # the RoPE table, made once and kept (model.py `rope`)
    existing = params + [p.grad for p in params if p.grad is not None] + list(model._rope_cache[1]) + \
        [t for t in (*rows.values(), *negative, weight) if isinstance(t, torch.Tensor)]
    train = BlockLiveMeter(existing)
    with train:
        (denoiser.forward(model, rows).float() * weight).sum().backward()
    layout = Layout()
    predicted = (q.activations_at_peak(config, job, layout, 0) + q.recompute_bytes(config, job, layout)
                 + q.backward_working_bytes(config, job, layout))
    rollout = BlockLiveMeter(existing)
    with torch.no_grad(), rollout:
        denoiser.velocity_fn([model], cond, batch)(inputs["hidden_states"], inputs["timestep"])
    forward = q.rollout_forward_working_bytes(config, job, layout)
    print(f"\ntrain {train.peak / 2 ** 20:.2f} MiB, predicted {predicted / 2 ** 20:.2f}; rollout "
          f"{rollout.peak / 2 ** 20:.2f}, predicted {forward / 2 ** 20:.2f}")
    assert abs(predicted / train.peak - 1) < TOLERANCE, (predicted, train.peak)
    assert abs(forward / rollout.peak - 1) < TOLERANCE, (forward, rollout.peak)


def test_lora_keeps_no_gradients_or_optimizer_states_for_the_base():
    config, layout = QwenImageConfig.preset("qwen-image"), Layout(tp=2, dp=4)
    full = q.rank_memory(config, q.components(), q.Job(kl_reference=True).on(layout), layout).worst.terms
    lora = q.rank_memory(config, q.components(), q.Job(lora_rank=64, kl_reference=True).on(layout), layout).worst.terms
    base, adapters = q.stage_params(config, 2, 1, 0, lora_rank=64)
    assert lora["main_grads"] == 4 * adapters and lora["optimizer"] == 8 * adapters / 4
    assert full["weights"] == full["kl_reference"] == 4 * base and lora["kl_reference"] == 0
    norms = q.fp32_norm_params(config, 1, 0)
    assert norms == 60 * 4 * 128 + 3584  # QK norms of both streams, the features' RMSNorm
    assert lora["weights"] == 2 * base + 2 * norms + 4 * adapters
    assert 0 < adapters < base / 20


def test_text_encoder_is_on_every_rank_without_the_cache():
    config, layout = QwenImageConfig.preset("qwen-image"), Layout(dp=8)
    cached, resident = (q.rank_memory(config, q.components(text_cache=c), q.Job(lora_rank=64, text_cache=c).on(layout),
                                      layout).worst.terms for c in (True, False))
    assert cached["text_encoders"] == 0 and resident["text_encoders"] == 2 * q.QWEN25_VL_7B_PARAMS


# --- the command line ---------------------------------------------------------------------------
def test_table_lists_every_layout_and_marks_why_it_does_not_fit(capsys):
    assert main(["plan", "--model", "qwen-image", "--devices", "8", "--device-memory", "64", "--lora-rank", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Qwen-Image 20.43B (qwen-image), LoRA rank 64, 1024x1024 (4096 image + 256 text")
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == len(q.layouts(QwenImageConfig.preset("qwen-image"), 8)) == 20
    assert {row[6] for row in rows} == {"yes", "no"}
    for row in rows:
        if row[6] == "no":
            assert "GB > 64 GB" in " ".join(row)


def test_a_layout_that_does_not_fit_is_reported(capsys):
    """Full fine-tuning of the 20B model on one 80 GB card: fp32 weights, gradients and Adam's moments
    are 16 bytes a parameter, 327 GB."""
    assert main(["--model", "qwen-image", "--devices", "1", "--device", "h100", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert not row["fits"] and row["peak_bytes_per_rank"] > 16 * 20.43 * GB
    assert row["reason"].startswith(f"{row['peak_bytes_per_rank'] / GB:.1f} GB > 80 GB in ")
    assert row["reason"].endswith("largest: optimizer 163.4, weights 81.7, main_grads 81.7")


def test_json_rows_rank_the_fitting_layouts_by_time(capsys):
    assert main(["--model", "qwen-image", "--devices", "16", "--device-memory", "64", "--lora-rank", "64",
                 "--height", "512", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert all(r["tp"] * r["pp"] * r["sp"] * r["dp"] == 16 and 24 % (r["tp"] * r["sp"]) == 0 for r in rows)
    fitting = [r for r in rows if r["fits"]]
    assert fitting and all(r["peak_bytes_per_rank"] <= 64 * GB for r in fitting)
    assert [r["fits"] for r in rows] == sorted((r["fits"] for r in rows), reverse=True)
    assert [r["seconds_per_image"] for r in fitting] == sorted(r["seconds_per_image"] for r in fitting)
    assert {"rollout", "train", "decode_reward", "text_encode", "tp_allreduce", "ulysses_all_to_all", "pp_p2p",
            "dp_grad_sync"} == set(fitting[0]["seconds"])
    uneven = [r for r in rows if r["pp"] == 16]
    assert uneven and uneven[0]["pipeline_num_layers"] == [3] * 4 + [4] * 12


def test_a_diffusers_transformer_folder_is_planned_as_qwen_image(tmp_path, capsys):
    transformer = tmp_path / "pipeline" / "transformer"
    transformer.mkdir(parents=True)
    config = {"_class_name": q.DIFFUSERS_CLASS, **TINY.to_diffusers_config()}
    (transformer / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(tmp_path / "pipeline"), "--devices", "2", "--height", "64", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["tp"], r["pp"], r["sp"], r["dp"]) for r in rows} == {(1, 1, 1, 2), (2, 1, 1, 1), (1, 2, 1, 1),
                                                                      (1, 1, 2, 1)}


@pytest.mark.parametrize("argv, message", [
    (["--devices", "8", "--height", "1000"], "Qwen-Image needs both sides divisible by 16"),
    (["--devices", "8", "--text-tokens", "2000"], "--text-tokens 2000 is more than Qwen-Image's 1024"),
    (["--devices", "8", "--true-cfg-scale", "0.5"], "--true-cfg-scale must be >= 1, got 0.5"),
    (["--devices", "8", "--tp", "3"], "--tp 3 does not divide --devices 8"),
    (["--devices", "80", "--pp", "80"], "--pp 80 is more stages than the model's 60 blocks"),
    (["--devices", "16", "--tp", "16"], "24 heads do not split over TP x SP = 16"),
    (["--devices", "8", "--lora-rank", "-1"], "--lora-rank must be >= 0, got -1"),
    (["--devices", "8", "--device", "tpu"], None),  # argparse's own line (exit status 2)
])
def test_bad_input_is_one_line(capsys, argv, message):
    if message is None:
        with pytest.raises(SystemExit) as done:
            main(["--model", "qwen-image", *argv])
        assert done.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err
        return
    assert main(["--model", "qwen-image", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mm-grpo plan: error:") and message in err, err


def test_python_dash_m_runs_and_flux_keeps_its_planner(capsys):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "mm_grpo.tools.plan", "--model", "qwen-image-tiny", "--devices", "2",
                          "--height", "64", "--json"], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert len(rows) == 4 and all(r["fits"] for r in rows)
    assert main(["--model", "tiny", "--devices", "2", "--json"]) == 0  # FLUX's tiny preset, FLUX's planner
    assert "seconds_per_image" in json.loads(capsys.readouterr().out)[0] and "FLUX" in subprocess.run(
        [sys.executable, "-m", "mm_grpo.tools.plan", "--model", "tiny", "--devices", "1"], capture_output=True,
        text=True, timeout=300, env=env).stdout
