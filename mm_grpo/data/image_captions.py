"""An image-caption dataset folder: images plus `metadata.jsonl` (diffusers' image-folder layout).

    DATA_DIR/metadata.jsonl    {"file_name": "images/000000.png", "text": "a red circle"}  per line
    DATA_DIR/images/...

The column names are configurable (`image_column`, `caption_column`, as in diffusers' training
scripts). Every row is checked when the folder is opened, so a bad row fails before training.

A video-caption folder has the same layout with each video stored as a filmstrip: its square
frames side by side in one image, left to right (`filmstrip`, `VideoCaptionDataset`). PNG keeps
the frames exact, and a strip can be looked at as it is.
"""
import json
import os
from typing import Iterable, List, Sequence, Tuple

import torch

from mm_grpo.files.atomic import atomic_dir

METADATA = "metadata.jsonl"
DATASET_INFO = "dataset.json"  # how a generated folder was made


class ImageCaptionDataset:
    """`dataset[i]` -> (image float32 [3, H, W] in [0, 1], caption).

    `resolution`: images are resized (shorter side, bicubic) and centre-cropped to a square of
    this side when they are not already that size; None keeps them as they are."""

    def __init__(self, folder: str, image_column: str = "file_name", caption_column: str = "text",
                 resolution: int = None):
        path = os.path.join(folder, METADATA)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {METADATA} in {folder} (an image-caption folder needs one JSON line "
                                    f"per image with {image_column!r} and {caption_column!r})")
        self.folder, self.resolution = folder, resolution
        self.files, self.captions = [], []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    raise ValueError(f"{path}:{n}: not a JSON object") from None
                if not isinstance(row, dict) or not isinstance(row.get(image_column), str) \
                        or not isinstance(row.get(caption_column), str):
                    raise ValueError(f"{path}:{n}: needs string fields {image_column!r} and {caption_column!r}")
                self.files.append(os.path.join(folder, row[image_column]))
                self.captions.append(row[caption_column])
        if not self.files:
            raise ValueError(f"{path} lists no images")
        missing = [p for p in self.files if not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(f"{len(missing)} image(s) listed in {path} do not exist, e.g. {missing[0]}")

    def __len__(self):
        return len(self.files)

    def image(self, index: int) -> torch.Tensor:
        from PIL import Image
        from torchvision.transforms import functional as TF

        with Image.open(self.files[index]) as im:
            image = TF.pil_to_tensor(im.convert("RGB"))
        if self.resolution and tuple(image.shape[1:]) != (self.resolution, self.resolution):
            image = TF.center_crop(TF.resize(image, self.resolution, TF.InterpolationMode.BICUBIC, antialias=True),
                                   self.resolution)
        return image.float() / 255

    def __getitem__(self, index: int):
        return self.image(index), self.captions[index]

    def images(self, indices: Sequence[int]) -> torch.Tensor:
        """Images [N, 3, H, W] in [0, 1] (all must come out the same size: set `resolution`)."""
        images = [self.image(i) for i in indices]
        if len({tuple(im.shape) for im in images}) > 1:
            raise ValueError(f"images in {self.folder} differ in size: set a resolution to resize them")
        return torch.stack(images)

    def captions_of(self, indices: Sequence[int]) -> List[str]:
        return [self.captions[i] for i in indices]


def write_caption_folder(out: str, examples: Iterable[Tuple[object, dict]], info: dict,
                         subfolder: str = "images") -> str:
    """`out`/<subfolder>/NNNNNN.png and `out`/metadata.jsonl ({"file_name": ..., **row} per line; each
    example is a (PIL image, row) with the row's "text" the caption), and `out`/dataset.json (`info`:
    how the folder was made). Built in a temporary sibling folder and renamed, so `out` is never
    half-written."""
    with atomic_dir(out) as tmp:
        os.makedirs(os.path.join(tmp, subfolder))
        with open(os.path.join(tmp, METADATA), "w") as meta:
            for i, (image, row) in enumerate(examples):
                name = f"{subfolder}/{i:06d}.png"
                image.save(os.path.join(tmp, name))
                meta.write(json.dumps({"file_name": name, **row}) + "\n")
        with open(os.path.join(tmp, DATASET_INFO), "w") as f:
            json.dump(info, f, indent=1)
    return out


# --- videos as filmstrips ------------------------------------------------------------------
def filmstrip(frames):
    """Frames [F, H, W, C] (numpy, uint8) -> one image [H, F x W, C]: the frames side by side."""
    import numpy as np
    return np.concatenate(list(frames), axis=1)


def unstrip(strips: torch.Tensor) -> torch.Tensor:
    """Filmstrips [..., C, H, F x H] of square frames -> videos [..., F, C, H, H]."""
    height, width = strips.shape[-2:]
    if width % height:
        raise ValueError(f"a filmstrip of square frames is F x its height wide: {height} x {width} is not")
    frames = strips.unflatten(-1, (width // height, height))  # [..., C, H, F, W]
    return frames.movedim(-2, -4)


class VideoCaptionDataset(ImageCaptionDataset):
    """A video-caption folder (each video a filmstrip of square frames): `videos(indices)` ->
    [N, F, 3, H, W] in [0, 1]. Frames are never resized."""

    def __init__(self, folder: str, image_column: str = "file_name", caption_column: str = "text"):
        super().__init__(folder, image_column, caption_column)

    def videos(self, indices: Sequence[int]) -> torch.Tensor:
        return unstrip(self.images(indices))
