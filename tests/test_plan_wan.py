"""`mm-grpo plan --model wan2.1-...`: Wan2.1 text-to-video's parameters and FLOPs against diffusers'
model, its VAE constants against a measured decode, the layouts it refuses, memory against CP and
PP, and the command line."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from mm_grpo.families.flux import plan as f
from mm_grpo.families.wan import plan as wan
from mm_grpo.plan.devices import device
from mm_grpo.plan.formulas import GRPOJob, Layout
from mm_grpo.tools.plan import main
from tests.fixtures import peft_without_mindspeed_te_dummies  # noqa: F401

GB = 10 ** 9
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _diffusers_model(config: wan.WanConfig):
    from diffusers import WanTransformer3DModel
    return WanTransformer3DModel(
        patch_size=config.patch_size, num_attention_heads=config.num_heads, attention_head_dim=config.head_dim,
        in_channels=config.in_channels, out_channels=config.out_channels, text_dim=config.text_dim,
        freq_dim=config.freq_dim, ffn_dim=config.ffn_dim, num_layers=config.num_layers,
        cross_attn_norm=config.cross_attn_norm, qk_norm="rms_norm_across_heads" if config.qk_norm else None,
        eps=1e-6)


@pytest.mark.parametrize("name", sorted(wan.PRESETS))
def test_parameter_count_matches_diffusers_model(name, peft_without_mindspeed_te_dummies):
    """The hand count equals diffusers' WanTransformer3DModel built on the meta device at the preset's
    config; and the LoRA count equals peft's adapters on MindSpeed-MM's targets (proj_q/k/v/out of
    both attentions, ffn.0, ffn.2 = diffusers' to_q/k/v, to_out.0, ffn.net.0.proj, ffn.net.2)."""
    config = wan.PRESETS[name]
    with torch.device("meta"):
        model = _diffusers_model(config)
    assert wan.total_params(config) == sum(p.numel() for p in model.parameters())
    peft = pytest.importorskip("peft")
    with torch.device("meta"):
        peft.inject_adapter_in_model(peft.LoraConfig(r=64, target_modules=[
            "to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]), model)
    adapters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert config.num_layers * wan.block_params(config, 64)[1] == adapters


def test_published_sizes():
    assert wan.total_params(wan.PRESETS["wan2.1-14b"]) == 14_288_491_584
    assert wan.total_params(wan.PRESETS["wan2.1-1.3b"]) == 1_418_996_800
    job = wan.VideoJob()  # 480 x 832, 81 frames
    assert wan.latent_grid(job.frames, job.height, job.width) == (21, 60, 104)
    assert wan.video_tokens(wan.PRESETS["wan2.1-14b"], job) == 32_760


def test_video_job_adds_only_the_video_to_the_shared_grpo_job():
    """VideoJob is formulas.GRPOJob plus the video's own fields; N and the parameter dtype keep GRPOJob's
    flag and minimum with DanceGRPO's Wan recipe's defaults (FLUX's Job keeps GRPOJob's)."""
    from mm_grpo.settings import check_bounds
    shared = {x.name for x in dataclasses.fields(GRPOJob)}
    assert {x.name for x in dataclasses.fields(wan.VideoJob)} - shared == {"frames", "height", "width", "cfg"}
    assert {x.name for x in dataclasses.fields(f.Job)} - shared == {"height", "width", "bf16", "compile_blocks"}
    video, image = wan.VideoJob(), f.Job()
    assert (video.num_inference_steps, video.param_dtype, video.trained_steps) == (20, "bf16", 11)
    assert (image.num_inference_steps, image.param_dtype, image.trained_steps) == (16, "fp32", 9)
    with pytest.raises(ValueError, match="--num-inference-steps must be >= 2, got 1"):
        check_bounds(wan.VideoJob(num_inference_steps=1), wan.VideoJob)


@pytest.mark.parametrize("split", [[10, 10, 10, 10], [13, 13, 14], [7, 8, 8, 7], [40]])
def test_stages_add_up_to_the_model(split):
    config = wan.PRESETS["wan2.1-14b"]
    if sum(split) != config.num_layers:
        config = wan.PRESETS["wan2.1-1.3b"]
    total = sum(wan.stage_params(config, split, s)[0] for s in range(len(split)))
    assert total == wan.total_params(config)


def test_forward_flops_match_torch_flop_counter_on_diffusers_model():
    """forward_flops (counted by hand) equals torch's FLOP counter on a small diffusers Wan (the
    attention through the math kernel, so that its matrix products are counted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    config = wan.WanConfig(hidden_size=64, ffn_dim=96, num_heads=2, num_layers=2, text_dim=48, freq_dim=32)
    job = wan.VideoJob(frames=9, height=64, width=96, text_tokens=20)  # latent 3 x 8 x 12: 72 tokens
    torch.manual_seed(0)
    model = _diffusers_model(config).eval()
    t, h, w = wan.latent_grid(job.frames, job.height, job.width)
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH), torch.no_grad():
        model(torch.randn(1, config.in_channels, t, h, w), torch.tensor([500]), torch.randn(1, 20, config.text_dim))
    assert wan.forward_flops(config, job) == counter.get_total_flops()


def test_attention_dominates_at_480p_81_frames():
    config, job = wan.PRESETS["wan2.1-14b"], wan.VideoJob()
    assert wan.attention_fraction(config, job) > 0.5
    assert wan.forward_flops(config, job) / 1e15 == pytest.approx(1.678, abs=0.001)


def test_vae_decode_constants_against_a_measured_decode():
    """The planner's Wan VAE constants against diffusers' AutoencoderKLWan (random weights, fp32, CPU)
    decoding 3 latent frames at 64 px (9 frames): the live set's peak (the live-tensor meter) and the
    convolution FLOPs (torch's counter)."""
    from diffusers import AutoencoderKLWan
    from torch.utils.flop_counter import FlopCounterMode

    from bench.plan_validate import LiveTensorMeter
    torch.manual_seed(0)
    vae = AutoencoderKLWan().eval().requires_grad_(False)
    assert sum(p.numel() for p in vae.parameters()) == wan.WAN_VAE_PARAMS
    job = wan.VideoJob(frames=9, height=64, width=64)
    meter = LiveTensorMeter()
    with FlopCounterMode(display=False) as counter, meter, torch.no_grad():
        vae.decode(torch.randn(1, 16, 3, 8, 8), return_dict=False)
    predicted_values = wan.vae_decode_bytes(wan.PRESETS["wan2.1-14b"], job) / 2  # values (bf16 bytes / 2)
    assert meter.peak / 4 == pytest.approx(predicted_values, rel=0.05)
    conv = counter.get_total_flops()
    t, h, w = wan.latent_grid(job.frames, job.height, job.width)
    middle = t * 4 * (h * w) ** 2 * wan.WAN_VAE_MIDDLE_CHANNELS  # not seen by the counter on CPU
    assert wan.vae_decode_flops(job) - middle == pytest.approx(conv, rel=0.01)


def _job(**kw):
    return wan.VideoJob(prompts_per_iteration=1, **kw)


@pytest.mark.parametrize("lora_rank", [0, 64])
def test_memory_falls_as_cp_grows(lora_rank):
    config, comps = wan.PRESETS["wan2.1-14b"], wan.components()
    peaks = [wan.rank_memory(config, comps, _job(lora_rank=lora_rank), Layout(pp=4, sp=cp)).peak_bytes
             for cp in (1, 2, 4, 5, 8, 10, 20, 40)]
    assert all(a > b for a, b in zip(peaks, peaks[1:])), peaks


@pytest.mark.parametrize("lora_rank", [0, 64])
def test_memory_falls_as_pp_grows(lora_rank):
    config, comps = wan.PRESETS["wan2.1-14b"], wan.components()
    peaks = [wan.rank_memory(config, comps, _job(lora_rank=lora_rank), Layout(pp=pp, sp=8)).peak_bytes
             for pp in (1, 2, 4, 5, 8, 10, 20, 40)]
    assert all(a >= b for a, b in zip(peaks, peaks[1:])), peaks
    held = [sum(wan.rank_memory(config, comps, _job(lora_rank=lora_rank), Layout(pp=pp, sp=8)).stages[0].terms[k]
                for k in ("weights", "main_grads", "optimizer")) for pp in (1, 2, 4, 5, 8, 10, 20, 40)]
    assert all(a > b for a, b in zip(held, held[1:])), held


def test_full_fine_tuning_terms_are_megatron_bf16():
    """bf16 weights, fp32 main gradients, fp32 master weights + Adam (12 bytes) over DP x CP."""
    config, comps = wan.PRESETS["wan2.1-14b"], wan.components()
    layout = Layout(pp=4, sp=4, dp=2)
    terms = wan.rank_memory(config, comps, _job(num_generations=12), layout).stages[1].terms
    params = 10 * wan.block_params(config)[0]
    assert terms["weights"] == 2 * params and terms["main_grads"] == 4 * params
    assert terms["optimizer"] == pytest.approx(12 * params / 8)
    lora = wan.rank_memory(config, comps, _job(lora_rank=64), layout).stages[1].terms
    adapters = 10 * wan.block_params(config, 64)[1]
    assert lora["main_grads"] == 4 * adapters and lora["weights"] == 2 * (params + adapters)


def test_recompute_and_lora_keep_fewer_activations():
    config, comps, layout = wan.PRESETS["wan2.1-14b"], wan.components(), Layout(sp=8)
    act = {(r, rc): wan.rank_memory(config, comps, _job(lora_rank=r, recompute=rc), layout).worst.terms["activations"]
           for r in (0, 64) for rc in (True, False)}
    assert act[0, True] * 10 < act[0, False] and act[64, False] < act[0, False]
    full, lora = wan.block_activation_values(config), wan.block_activation_values(config, 64)
    assert full[0] / config.hidden_size == pytest.approx(29.1, abs=0.05) and lora[0] < full[0]


def test_cfg_doubles_the_work():
    config, comps, layout = wan.PRESETS["wan2.1-14b"], wan.components(), Layout(pp=4, sp=4)
    npu = device("atlas-800t-a2")
    on, off = (wan.iteration_time(config, comps, _job(cfg=c), layout, npu) for c in (True, False))
    assert on.parts["rollout"] == pytest.approx(2 * off.parts["rollout"])
    assert on.parts["train"] == pytest.approx(2 * off.parts["train"])


def test_layouts_only_divide():
    config, job = wan.PRESETS["wan2.1-14b"], _job()
    lays = wan.layouts(config, job, 64)
    assert lays and all(lay.tp == 1 and lay.world == 64 for lay in lays)
    assert all(40 % lay.sp == 0 and 32_760 % lay.sp == 0 and 40 % lay.pp == 0 for lay in lays)
    assert wan.check_layout(config, job, Layout(tp=2)) == wan.TP_REASON
    assert "do not split over CP 3" in wan.check_layout(config, job, Layout(sp=3))
    wide = dataclasses.replace(job, width=848)  # 21 x 30 x 53 = 33,390 tokens
    assert "33390 video tokens do not split over CP 4" in wan.check_layout(config, wide, Layout(sp=4))
    assert "does not divide the 40 blocks" in wan.check_layout(config, job, Layout(pp=3))
    assert wan.check_layout(config, job, Layout(pp=3), pipeline_num_layers=[13, 13, 14]) is None


@pytest.mark.parametrize("argv, message", [
    (["--devices", "8", "--tp", "2"], "--tp 2: Wan2.1 runs with TP 1: MindSpeed-MM's wandit does not shard "
                                       "under tensor parallelism"),
    (["--devices", "24", "--cp", "3"], "--cp 3: 40 heads do not split over CP 3"),
    (["--devices", "8", "--cp", "4", "--width", "848"], "--cp 4: 33390 video tokens do not split over CP 4"),
    (["--devices", "24", "--pp", "3"], "--pp 3 does not divide the model's 40 blocks"),
    (["--devices", "8", "--micro-batch-size", "2"], "--micro-batch-size 2: MindSpeed-MM's wandit computes one sample per micro-batch"),
    (["--devices", "8", "--frames", "80"], "--frames 80 must be 4k + 1"),
    (["--devices", "8", "--pipeline-num-layers", "10", "10"], "must be positive and sum to the model's 40 blocks"),
])
def test_refusals_are_one_line(capsys, argv, message):
    assert main(["plan", "--model", "wan2.1-14b", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("mm-grpo plan: error:") and message in err, err


def test_layout_table_lists_every_layout(capsys):
    assert main(["--model", "wan2.1-14b", "--devices", "16", "--device-memory", "64"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:]]
    assert len(rows) == len(wan.layouts(wan.PRESETS["wan2.1-14b"], _job(), 16))
    assert all(row[5] in ("yes", "no") for row in rows)


def test_summary_over_device_counts_runs_as_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "mm_grpo.tools.plan", "--model", "wan2.1-14b", "--devices", "8", "16", "32",
                          "64", "--lora-rank", "0", "64", "--device-memory", "64", "--json"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])))
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["devices"], r["lora_rank"]) for r in rows] == [(n, r) for n in (8, 16, 32, 64) for r in (0, 64)]
    for r in rows:
        for lay in r["recommended"]:
            assert lay["fits"] and lay["peak_bytes_per_rank"] <= 64 * GB and lay["tp"] == 1
            assert lay["cp"] * lay["pp"] * lay["dp"] == r["devices"]
        if not r["recommended"]:
            assert r["least_memory"]["peak_bytes_per_rank"] > 64 * GB
    lora = {r["devices"]: r for r in rows if r["lora_rank"]}
    assert all(lora[n]["recommended"] for n in (8, 16, 32, 64))


def test_flux_is_unchanged_by_the_wan_dispatch(capsys):
    assert main(["--model", "tiny", "--devices", "2", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 4
