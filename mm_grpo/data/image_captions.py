"""An image-caption dataset folder: images plus `metadata.jsonl` (diffusers' image-folder layout).

    DATA_DIR/metadata.jsonl    {"file_name": "images/000000.png", "text": "a red circle"}  per line
    DATA_DIR/images/...

The column names are configurable (`image_column`, `caption_column`, as in diffusers' training
scripts). Every row is checked when the folder is opened, so a bad row fails before training.
"""
import json
import os
from typing import List, Sequence

import torch

METADATA = "metadata.jsonl"


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
