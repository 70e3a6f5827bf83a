"""Builds what a training run needs from MindSpeed-MM style configs (model.json, data.json).

model.json:
  {"predictor": {"model_id": "flux" (or Qwen-Image's), "from_pretrained": PATH, "pipeline_num_layers": [..]},
   "ae": {"from_pretrained": PIPELINE_DIR},
   "text_encoder": {"from_pretrained": PIPELINE_DIR, "max_sequence_length": 512,
                    "embeddings_cache": null},
   "reward": [{"name": "hps", "path": ..., "weight": 1.0}, ...],
   "image_size": [H, W]}
data.json:
  {"dataset_param": {"prompt_file": ..., "eval_prompt_file": ...},
   "dataloader_param": {"shuffle": true, "seed": 1234}}
String values may use $VARIABLES from the environment ("comment"s are left as written). Relative paths
written in the JSON are taken from the JSON file's folder; a path that starts with a variable
("$PIPELINE_DIR/vae") is taken from the working directory, as the shell that set the variable would.

Every key of a block mm-grpo reads is declared, with the type and range of its value, as a field of
the block's schema beside its reader (mm_grpo/configs.py, each family's `MODEL_BLOCKS`, a reward's
config class, `DatasetParam` and `DataloaderParam` here); `check_model_config` and `check_data_config`
refuse a key nothing reads (naming the nearest known one) and a wrong value, each in one line naming
the file, the block and the key, before any work.
"""
import dataclasses
import os
from typing import Annotated, Literal, Optional

from pydantic import Field

from mm_grpo.configs import MODEL_FLAG, MODEL_KEYS, ModelFile, block, configured_size
from mm_grpo.data import PromptStream, read_prompts
from mm_grpo.families import Family
from mm_grpo.families.flux import predictor_block as flux_block
from mm_grpo.families.flux.family import FAMILY as FLUX
from mm_grpo.families.qwen_image import predictor_block as qwen_image_block
from mm_grpo.families.qwen_image.family import FAMILY as QWEN_IMAGE
from mm_grpo.families.wan import mindspeed_mm as wan
from mm_grpo.grpo.schedule import GRPOSchedule
from mm_grpo.rewards.base import RewardConfig
from mm_grpo.rewards.combined import CombinedReward
from mm_grpo.settings import Expanded, expand_variables, read_block
from mm_grpo.training.evaluation import HeldOutParam

# model.json's predictor model_id -> the family's blocks (no model_id: FLUX)
FAMILIES = {flux_block.MODEL_ID: flux_block.MODEL_BLOCKS, qwen_image_block.MODEL_ID: qwen_image_block.MODEL_BLOCKS,
            wan.MODEL_ID: wan.MODEL_BLOCKS}
# the families mm-grpo's own trainers build (Wan2.1 is MindSpeed-MM's model: mm_grpo.mindspeed_mm.grpo trains it)
TRAINED = {f.model_id: f for f in (FLUX, QWEN_IMAGE)}
EVAL_KEYS = tuple(f.name for f in dataclasses.fields(HeldOutParam))  # evaluation.eval_settings
GRPO_DATASET_KEYS = ("prompt_file", *EVAL_KEYS)
# torch.Generator.manual_seed takes seeds below 2^64; the prompt stream adds the epoch to this one
MAX_DATA_SEED = 2 ** 63 - 1


@dataclasses.dataclass(frozen=True)
class PredictorFamily:
    """The predictor block's model_id, which picks the family whose blocks model.json holds."""
    model_id: Literal[tuple(FAMILIES)] = flux_block.MODEL_ID


@dataclasses.dataclass(frozen=True)
class DataFile:
    """data.json's own values, beside its two blocks."""
    comment: str = ""


DATA_KEYS = (*(f.name for f in dataclasses.fields(DataFile)), "dataset_param", "dataloader_param")


@dataclasses.dataclass(frozen=True)
class DatasetParam(HeldOutParam):
    """Every key a trainer reads of data.json's dataset_param: GRPO's prompts, flow matching's image-caption
    folder (mm_grpo/training/train_flow.py), both trainers' held-out evaluation; which of them a trainer
    accepts is its `dataset_keys`."""
    prompt_file: Optional[str] = None
    data_folder: Optional[str] = None
    image_column: Optional[str] = None
    caption_column: Optional[str] = None
    cache_features: Optional[bool] = None


@dataclasses.dataclass(frozen=True)
class DataloaderParam:
    shuffle: bool = True
    seed: Optional[Annotated[int, Field(ge=0, le=MAX_DATA_SEED)]] = None  # default: the run's --seed


PATH_KEYS = ("from_pretrained", "path")
PATH_SUFFIXES = ("_file", "_path", "_cache")


def _is_path(key, value) -> bool:
    return isinstance(value, str) and bool(value) and isinstance(key, str) and (
        key in PATH_KEYS or key.endswith(PATH_SUFFIXES))


def _absolute(value: str, base_dir: str) -> str:
    if not value or os.path.isabs(value):  # "$EVAL_PROMPT_FILE" set to "": the option is off
        return value
    from_shell = isinstance(value, Expanded) and value.written.startswith("$")
    path = os.path.normpath(os.path.join(os.getcwd() if from_shell else base_dir, value))
    return Expanded(path, value.written) if isinstance(value, Expanded) else path


def _absolute_paths(config, base_dir, key=None):
    if isinstance(config, dict):
        return {k: _absolute_paths(v, base_dir, k) for k, v in config.items()}
    if isinstance(config, list):
        return [_absolute_paths(v, base_dir) for v in config]
    return _absolute(config, base_dir) if _is_path(key, config) else config


def resolve_paths(config, base_dir, source="config"):
    """Expand $VARS (`source`: the file, in the one line an unset variable gets), and make relative
    `*path*` / `from_pretrained` / `*_file` entries absolute."""
    return _absolute_paths(expand_variables(config, source), base_dir)


def check_model_config(model_cfg, source=MODEL_FLAG):
    """One line for a key of model.json (`source`: its file) that nothing reads, or a value of the wrong
    type, out of its range or not among its names: at the top level, in text_encoder, ae, the predictor
    (FLUX's, or what mm-grpo reads of a wandit one: its model_id picks the family) or a reward entry."""
    read_block(ModelFile, model_cfg, source, known=MODEL_KEYS)
    predictor = model_cfg.get("predictor", {})
    family = FAMILIES[read_block(PredictorFamily, predictor, f"{source} predictor", known=predictor).model_id]
    family.predictor(predictor, f"{source} predictor")
    for name, schema in (("text_encoder", family.text_encoder), ("ae", family.ae)):
        if name in model_cfg:
            read_block(schema, model_cfg[name], f"{source} {name}")
    rewards = model_cfg.get("reward", [])
    if not isinstance(rewards, list):
        raise ValueError(f"{source} reward must be a list of reward entries, got {type(rewards).__name__}")
    for i, entry in enumerate(rewards):
        named = f' "{entry["name"]}"' if isinstance(entry, dict) and "name" in entry else f"[{i}]"
        RewardConfig.from_any(entry, where=f"{source} reward{named}")


def check_data_config(data_cfg, source, dataset_keys=GRPO_DATASET_KEYS):
    """One line for a key of data.json (`source`: its file) that nothing reads, or a value of the wrong
    type or range: at the top level, in dataloader_param, or in dataset_param (`dataset_keys`: what the
    trainer reads there)."""
    read_block(DataFile, data_cfg, source, known=DATA_KEYS)
    if "dataset_param" in data_cfg:
        read_block(DatasetParam, data_cfg["dataset_param"], f"{source} dataset_param", known=dataset_keys)
    if "dataloader_param" in data_cfg:
        read_block(DataloaderParam, data_cfg["dataloader_param"], f"{source} dataloader_param")


def prompt_streams(data_config, source, seed):
    params = block(data_config, "dataset_param", source)
    loader = read_block(DataloaderParam, data_config.get("dataloader_param", {}), f"{source} dataloader_param")
    if "prompt_file" not in params:
        raise ValueError(f"{source}: dataset_param needs 'prompt_file'")
    train = PromptStream(read_prompts(params["prompt_file"]), seed=seed if loader.seed is None else loader.seed,
                         shuffle=loader.shuffle)
    eval_prompts = read_prompts(params["eval_prompt_file"]) if params.get("eval_prompt_file") else None
    return train, eval_prompts


def model_id(model_cfg) -> str:
    return model_cfg.get("predictor", {}).get("model_id") or flux_block.MODEL_ID


def trained_family(model_cfg) -> Family:
    """The family of model.json's predictor, as mm-grpo's own trainers build it; Wan2.1's refused in one line."""
    name = model_id(model_cfg)
    if name not in TRAINED:
        raise ValueError(f"predictor model_id {name!r} is MindSpeed-MM's model, built by its own `pretrain`: train "
                         f"it with mm_grpo.mindspeed_mm.grpo (examples/wan/grpo_wan.sh); mm-grpo's trainers build "
                         f"{', '.join(sorted(TRAINED))}")
    return TRAINED[name]


def check_prompts(text_block, reward, prompts, family: Family):
    """Prompt-dependent errors before any work: mid-iteration each data-parallel rank conditions
    and scores only its own prompts, and an error on one would leave the others in a collective."""
    family.check_text(text_block, prompts)
    reward.check_prompts(prompts)


# --- one GRPO run, as every entry builds it --------------------------------------------------------
def image_size(model_cfg, height=None, width=None) -> tuple:
    """(height, width) of the generated images: the flags, else model.json's image_size, else the
    default; refused in one line if the family's latent layout (VAE factor x 2x2 packing) does not divide
    it (Wan2.1's frames are checked by its own launch checks with FLUX's factor, which is Wan's too)."""
    height, width = configured_size(model_cfg, height, width)
    TRAINED.get(model_id(model_cfg), FLUX).token_grid(height, width)
    return height, width


def grpo_reward(model_cfg, prompts, device) -> CombinedReward:
    """model.json's reward, built, with every prompt checked against it and the text encoder: cheap,
    so every entry runs it before any model is built."""
    reward = CombinedReward.from_configs(block(model_cfg, "reward", MODEL_FLAG), device=device)
    family = TRAINED.get(model_id(model_cfg), FLUX)  # Wan2.1's text: MindSpeed-MM's encoder, no cache
    check_prompts(block(model_cfg, "text_encoder", MODEL_FLAG), reward, prompts, family)
    return reward


def grpo_schedule(settings, policy, model_cfg, reward, device, dtype, guidance, schedule_cls=GRPOSchedule,
                  ref_policy=None, old_policy=None, parts=None) -> GRPOSchedule:
    """The GRPO schedule of a run: `policy` (this rank's chunks), the reward `grpo_reward` built and the
    model family's `parts` (conditioner, decoder, denoiser; default: the trained family's of model.json,
    else mm_grpo/families/wan/mindspeed_mm.py's) with its `guidance` settings; `ref_policy` for the KL term,
    `old_policy` the sampler."""
    parts = parts or trained_family(model_cfg).parts
    conditioner_fn, decoder_fn, denoiser = parts(model_cfg, settings, policy, device, dtype, guidance)
    return schedule_cls(settings, policy, conditioner=conditioner_fn, decoder=decoder_fn, reward=reward,
                        ref_policy=ref_policy, old_policy=old_policy, device=device, denoiser=denoiser)
