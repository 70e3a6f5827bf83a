"""Analytic FLOPs of the FLUX transformer and of one GRPO iteration.

Counts the multiply-adds of matrix products (2 FLOPs each) and of attention, as MFU
conventions do; element-wise work (norms, RoPE, activations, the sampler) is left out.
adaLN and the time/text embedders act on one vector per sample, not per token.
Backward costs twice the forward for every product whose input needs a gradient, and
once (the weight gradient only) for the products that read the model inputs: the x /
context embedders and the first layers of the timestep, guidance and pooled-text MLPs.
Activation recomputation is not counted (it is overhead, not model work).
`tests/test_flops.py` checks these counts against torch's FlopCounterMode.
"""
import dataclasses

from mm_grpo.models.flux.config import FluxConfig
from mm_grpo.models.flux.embeddings import TIME_CHANNELS


@dataclasses.dataclass(frozen=True)
class FluxFlops:
    """FLOPs of one sample's forward, by part, and of its backward."""

    tokens: int  # linears applied to every token (embedders, block projections, output)
    vectors: int  # linears applied to one vector per sample (time/text embedders, adaLN)
    attention: int  # q k^T and softmax(.) v
    input_side: int  # the part of `tokens + vectors` whose inputs need no gradient

    @property
    def forward(self) -> int:
        return self.tokens + self.vectors + self.attention

    @property
    def backward(self) -> int:
        return 2 * self.forward - self.input_side


def flux_flops(config: FluxConfig, n_txt: int, n_img: int) -> FluxFlops:
    """FLOPs of FLUX on one sample of `n_txt` text and `n_img` image tokens."""
    d, f, s = config.hidden_size, config.mlp_hidden_size, n_txt + n_img
    mm = lambda rows, fan_in, fan_out: 2 * rows * fan_in * fan_out  # noqa: E731
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
    return FluxFlops(tokens, embedders + adaln, attention, embed_in + mlp_first)


@dataclasses.dataclass(frozen=True)
class IterationFlops:
    rollout: int
    train: int
    decode: int

    @property
    def total(self) -> int:
        return self.rollout + self.train + self.decode


def grpo_iteration_flops(config: FluxConfig, n_txt: int, n_img: int, batch: int, num_steps: int,
                         trained_steps: int, decode_flops_per_image: int = 0) -> IterationFlops:
    """One GRPO iteration: `batch` rollouts of `num_steps` forwards, forward + backward of
    `trained_steps` transitions per sample, and one VAE decode per sample."""
    one = flux_flops(config, n_txt, n_img)
    return IterationFlops(
        rollout=batch * num_steps * one.forward,
        train=batch * trained_steps * (one.forward + one.backward),
        decode=batch * decode_flops_per_image)


def counted_flops(fn, *args, **kwargs) -> int:
    """FLOPs torch's FlopCounterMode sees while `fn` runs, with attention in its math form
    (the fused CPU attention kernel has no FLOP formula registered)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        fn(*args, **kwargs)
    return counter.get_total_flops()
