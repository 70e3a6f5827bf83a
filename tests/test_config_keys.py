"""Configs that refuse what they do not know: a key of model.json / data.json that nothing reads (a
misspelt one, whose default would silently be used) ends the launch in one line naming the block, its
file, the key and the nearest known key, before any work; a negative or zero rate is refused in one
line, and a value such as -1e-4 reaches its flag (not argparse's usage). Every shipped config passes
the checks of its values too (tests/test_typed_configs.py: types, ranges and names)."""
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from mm_grpo.families.flux import predictor_block
from mm_grpo.rewards.base import RewardConfig
from mm_grpo.training import arguments, components, train_flow, train_grpo
from mm_grpo.training.entry import run_entry
from tests.ports import free_port
from tests.test_launch_env import REPO
from tests.test_run_trainer import _pythonpath

EXAMPLES = os.path.join(REPO, "examples")
DEMO_MODEL = os.path.join(EXAMPLES, "flux", "model_shapes_demo.json")  # the CPU demo's (grpo_flux.sh)
DEMO_DATA = os.path.join(EXAMPLES, "flux", "data_shapes_demo.json")
FLOW_DATA = os.path.join(EXAMPLES, "flux", "data_flow_shapes.json")
SCRIPT_TIMEOUT_S = 300  # a refusal at argument parsing: seconds, on a loaded machine


def _shipped(pattern):
    return sorted(glob.glob(os.path.join(EXAMPLES, pattern), recursive=True))


# the shipped pipelines: diffusers' own JSON files
PIPELINE_FOLDERS = tuple(os.path.join(EXAMPLES, family, "tiny_shapes") + os.sep for family in ("flux", "qwen_image"))
CONFIGS = [p for p in _shipped("**/*.json") if not p.startswith(PIPELINE_FOLDERS)]
# Which reader each shipped config is for: mm-grpo's trainers (both entries of GRPO, flow matching),
# the reward server (a list of reward entries), or MindSpeed-MM's own pretrain (its sora pretrain
# configs: mm-grpo reads their flux predictor block only, mm_grpo/mindspeed_mm/run.py).
MODEL_CONFIGS = [p for p in CONFIGS if os.path.basename(p).startswith(("model", "grpo_model"))]
GRPO_DATA_CONFIGS = [p for p in CONFIGS if os.path.basename(p).startswith(("data.json", "grpo_data", "data_shapes"))]
FLOW_DATA_CONFIGS = [p for p in CONFIGS if os.path.basename(p).startswith("data_flow")]
REWARD_LISTS = _shipped("rewards/*.json")
MINDSPEED_MM_CONFIGS = [p for p in CONFIGS if os.path.basename(p).startswith(("pretrain_model", "feature_data"))]


# What the shipped scripts export for the $VARIABLES of the shipped configs (grpo_flux.sh's CPU demo,
# pretrain_flux.sh's): the configs' values are checked once they are expanded.
SHIPPED_ENVIRONMENT = {"PIPELINE_DIR": os.path.join(EXAMPLES, "flux", "tiny_shapes"),
                       "HPS_PATH": "/models/HPS_v2.1_compressed.pt",
                       "PROMPT_FILE": os.path.join(EXAMPLES, "flux", "shapes_prompts", "grpo_objects.txt"),
                       "EVAL_PROMPT_FILE": os.path.join(EXAMPLES, "flux", "shapes_prompts", "eval_objects_report.txt"),
                       "EVAL_SAMPLES": "64", "EVAL_SEED": "1", "DATA_DIR": "data"}


@pytest.fixture(autouse=True)
def shipped_environment(monkeypatch):
    for name, value in SHIPPED_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)


def _load(path):
    with open(path) as f:
        return json.load(f)


def _variables(config) -> set:
    """The $VARIABLES a config's values use (its comment's are never expanded)."""
    values = {k: v for k, v in config.items() if k != "comment"} if isinstance(config, dict) else config
    return set(re.findall(r"\$\{?(\w+)", json.dumps(values)))


def test_every_variable_of_the_shipped_configs_is_set_here():
    """Else the checks below would stop at the unset variable instead of reading the values."""
    used = set().union(*(_variables(_load(path)) for path in CONFIGS))
    assert used and used <= set(SHIPPED_ENVIRONMENT), used - set(SHIPPED_ENVIRONMENT)


def test_every_shipped_config_has_a_reader():
    classified = MODEL_CONFIGS + GRPO_DATA_CONFIGS + FLOW_DATA_CONFIGS + REWARD_LISTS + MINDSPEED_MM_CONFIGS
    assert sorted(classified) == CONFIGS
    assert len(MODEL_CONFIGS) >= 9 and len(GRPO_DATA_CONFIGS) >= 5 and len(FLOW_DATA_CONFIGS) == 3


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: os.path.relpath(p, EXAMPLES))
def test_every_shipped_model_json_passes_the_checks(path):
    components.check_model_config(_load(path), path)


@pytest.mark.parametrize("path, keys", [(p, components.GRPO_DATASET_KEYS) for p in GRPO_DATA_CONFIGS]
                         + [(p, train_flow.FLOW_DATASET_KEYS) for p in FLOW_DATA_CONFIGS],
                         ids=lambda x: os.path.relpath(x, EXAMPLES) if isinstance(x, str) else "")
def test_every_shipped_data_json_passes_the_checks(path, keys):
    components.check_data_config(_load(path), path, keys)


@pytest.mark.parametrize("path", REWARD_LISTS + MINDSPEED_MM_CONFIGS, ids=lambda p: os.path.relpath(p, EXAMPLES))
def test_shipped_reward_lists_and_flux_blocks_pass_the_checks(path):
    config = _load(path)
    if isinstance(config, list):  # the reward server's --rewards
        for entry in config:
            RewardConfig.from_any(entry, where=path)
    elif config.get("predictor", {}).get("model_id") == predictor_block.MODEL_ID:
        predictor_block.check_block(config["predictor"], f"{path} predictor")


# --- the attacks, through the trainer's entry --------------------------------------------------------
def _refused_line(capsys, argv) -> str:
    """The trainer's entry run on `argv`: it exits 2 with one line on stderr, returned."""
    with pytest.raises(SystemExit) as exit_:
        run_entry(lambda: train_grpo.main(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("mm-grpo: ")]
    assert len(lines) == 1, err
    return lines[0]


def _demo_with(tmp_path, edit) -> str:
    """The CPU demo's model.json copied to tmp_path with `edit` applied to it; returns its path."""
    config = _load(DEMO_MODEL)
    edit(config)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(config, indent=2))
    return str(path)


def _rename(block_of, old, new):
    def edit(config):
        block = block_of(config)
        block[new] = block.pop(old)
    return edit


@pytest.mark.parametrize("where, edit, key, nearest", [
    ("text_encoder", _rename(lambda c: c["text_encoder"], "max_sequence_length", "max_sequence_lenght"),
     "max_sequence_lenght", "max_sequence_length"),
    ("", _rename(lambda c: c, "image_size", "image_sizes"), "image_sizes", "image_size"),
    ("ae", _rename(lambda c: c["ae"], "from_pretrained", "from_pretained"), "from_pretained", "from_pretrained"),
    ("predictor", lambda c: c["predictor"].update(num_single_layer=2), "num_single_layer", "num_single_layers"),
    ('reward "compositional_f1"', _rename(lambda c: c["reward"][1], "weight", "wieght"), "wieght", "weight"),
], ids=["text_encoder", "image_size", "ae", "predictor", "reward"])
def test_a_misspelt_model_json_key_stops_the_demo_before_any_work(tmp_path, capsys, where, edit, key, nearest):
    """`"max_sequence_lenght": 16` in the CPU demo's text_encoder used to train to exit 0 with reward 0, a
    misspelt image_size fell back to 64 x 64: each misspelling is now one line, and --save stays unwritten."""
    model = _demo_with(tmp_path, edit)
    save = tmp_path / "ckpt"
    line = _refused_line(capsys, ["--mm-model", model, "--mm-data", DEMO_DATA, "--train-iters", "1",
                                  "--save", str(save)])
    block = f"{model} {where}" if where else model
    assert line == f'mm-grpo: error: {block}: unknown key "{key}" (did you mean "{nearest}"?)'
    assert not save.exists()


@pytest.mark.parametrize("where, content, key, hint", [
    ("", {"dataset_params": {}}, "dataset_params", '(did you mean "dataset_param"?)'),
    (" dataset_param", {"dataset_param": {"prompt_file": "p.txt", "eval_prompts_file": "e.txt"}},
     "eval_prompts_file", '(did you mean "eval_prompt_file"?)'),
    (" dataloader_param", {"dataset_param": {"prompt_file": "p.txt"}, "dataloader_param": {"shufle": False}},
     "shufle", '(did you mean "shuffle"?)'),
    # a flow-matching key in a GRPO run's data.json: GRPO reads prompts, not an image folder
    (" dataset_param", {"dataset_param": {"prompt_file": "p.txt", "data_folder": "images"}}, "data_folder",
     "(known: prompt_file, eval_prompt_file, eval_samples_per_prompt, eval_seed)"),
], ids=["top", "dataset_param", "dataloader_param", "flow_key_in_grpo"])
def test_a_data_json_key_nothing_reads_is_one_line(tmp_path, capsys, where, content, key, hint):
    data = tmp_path / "data.json"
    data.write_text(json.dumps(content))
    line = _refused_line(capsys, ["--mm-model", DEMO_MODEL, "--mm-data", str(data), "--train-iters", "1"])
    assert line == f'mm-grpo: error: {data}{where}: unknown key "{key}" {hint}'


def test_the_flow_trainer_refuses_a_grpo_key_in_its_data_json(tmp_path):
    config = _load(FLOW_DATA)
    config["dataset_param"]["prompt_file"] = "prompts.txt"  # GRPO's: flow matching reads image-caption pairs
    data = tmp_path / "data.json"
    data.write_text(json.dumps(config))
    with pytest.raises(ValueError) as refused:
        train_flow.parse_args(["--mm-model", DEMO_MODEL, "--mm-data", str(data), "--train-iters", "1"])
    assert str(refused.value).startswith(f'{data} dataset_param: unknown key "prompt_file" (')


# --- rates ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value, line", [
    ("--lr", "-1e-4", "--lr must be > 0, got -0.0001"),
    ("--lr", "0", "--lr must be > 0, got 0.0"),
    ("--lr", "nan", "--lr must be > 0, got nan"),
    ("--min-lr", "-1e-6", "--min-lr must be >= 0, got -1e-06"),
    ("--weight-decay", "-1e-4", "--weight-decay must be >= 0, got -0.0001"),
    ("--adam-beta2", "1", "--adam-beta2 must be < 1, got 1.0"),
    ("--adam-eps", "0", "--adam-eps must be > 0, got 0.0"),
    ("--clip-grad", "-1", "--clip-grad must be >= 0, got -1.0"),
    ("--lr-warmup-iters", "-5", "--lr-warmup-iters must be >= 0, got -5"),
    ("--ema-decay", "-0.5", "--ema-decay must be >= 0, got -0.5"),
    ("--ema-decay", "1", "--ema-decay must be < 1, got 1.0"),
    ("--ema-decay-ramp", "-1e-2", "--ema-decay-ramp must be > 0, got -0.01"),
])
def test_a_rate_out_of_its_range_is_one_line_before_any_file_is_read(flag, value, line):
    with pytest.raises(ValueError) as refused:
        arguments.parse_args(["--train-iters", "1", "--mm-model", "/missing", "--mm-data", "/missing", flag, value])
    assert str(refused.value) == line


def test_the_floors_themselves_are_accepted():
    args = arguments.parse_args(["--train-iters", "1", "--mm-model", DEMO_MODEL, "--mm-data", DEMO_DATA,
                                 "--min-lr", "0", "--ema-decay", "0", "--weight-decay", "0", "--lr", "1e-4"])
    assert (args.min_lr, args.ema_decay, args.weight_decay, args.lr) == (0.0, 0.0, 0.0, 1e-4)


def test_a_negative_lr_from_the_shipped_script_is_refused_in_one_line(tmp_path):
    """`LR=-1e-4 bash examples/flux/grpo_flux.sh` printed argparse's 52-line usage for --lr (-1e-4 read as
    an option): the value now reaches --lr, which refuses it in one line, before --save is made."""
    run_dir = tmp_path / "run"
    inherited = {k: v for k, v in os.environ.items() if k not in SHIPPED_ENVIRONMENT}  # the script sets them
    env = dict(inherited, PYTHONPATH=_pythonpath(), MM_GRPO_PYTHON=sys.executable, MM_GRPO_DEVICE="cpu",
               MM_GRPO_ASCEND=str(tmp_path / "no_ascend"), RUN_DIR=str(run_dir), NPUS_PER_NODE="1", ITERS="1",
               LR="-1e-4", MASTER_PORT=str(free_port()), PYTHONWARNINGS="ignore")
    proc = subprocess.run(["bash", "examples/flux/grpo_flux.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == "mm-grpo: error: --lr must be > 0, got -0.0001"
    assert "usage:" not in proc.stdout + proc.stderr
    assert not (run_dir / "ckpt").exists()


# --- MindSpeed-MM's entry: Megatron's parser and the same key check ------------------------------------
@pytest.fixture(scope="module")
def mindspeed_configs(tiny_pipeline_dir, tmp_path_factory):
    from tests.test_mindspeed_grpo import write_mindspeed_configs
    from tests.testbed import require_testbed
    require_testbed(needs_megatron_training=True)
    return write_mindspeed_configs(str(tmp_path_factory.mktemp("mindspeed_keys")), tiny_pipeline_dir)


@pytest.mark.mindspeed_mm
def test_mindspeed_mm_entry_refuses_a_negative_lr_and_a_misspelt_key(mindspeed_configs, tmp_path):
    from mm_grpo.mindspeed_mm import grpo as mindspeed_grpo
    from tests.test_mindspeed_grpo import entry_argv
    with pytest.raises(mindspeed_grpo.LaunchRefused) as refused:
        mindspeed_grpo.check_launch(entry_argv(mindspeed_configs, "--lr", "-1e-4"))
    assert str(refused.value) == "--lr must be > 0, got -0.0001"
    model = tmp_path / "model.json"
    shutil.copy(mindspeed_configs[1], model)
    config = _load(model)
    config["text_encoder"]["max_sequence_lenght"] = config["text_encoder"].pop("max_sequence_length")
    model.write_text(json.dumps(config))
    with pytest.raises(mindspeed_grpo.LaunchRefused) as refused:
        mindspeed_grpo.check_launch(entry_argv(mindspeed_configs, "--mm-model", str(model)))
    assert str(refused.value) == (f'{model} text_encoder: unknown key "max_sequence_lenght" '
                                  '(did you mean "max_sequence_length"?)')
