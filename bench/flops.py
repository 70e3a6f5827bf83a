"""Analytic FLOPs of the FLUX transformer and of one GRPO iteration.

Counts the multiply-adds of matrix products (2 FLOPs each) and of attention, as MFU
conventions do; element-wise work (norms, RoPE, activations, the sampler) is left out.
adaLN and the time/text embedders act on one vector per sample, not per token.
Backward costs twice the forward for every product whose input needs a gradient, and
once (the weight gradient only) for the products that read the model inputs: the x /
context embedders and the first layers of the timestep, guidance and pooled-text MLPs.
Activation recomputation is not counted (it is overhead, not model work).
LoRA (`lora_rank`, rank r on the attention and MLP linears of every block, the recommended
targets) adds the adapters' products; on a frozen base (`lora_backward`) no weight gradient is
taken, and nothing before the first block's input projection needs a gradient at all.
`tests/test_flops.py` checks these counts against torch's FlopCounterMode.
"""
import dataclasses

from mm_grpo.families.flux.transformer.config import FluxConfig
from mm_grpo.families.flux.transformer.embeddings import TIME_CHANNELS


@dataclasses.dataclass(frozen=True)
class FluxFlops:
    """FLOPs of one sample's forward, by part, and of its backward."""

    tokens: int  # linears applied to every token (embedders, block projections, output)
    vectors: int  # linears applied to one vector per sample (time/text embedders, adaLN)
    attention: int  # q k^T and softmax(.) v
    input_side: int  # the part of `tokens + vectors` whose inputs need no gradient
    embed_in: int = 0  # the x / context embedders (in `tokens` and `input_side`)
    first_projection: int = 0  # the first block's input projection(s): qkv, or a single block's linear_in
    lora: int = 0  # LoRA adapters' products (A then B on every target linear)
    first_lora_a: int = 0  # the first block's input projections' A products

    @property
    def forward(self) -> int:
        return self.tokens + self.vectors + self.attention + self.lora

    @property
    def backward(self) -> int:
        """Full fine-tuning: weight and input gradients of every product."""
        if self.lora:
            raise ValueError("a LoRA count's backward is lora_backward (the base is frozen)")
        return 2 * self.forward - self.input_side

    @property
    def lora_backward(self) -> int:
        """LoRA on a frozen base: the token linears' input gradients from the first block's output
        projection on (its input projections read activations that need no gradient, as do the
        embedders and every per-sample vector), attention's two products twice, and the adapters'
        weight and input gradients (but the first A's input gradient)."""
        return (self.tokens - self.embed_in - self.first_projection + 2 * self.attention
                + 2 * self.lora - self.first_lora_a)


def flux_flops(config: FluxConfig, n_txt: int, n_img: int, lora_rank: int = 0) -> FluxFlops:
    """FLOPs of FLUX on one sample of `n_txt` text and `n_img` image tokens (with LoRA adapters of
    rank `lora_rank` on the attention and MLP linears of every block)."""
    d, f, s = config.hidden_size, config.mlp_hidden_size, n_txt + n_img
    mm = lambda rows, fan_in, fan_out: 2 * rows * fan_in * fan_out  # noqa: E731
    # An adapter on a fan_in -> fan_out linear: fan_in -> r, then r -> fan_out.
    adapter = lambda fan_in, fan_out: mm(s, fan_in, lora_rank) + mm(s, lora_rank, fan_out)  # noqa: E731
    # Per block, one stream's tokens: double = qkv + out proj + MLP; single = [qkv | mlp] in + out.
    double_tok = s * (mm(1, d, 3 * d) + mm(1, d, d) + mm(1, d, f) + mm(1, f, d))
    single_tok = s * (mm(1, d, 3 * d + f) + mm(1, d + f, d))
    embed_in = mm(n_img, config.in_channels, d) + mm(n_txt, config.joint_attention_dim, d)
    tokens = (config.num_layers * double_tok + config.num_single_layers * single_tok
              + embed_in + mm(n_img, d, config.output_channels))
    mlp_first = mm(1, TIME_CHANNELS, d) * (2 if config.guidance_embeds else 1) + mm(1, config.pooled_projection_dim, d)
    embedders = mlp_first + mm(1, d, d) * (3 if config.guidance_embeds else 2)
    adaln = config.num_layers * 2 * mm(1, d, 6 * d) + config.num_single_layers * mm(1, d, 3 * d) + mm(1, d, 2 * d)
    attention = config.num_blocks * 2 * mm(s, s, d)  # per head: s x s x head_dim twice
    lora = (config.num_layers * (adapter(d, 3 * d) + adapter(d, d) + adapter(d, f) + adapter(f, d))
            + config.num_single_layers * (adapter(d, 3 * d + f) + adapter(d + f, d)))
    first_projection = s * mm(1, d, 3 * d if config.num_layers else 3 * d + f)
    return FluxFlops(tokens, embedders + adaln, attention, embed_in + mlp_first, embed_in, first_projection,
                     lora, mm(s, d, lora_rank) if lora_rank else 0)


@dataclasses.dataclass(frozen=True)
class IterationFlops:
    rollout: int
    train: int
    decode: int

    @property
    def total(self) -> int:
        return self.rollout + self.train + self.decode


def grpo_iteration_flops(config: FluxConfig, n_txt: int, n_img: int, batch: int, num_steps: int,
                         trained_steps: int, decode_flops_per_image: int = 0, lora_rank: int = 0) -> IterationFlops:
    """One GRPO iteration: `batch` rollouts of `num_steps` forwards, forward + backward of
    `trained_steps` transitions per sample, and one VAE decode per sample (LoRA of rank
    `lora_rank` on a frozen base when it is not 0)."""
    one = flux_flops(config, n_txt, n_img, lora_rank)
    return IterationFlops(
        rollout=batch * num_steps * one.forward,
        train=batch * trained_steps * (one.forward + (one.lora_backward if lora_rank else one.backward)),
        decode=batch * decode_flops_per_image)


def counted_flops(fn, *args, **kwargs) -> int:
    """FLOPs torch's FlopCounterMode sees while `fn` runs, with attention in its math form
    (the fused CPU attention kernel has no FLOP formula registered)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        fn(*args, **kwargs)
    return counter.get_total_flops()
