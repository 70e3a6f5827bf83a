from setuptools import find_packages, setup

setup(
    name="mm-grpo",
    version="0.1.0",
    description="GRPO fine-tuning of FLUX text-to-image models on Megatron / MindSpeed-MM",
    python_requires=">=3.10",
    packages=find_packages(include=["mm_grpo", "mm_grpo.*", "converters", "converters.*"]),
    install_requires=[
        "torch>=2.4",
        "diffusers>=0.32",
        "transformers>=4.45",
        "safetensors>=0.4",
        "open_clip_torch>=2.24",
        "jsonargparse>=4.35",
        "docstring-parser",  # jsonargparse: option descriptions in `mm-convert --help`
        "pydantic>=2.7",  # typed configs: model.json, data.json, config.json (mm_grpo/settings.py read_block)
        "tensorboard",
        "tqdm",
        "psutil",  # megatron-core's checkpoint writer needs it
        "einops",
        "sentencepiece",
        "matplotlib",
        "pillow",
        "accelerate",  # diffusers' low-memory loading
        "peft",  # diffusers' LoRA loading (FluxPipeline.load_lora_weights) and PEFT LoRA files
        "requests",  # remote rewards (mm_grpo/rewards/remote.py)
    ],
    extras_require={
        "test": ["pytest>=8", "coverage>=7.10"],  # coverage: python -m tests.env_split
        "serve": ["fastapi", "uvicorn"],  # the reward server (python -m mm_grpo.tools.reward_server)
        # megatron-core is an extra, so that an environment with Megatron-LM's tree on PYTHONPATH
        # (MindSpeed-MM's) does not get a second megatron. 0.12.x is MindSpeed's pin; 0.16.1 the
        # newest for Python 3.11; `import mm_grpo` checks the version of whichever is in use.
        "megatron": ["megatron-core>=0.12,<0.17"],
        # torch_npu / mindspeed are used when present and never required.
        "npu": ["torch_npu", "mindspeed"],
    },
    entry_points={"console_scripts": ["mm-convert = converters.convert_cli:main",
                                      "mm-grpo = mm_grpo.tools.plan:console"]},
)
