"""Write MindSpeed-MM's feature files for FLUX from an image-caption folder, with a FLUX pipeline's
VAE and text encoders, or for Wan2.1 (`--family wan`) from a video-caption folder, with a Wan
pipeline's VAE and umT5: what MindSpeed-MM's `pretrain_sora.py` reads with `"dataset_type": "feature"`
(examples/flux/mindspeed_mm/pretrain_flux.sh, examples/wan/pretrain_wan.sh).

    python -m mm_grpo.tools.write_features --pipeline /models/FLUX.1-dev --data DATA_DIR \
        --out $MINDSPEED_MM/flux_features [--resolution 1024] [--max-sequence-length 512] [--device npu]
    python -m mm_grpo.tools.write_features --family wan --pipeline WAN_PIPELINE --data VIDEO_DIR \
        --out FEATURES [--max-sequence-length 512]

DATA_DIR is an image-caption folder (`metadata.jsonl` with `file_name` and `text` per line, and the
images: mm_grpo/data/image_captions.py). OUT gets the layout of MindSpeed-MM's own feature extractor
(mindspeed_mm/tools/feature_extraction/get_sora_feature.py), read by its FeatureDataset:

    OUT/data.jsonl                 one line per image: its metadata row, with "file": "features/<name>.pt"
    OUT/features/<name>.pt         {"video": latents [16, H/8, W/8] (the VAE's posterior mode, shifted and scaled),
                                    "prompt_ids": [T5 hidden states [L, 4096], pooled CLIP [768]],
                                    "prompt_mask": [T5 attention mask [L], CLIP attention mask [77]]}

<name> is the image's path in DATA_DIR with "/" and "." as "_". A data.json for it names
`"data_path": "OUT/data.jsonl"`, `"data_folder": "OUT"` and the image size as `max_height` /
`max_width` (examples/flux/mindspeed_mm/feature_data.json); the predictor block's `text_len` is
--max-sequence-length. The folder is written under a temporary name and renamed when complete.

With `--family wan` DATA_DIR is a video-caption folder (mm_grpo/data/image_captions.py: each video a
filmstrip of 4k + 1 square frames, e.g. `python -m mm_grpo.data.motion generate`) and a feature is what
MindSpeed-MM's Wan2.1 reads with `load_video_features` / `load_text_features` (its
examples/wan2.1/1.3b/t2v/feature_data.json and pretrain_model.json; the wandit predictor zeroes the
prompt past the mask's length):

    {"video": latents [C, k + 1, H/8, W/8] (the posterior mode, normalised per channel as WanPipeline
               undoes it: (z - latents_mean) / latents_std),
     "prompt_ids": umT5 hidden states [L, D] (zero past the prompt, as WanPipeline.encode_prompt),
     "prompt_mask": umT5 attention mask [L]}
"""
import argparse
import json
import os
import sys
import time

import torch

from mm_grpo.data.image_captions import METADATA, ImageCaptionDataset, VideoCaptionDataset
from mm_grpo.families.flux.text import MAX_SEQUENCE_LENGTH, TextEncoders
from mm_grpo.families.flux.transformer.latents import latent_size
from mm_grpo.families.flux.vae import encode_latents, load_vae
from mm_grpo.families.wan.encoders import UMT5Conditioner, encode_video_latents, load_wan_vae, video_latent_shape
from mm_grpo.files.atomic import atomic_dir
from mm_grpo.settings import add_setting_args, from_args
from mm_grpo.tools.encoding import EncoderSettings

PROG = "mm_grpo.tools.write_features"
FEATURES = "features"  # the subfolder and the data.jsonl paths of MindSpeed-MM's extractor
DATA_LIST = "data.jsonl"
# MindSpeed-MM's FeatureDataset keys (mindspeed_mm/data/data_utils/constants.py).
FILE, VIDEO, PROMPT_IDS, PROMPT_MASK = "file", "video", "prompt_ids", "prompt_mask"
FAMILIES = ("flux", "wan")


def feature_name(image: str) -> str:
    """The feature file of an image path relative to the data folder: images/0.png -> images_0_png.pt."""
    return image.replace(os.sep, "_").replace(".", "_") + ".pt"


def _sizes(dataset: ImageCaptionDataset):
    """{(H, W): the first file of that size} of the dataset's images (headers only); OSError naming a
    file that is not an image."""
    from PIL import Image
    sizes = {}
    for path in dataset.files:
        with Image.open(path) as im:  # reads the header only
            sizes.setdefault((im.height, im.width), path)
    return sizes


def _one_size(sizes, what, advice=""):
    """The one (H, W) of `sizes`, or a ValueError naming two files that differ, then `advice`."""
    if len(sizes) > 1:
        (a, first), (b, other) = list(sizes.items())[:2]
        raise ValueError(f"{what} differ in size ({first}: {a[0]}x{a[1]}, {other}: {b[0]}x{b[1]}){advice}")
    (size, _), = sizes.items()
    return size


def image_size(dataset: ImageCaptionDataset, resolution):
    """(H, W) every feature will have; before any model is loaded, ValueError if that is not one
    size FLUX can take, OSError naming an image that is not one."""
    sizes = _sizes(dataset)
    if resolution is not None:
        latent_size(resolution, resolution)
        return resolution, resolution
    height, width = _one_size(sizes, "images", ": pass --resolution to resize and centre-crop them to one square size")
    try:
        latent_size(height, width)
    except ValueError as e:
        raise ValueError(f"{e}: pass --resolution to resize and centre-crop the images to such a size") from None
    return height, width


def video_size(dataset: VideoCaptionDataset):
    """(F, H, W) every video will have; before any model is loaded, ValueError if that is not one
    size Wan's VAE and DiT take (4k + 1 square frames, sides multiples of 16)."""
    height, width = _one_size(_sizes(dataset), "filmstrips")
    if width % height:
        raise ValueError(f"{dataset.folder}: {height}x{width} filmstrips are not a whole number of square frames")
    frames = width // height
    video_latent_shape(frames, height, height)
    return frames, height, height


def _sample(tensors, i):
    """Row i of each tensor as its own tensor (a view would save the whole batch's storage)."""
    return [t[i].cpu().clone() for t in tensors]


def _flux_encoder(pipeline_dir, max_sequence_length, device, dtype):
    """(dataset, indices) -> one feature dict per sample: FLUX's VAE latents and T5 + CLIP features."""
    vae = load_vae(pipeline_dir, device=device, dtype=dtype)
    text = TextEncoders(pipeline_dir, device=device, dtype=dtype, max_sequence_length=max_sequence_length)

    def encode(dataset, indices):
        latents = encode_latents(vae, dataset.images(indices))
        embeds, pooled, masks = text.encode_with_masks(dataset.captions_of(indices))
        features = []
        for row in range(len(indices)):
            video, t5, clip = _sample((latents, embeds, pooled), row)
            features.append({VIDEO: video, PROMPT_IDS: [t5, clip], PROMPT_MASK: _sample(masks, row)})
        return features
    return encode


def _wan_encoder(pipeline_dir, max_sequence_length, device, dtype):
    """(dataset, indices) -> one feature dict per sample: Wan's VAE latents and umT5 features."""
    vae = load_wan_vae(pipeline_dir, device=device, dtype=dtype)
    text = UMT5Conditioner(pipeline_dir, device=device, dtype=dtype, max_sequence_length=max_sequence_length)

    def encode(dataset, indices):
        latents = encode_video_latents(vae, dataset.videos(indices))
        embeds, mask = text.encode_with_mask(dataset.captions_of(indices))
        return [dict(zip((VIDEO, PROMPT_IDS, PROMPT_MASK), _sample((latents, embeds, mask), row)))
                for row in range(len(indices))]
    return encode


def _open_data(family, data_dir, image_column, caption_column, resolution):
    """(dataset, the size every feature will have): checked before any model is loaded."""
    if family == "flux":
        dataset = ImageCaptionDataset(data_dir, image_column, caption_column, resolution=resolution)
        return dataset, image_size(dataset, resolution)
    if resolution is not None:
        raise ValueError("--resolution resizes images; a video folder's frames are encoded as they are")
    dataset = VideoCaptionDataset(data_dir, image_column, caption_column)
    return dataset, video_size(dataset)


def write_features(pipeline_dir, data_dir, out, resolution=None, max_sequence_length=MAX_SEQUENCE_LENGTH,
                   image_column="file_name", caption_column="text", device="cpu", dtype=torch.bfloat16,
                   batch_size=8, overwrite=False, family="flux"):
    """Writes OUT (see the module docstring); returns (number of samples, (H, W)), for Wan (F, H, W)."""
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    if family not in FAMILIES:
        raise ValueError(f"--family must be one of {', '.join(FAMILIES)}, got {family!r}")
    if os.path.lexists(out) and not overwrite:
        raise FileExistsError(f"{out} already exists: remove it, choose another --out, or pass --overwrite")
    dataset, size = _open_data(family, data_dir, image_column, caption_column, resolution)
    images = [os.path.relpath(path, data_dir) for path in dataset.files]
    names = [feature_name(image) for image in images]
    if len(set(names)) != len(names):
        twin = next(image for image, name in zip(images, names) if names.count(name) > 1)
        raise ValueError(f"{os.path.join(data_dir, METADATA)}: two images map to the feature file "
                         f"{feature_name(twin)} (one is {twin}); rename one")
    encode = (_flux_encoder if family == "flux" else _wan_encoder)(pipeline_dir, max_sequence_length, device, dtype)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        os.makedirs(os.path.join(tmp, FEATURES))
        rows = []
        for start in range(0, len(dataset), batch_size):
            indices = list(range(start, min(start + batch_size, len(dataset))))
            for i, feature in zip(indices, encode(dataset, indices)):
                path = os.path.join(FEATURES, names[i])
                torch.save(feature, os.path.join(tmp, path))
                rows.append({image_column: images[i], caption_column: dataset.captions[i], FILE: path})
        with open(os.path.join(tmp, DATA_LIST), "w", encoding="utf-8") as f:
            f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return len(dataset), size


def main(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    add_setting_args(p, EncoderSettings)
    p.add_argument("--family", choices=FAMILIES, default="flux",
                   help="flux: a FLUX pipeline and an image folder; wan: a Wan pipeline and a video-caption folder")
    p.add_argument("--data", required=True, help="image-caption folder: metadata.jsonl + images (--family wan: "
                                                 "videos as filmstrips)")
    p.add_argument("--out", required=True, help="folder to write (data.jsonl, features/)")
    p.add_argument("--resolution", type=int, default=None,
                   help="resize and centre-crop every image to this square size (default: keep the images' "
                        "size, which must be one size for all)")
    p.add_argument("--image-column", default="file_name")
    p.add_argument("--caption-column", default="text")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
    args = p.parse_args(argv)
    start = time.time()
    try:
        enc = from_args(EncoderSettings, args)
        n, size = write_features(
            enc.pipeline, args.data, args.out, args.resolution, enc.max_sequence_length, args.image_column,
            args.caption_column, enc.device, enc.torch_dtype, args.batch_size, args.overwrite, args.family)
    except (ValueError, OSError) as e:  # bad input, missing or existing paths, full disk
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    shape = "x".join(map(str, size)) if args.family == "flux" else "{} frames of {}x{}".format(*size)
    print(f"{n} samples ({shape}) -> {os.path.join(args.out, DATA_LIST)} in {time.time() - start:.1f}s")


if __name__ == "__main__":
    main()
