"""Shared helpers for tests: random diffusers references, inputs, errors, TP gathering."""
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from mm_grpo.families.flux.transformer import FluxConfig, layout


def rel_err(a, b):
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def assert_one_line_error(fn, match, exc=ValueError):
    """fn() raises `exc` with a message matching `match` on a single line."""
    with pytest.raises(exc, match=match) as info:
        fn()
    assert "\n" not in str(info.value)


def run_main(main, capsys, *args):
    """A command's `main(args)` -> (exit status, stdout, stderr)."""
    try:
        main(list(map(str, args)))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def clip_pil_image_processor():
    """transformers' PIL-backend CLIP image processor: CLIPImageProcessorPil in transformers 5,
    CLIPImageProcessor in 4.x (MindSpeed-MM's 4.57)."""
    try:
        from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
        return CLIPImageProcessorPil
    except ModuleNotFoundError:
        from transformers import CLIPImageProcessor
        return CLIPImageProcessor


def random_reference(config: FluxConfig, seed=0, std=0.1):
    """A diffusers FluxTransformer2DModel with every weight random (no zero-init gates)."""
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(seed)
    ref = FluxTransformer2DModel(**config.to_diffusers_config())
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, std)
    return ref.eval()


def make_inputs(config: FluxConfig, batch=2, height=4, width=6, txt_len=7, seed=1, guidance=3.5):
    """diffusers-style forward kwargs: packed latents on an height x width token grid."""
    g = torch.Generator().manual_seed(seed)
    img_ids = torch.zeros(height, width, 3)
    img_ids[..., 1] = torch.arange(height)[:, None]
    img_ids[..., 2] = torch.arange(width)[None]
    inputs = dict(
        hidden_states=torch.randn(batch, height * width, config.in_channels, generator=g),
        encoder_hidden_states=torch.randn(batch, txt_len, config.joint_attention_dim, generator=g),
        pooled_projections=torch.randn(batch, config.pooled_projection_dim, generator=g),
        timestep=torch.rand(batch, generator=g),
        img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(txt_len, 3))
    if config.guidance_embeds:
        inputs["guidance"] = torch.full((batch,), guidance)
    return inputs


def reference_output(ref, inputs):
    return ref(**inputs, return_dict=False)[0]


def hf_grads_as_megatron(ref, config: FluxConfig):
    """diffusers parameter gradients merged into full (unsharded) Megatron tensors."""
    grads = {n: p.grad for n, p in ref.named_parameters()}
    return {r.megatron: layout.merge(r, [grads[h] for h in r.hf], config)
            for r in layout.stage_rules(config)}


def _gather_whole(local, rule, config):
    """One rule's whole tensor from this rank's TP shard `local` (every TP rank gets it)."""
    group = parallel_state.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    dist.all_gather(shards, local.contiguous(), group=group)
    return layout.unshard(rule, shards, config)


def gather_tp(model, attr="grad"):
    """Full Megatron tensors (param data or grad) gathered over the TP group, by name."""
    params = dict(model.named_parameters())
    return {rule.megatron: _gather_whole(getattr(params[rule.megatron], attr), rule, model.flux_config)
            for rule in layout.stage_rules(model.flux_config, model.block_range, model.pre_process,
                                           model.post_process)}


def gather_hf_state_dict(chunks):
    """This model's weights under diffusers names, gathered over TP and PP (every rank gets all)."""
    from megatron.core import parallel_state as ps
    local = {}
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        full = gather_tp(chunk, "data")
        for rule in layout.stage_rules(chunk.flux_config, chunk.block_range, chunk.pre_process,
                                       chunk.post_process):
            for name, t in zip(rule.hf, layout.unmerge(rule, full[rule.megatron], chunk.flux_config)):
                local[name] = t.detach().clone()
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    return {k: v for part in parts for k, v in part.items()}


def random_adapters(chunk, config, seed=5, std=0.05):
    """Whole random LoRA adapters {base weight's first diffusers name: (A, B)} for every target of
    the model (any chunk: shapes come from the layout), B non-zero unlike a new adapter's."""
    from mm_grpo.families.flux.transformer import lora
    from mm_grpo.families.flux.transformer.hf_weights import expected_hf_shapes
    shapes = expected_hf_shapes(chunk.flux_config)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for base in lora.base_rules(chunk.flux_config, config.targets):
        rows = sum(shapes[h][0] for h in base.hf)
        cols = shapes[base.hf[0]][1]
        a, b = torch.randn(config.r, cols, generator=g), torch.randn(rows, config.r, generator=g)
        out[base.hf[0]] = a * std, b * std
    return out


def gather_adapters(chunk, attr="data"):
    """Whole adapter tensors (param data or grad) of a chunk gathered over TP, by rule.hf."""
    from mm_grpo.families.flux.transformer import lora
    params = dict(chunk.named_parameters())
    out = {}
    targets = {lora.target_of(n.rsplit(".lora_", 1)[0]) for n in params if ".lora_" in n}
    for rule in lora.chunk_adapter_rules(chunk, targets):
        p = params[rule.megatron]
        local = p.data if attr == "data" else (p.grad if p.grad is not None else p.main_grad)
        out[rule.hf] = _gather_whole(local.detach(), rule, chunk.flux_config)
    return out


def gather_adapter_state(chunks):
    """Whole adapter tensors of this rank's chunks gathered over TP and PP (every rank gets all), by rule.hf."""
    from megatron.core import parallel_state as ps
    local = {}
    for chunk in chunks:
        local.update(gather_adapters(getattr(chunk, "module", chunk), "data"))
    parts = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    return {k: v for part in parts for k, v in part.items()}


def count_block_forwards(blocks):
    """A list whose i-th entry counts the forward calls of blocks[i] from now on: a block recomputed in the
    backward is called twice per forward + backward. A pre-hook: the recompute may stop inside the block
    once it has what the backward needs (torch's checkpoint early stop), so a forward hook can miss it."""
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls
