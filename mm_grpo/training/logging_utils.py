"""Logging for the training loops: stdout with a progress bar, TensorBoard, image grids.

Only the last rank logs (as Megatron does: it sits on the last pipeline stage, where the
losses are). Image grids are written by a background thread so training never waits on PNG
encoding or the filesystem.
"""
import math
import os
import queue
import threading

import torch.distributed as dist


def is_logging_rank():
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


class TrainLogger:
    def __init__(self, tensorboard_dir=None, total_iters=0, start_iter=0, progress_bar=True, log_interval=1):
        self.active = is_logging_rank()
        self.log_interval = log_interval
        self.writer, self.bar = None, None
        if not self.active:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(tensorboard_dir)
        if progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=total_iters, initial=start_iter, unit="it", dynamic_ncols=True)
        self.images = AsyncImageWriter()

    def log(self, iteration, stats: dict):
        """One training iteration: TensorBoard, the progress bar, a line every log interval."""
        if not self.active:
            return
        scalars = self._scalars(iteration, stats)
        if self.bar is not None:
            self.bar.update(1)
            short = {"reward": scalars.get("reward/mean"), "loss": scalars.get("loss"),
                     "grad_norm": scalars.get("grad_norm")}
            short = {k: v for k, v in short.items() if v is not None}
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in short.items()})
        if iteration % self.log_interval == 0 or "skip_reason" in stats:
            skipped = f" | SKIPPED: {stats['skip_reason']}" if "skip_reason" in stats else ""
            self.write(self._line(iteration, scalars) + skipped)

    def log_eval(self, iteration, stats: dict):
        """A held-out evaluation: always printed (evaluations are rare), the bar not advanced."""
        if self.active:
            self.write(self._line(iteration, self._scalars(iteration, stats)))

    @staticmethod
    def _line(iteration, scalars):
        return f"iteration {iteration:6d} | " + " | ".join(f"{k} {v:.5g}" for k, v in scalars.items())

    def _scalars(self, iteration, stats):
        scalars = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        if self.writer:
            for k, v in scalars.items():
                if math.isfinite(v):
                    self.writer.add_scalar(k, v, iteration)
        return scalars

    def write(self, line):
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def image_grid(self, iteration, images, path):
        if self.active:
            self.images.put(images.detach().cpu(), path)
            if self.writer:
                from torchvision.utils import make_grid
                self.writer.add_image("samples", make_grid(images.detach().cpu(), nrow=4), iteration)

    def close(self):
        if not self.active:
            return
        self.images.close()
        if self.writer:
            self.writer.close()
        if self.bar is not None:
            self.bar.close()


class AsyncImageWriter:
    """Saves image grids from a queue on a daemon thread (atomic: temp file, then rename)."""

    def __init__(self):
        self.queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, images, path):
        self.queue.put((images, path))

    def _run(self):
        from torchvision.utils import save_image
        while True:
            item = self.queue.get()
            if item is None:
                return
            images, path = item
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            tmp = path + ".tmp.png"
            save_image(images, tmp, nrow=4)
            os.replace(tmp, path)

    def close(self):
        self.queue.put(None)
        self.thread.join()
