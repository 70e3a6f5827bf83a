"""Builds what a training run needs from MindSpeed-MM style configs (model.json, data.json).

model.json:
  {"predictor": {"model_id": "flux", "from_pretrained": PATH, "pipeline_num_layers": [..]},
   "ae": {"from_pretrained": PIPELINE_DIR},
   "text_encoder": {"from_pretrained": PIPELINE_DIR, "max_sequence_length": 512,
                    "embeddings_cache": null},
   "reward": [{"name": "hps", "path": ..., "weight": 1.0}, ...],
   "image_size": [H, W]}
data.json:
  {"dataset_param": {"prompt_file": ..., "eval_prompt_file": ...},
   "dataloader_param": {"shuffle": true, "seed": 1234}}
String values may use $VARIABLES from the environment. Relative paths written in the JSON are
taken from the JSON file's folder; a path that starts with a variable ("$PIPELINE_DIR/vae") is
taken from the working directory, as the shell that set the variable would.

Every key of a block mm-grpo reads is declared here, beside its reader (the predictor's in
mm_grpo/families/flux/predictor_block.py, a reward's by its config class); `check_model_config` and
`check_data_config` refuse any other in one line naming the nearest known key, before any work.
"""
import os

from mm_grpo.configs import MODEL_FLAG, block, configured_size
from mm_grpo.data import PromptStream, read_prompts
from mm_grpo.families.flux.parts import parts as flux_parts
from mm_grpo.families.flux.predictor_block import KNOWN_KEYS as FLUX_PREDICTOR_KEYS
from mm_grpo.families.flux.transformer.latents import token_grid
from mm_grpo.grpo.schedule import GRPOSchedule
from mm_grpo.rewards.base import RewardConfig
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.settings import check_keys


# The keys of each block mm-grpo reads. `model_id` and `comment` are read by nobody: MindSpeed-MM's
# block names (the shipped configs carry them) and notes for the reader.
MODEL_KEYS = ("comment", "ae", "text_encoder", "predictor", "reward", "image_size",
              "num_frames")  # num_frames: Wan's video length (mm_grpo/families/wan/mindspeed_mm.py)
TEXT_ENCODER_KEYS = ("model_id", "from_pretrained", "max_sequence_length", "embeddings_cache")
AE_KEYS = ("model_id", "from_pretrained")
FLUX_MODEL_IDS = (None, "flux")  # predictor blocks of FLUX (mm-grpo's trainers read no model_id)
DATA_KEYS = ("comment", "dataset_param", "dataloader_param")
DATALOADER_KEYS = ("shuffle", "seed")
EVAL_KEYS = ("eval_prompt_file", "eval_samples_per_prompt", "eval_seed")  # evaluation.eval_settings
GRPO_DATASET_KEYS = ("prompt_file", *EVAL_KEYS)

PATH_KEYS = ("from_pretrained", "path")
PATH_SUFFIXES = ("_file", "_path", "_cache")


def _expand(value: str) -> str:
    expanded = os.path.expandvars(value)
    if "$" in expanded:
        raise ValueError(f"undefined environment variable in config value {value!r}")
    return expanded


def _is_path(key: str, value) -> bool:
    return isinstance(value, str) and bool(value) and (key in PATH_KEYS or key.endswith(PATH_SUFFIXES))


def _absolute(value: str, base_dir: str) -> str:
    expanded = _expand(value)
    if not expanded or os.path.isabs(expanded):  # "$EVAL_PROMPT_FILE" set to "": the option is off
        return expanded
    return os.path.normpath(os.path.join(os.getcwd() if value.startswith("$") else base_dir, expanded))


def resolve_paths(config, base_dir):
    """Expand $VARS, and make relative `*path*` / `from_pretrained` / `*_file` entries absolute."""
    if isinstance(config, dict):
        return {k: _absolute(v, base_dir) if _is_path(k, v) else resolve_paths(v, base_dir) for k, v in config.items()}
    if isinstance(config, list):
        return [resolve_paths(v, base_dir) for v in config]
    if isinstance(config, str):
        return _expand(config)
    return config


def check_model_config(model_cfg, source=MODEL_FLAG):
    """One line for a key of model.json (`source`: its file) that nothing reads: at the top level, in
    text_encoder, ae, a FLUX predictor or a reward entry (a wandit predictor is MindSpeed-MM's to read)."""
    check_keys(model_cfg, MODEL_KEYS, source)
    for name, known in (("text_encoder", TEXT_ENCODER_KEYS), ("ae", AE_KEYS)):
        if name in model_cfg:
            check_keys(model_cfg[name], known, f"{source} {name}")
    predictor = model_cfg.get("predictor")
    if isinstance(predictor, dict) and predictor.get("model_id") in FLUX_MODEL_IDS:
        check_keys(predictor, FLUX_PREDICTOR_KEYS, f"{source} predictor")
    rewards = model_cfg.get("reward", [])
    if not isinstance(rewards, list):
        raise ValueError(f"{source} reward must be a list of reward entries, got {type(rewards).__name__}")
    for i, entry in enumerate(rewards):
        named = f' "{entry["name"]}"' if isinstance(entry, dict) and "name" in entry else f"[{i}]"
        RewardConfig.from_any(entry, where=f"{source} reward{named}")


def check_data_config(data_cfg, source, dataset_keys=GRPO_DATASET_KEYS):
    """One line for a key of data.json (`source`: its file) that nothing reads: at the top level, in
    dataloader_param, or in dataset_param (`dataset_keys`: what the trainer reads there)."""
    check_keys(data_cfg, DATA_KEYS, source)
    for name, known in (("dataset_param", dataset_keys), ("dataloader_param", DATALOADER_KEYS)):
        if name in data_cfg:
            check_keys(data_cfg[name], known, f"{source} {name}")


def prompt_streams(data_config, source, seed):
    params = block(data_config, "dataset_param", source)
    loader = data_config.get("dataloader_param", {})
    if "prompt_file" not in params:
        raise ValueError(f"{source}: dataset_param needs 'prompt_file'")
    train = PromptStream(read_prompts(params["prompt_file"]), seed=loader.get("seed", seed),
                         shuffle=loader.get("shuffle", True))
    eval_prompts = read_prompts(params["eval_prompt_file"]) if params.get("eval_prompt_file") else None
    return train, eval_prompts


def check_prompts(text_block, reward, prompts):
    """Prompt-dependent errors before any work: mid-iteration each data-parallel rank conditions
    and scores only its own prompts, and an error on one would leave the others in a collective."""
    if text_block.get("embeddings_cache"):
        from mm_grpo.families.flux.text import TextEmbeddingCache
        TextEmbeddingCache(text_block["embeddings_cache"]).check(list(dict.fromkeys(prompts)))
    reward.check_prompts(prompts)


# --- one GRPO run, as every entry builds it --------------------------------------------------------
def image_size(model_cfg, height=None, width=None) -> tuple:
    """(height, width) of the generated images: the flags, else model.json's image_size, else the
    default; refused in one line if FLUX's latent layout (VAE factor x 2x2 packing) does not divide it."""
    height, width = configured_size(model_cfg, height, width)
    token_grid(height, width)
    return height, width


def grpo_reward(model_cfg, prompts, device) -> CombinedReward:
    """model.json's reward, built, with every prompt checked against it and the text encoder: cheap,
    so every entry runs it before any model is built."""
    reward = CombinedReward.from_configs(block(model_cfg, "reward", MODEL_FLAG), device=device)
    check_prompts(block(model_cfg, "text_encoder", MODEL_FLAG), reward, prompts)
    return reward


def grpo_schedule(settings, policy, model_cfg, reward, device, dtype, guidance, schedule_cls=GRPOSchedule,
                  ref_policy=None, old_policy=None, parts=flux_parts) -> GRPOSchedule:
    """The GRPO schedule of a run: `policy` (this rank's chunks), the reward `grpo_reward` built and the
    model family's `parts` (conditioner, decoder, denoiser: FLUX's, or mm_grpo/families/wan/mindspeed_mm.py's) with its
    `guidance` settings; `ref_policy` for the KL term, `old_policy` the sampler."""
    conditioner_fn, decoder_fn, denoiser = parts(model_cfg, settings, policy, device, dtype, guidance)
    return schedule_cls(settings, policy, conditioner=conditioner_fn, decoder=decoder_fn, reward=reward,
                        ref_policy=ref_policy, old_policy=old_policy, device=device, denoiser=denoiser)
