"""What every model family reads of model.json, below the families and the trainers: the flag that names
the file in errors, a required block, and the generated size before any family checks it (FLUX's latent
packing in training/components.py `image_size`, Wan's VAE and patch in families/wan `video_size`)."""

MODEL_FLAG = "--mm-model"  # the flag that names model.json, in errors
DEFAULT_IMAGE_SIZE = (64, 64)  # when neither the flags nor model.json's image_size name one: the tiny demo's


def block(config, name, source):
    """config[name], refused in one line naming `source` (the file or flag) when it is missing."""
    if name not in config:
        raise ValueError(f"{source} has no {name!r} block")
    return config[name]


def configured_size(model_cfg, height=None, width=None) -> tuple:
    """(height, width): the flags, else model.json's image_size, else the default; unchecked."""
    default = model_cfg.get("image_size", DEFAULT_IMAGE_SIZE)
    return height or default[0], width or default[1]
