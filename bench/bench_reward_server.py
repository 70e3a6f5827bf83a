"""Load test of the reward server on localhost: throughput, latency, and every request's own scores.

    python -m bench.bench_reward_server [--clients 8 --requests 25 --images 4 --max-batch 32]

Starts `python -m mm_grpo.tools.reward_server` in its own process with the CPU demo's rewards
(examples/rewards/rewards_shapes.json), then `--clients` threads each send `--requests`
requests of `--images` 64x64 shapes images through the `remote` reward. Every response is
compared with the same rows scored in this process (no lost, duplicated or swapped scores)
and the server's count of scored images with what was sent. The reference in the same run:
the same images scored in process, one request's batch at a time. docs/rewards.md.
"""
import argparse
import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import requests
import torch

from mm_grpo.data import shapes
from mm_grpo.rewards import CombinedReward, build_reward, wire
from mm_grpo.tools.reward_server import served_url

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REWARDS = os.path.join(REPO, "examples", "rewards", "rewards_shapes.json")


def shapes_batch(n: int, seed: int = 0):
    """n rendered shapes scenes, noised and quantised to 8 bits (exact in PNG), half of them under
    another scene's caption: compositional scores spread between 0 and 1."""
    config = shapes.ShapesConfig()
    sampler = shapes.CaptionSampler(config)
    pixels, captions = [], []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        spec = sampler(rng)
        pixels.append(np.array(shapes.render(shapes.sample_scene(spec, rng, config))))
        captions.append(spec.caption())
    images = torch.from_numpy(np.stack(pixels)).permute(0, 3, 1, 2).float()
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(seed)) * 20
    images = (images + noise).round().clamp(0, 255) / 255
    captions = [captions[(i + 1) % n] if i % 2 else captions[i] for i in range(n)]
    return images, captions


def start_server(command, within_s: float = 120, **popen):
    """Starts a reward server (`command`: its argv, with --port 0 or PORT=0; `popen`: more of
    Popen's arguments) and waits until it answers /health: (process, its URL, its stderr lines,
    kept up to date by a reader thread that ends with the process).
    The server picks its own port and names it: a port chosen here and freed would be a race."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **popen)
    lines, urls = [], queue.Queue()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if url := served_url(line):
                urls.put(url)
        urls.put(None)  # stderr closed: the server has exited
    threading.Thread(target=read, name="reward-server-stderr", daemon=True).start()
    deadline = time.monotonic() + within_s
    try:
        url = urls.get(timeout=within_s)
        while url is not None:
            try:
                requests.get(url + wire.HEALTH_PATH, timeout=2).raise_for_status()
                return proc, url, lines
            except requests.RequestException:  # listening soon, or slow on a loaded machine
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
    except queue.Empty:
        pass
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the reward server did not start: {''.join(lines)[-2000:]}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=25, help="per client")
    p.add_argument("--images", type=int, default=4, help="per request")
    p.add_argument("--max-batch", type=int, default=32)
    args = p.parse_args(argv)
    total_requests = args.clients * args.requests
    images, prompts = shapes_batch(total_requests * args.images)
    with open(REWARDS) as f:
        in_process = CombinedReward.from_configs(json.load(f))

    start = time.perf_counter()
    expected = torch.cat([in_process(images[i:i + args.images], prompts[i:i + args.images])[0]
                          for i in range(0, len(prompts), args.images)])
    reference_s = time.perf_counter() - start

    proc, url, _ = start_server([sys.executable, "-m", "mm_grpo.tools.reward_server", "--rewards", REWARDS,
                                 "--port", "0", "--max-batch", str(args.max_batch)])
    try:
        remote = build_reward({"name": "remote", "url": url, "retries": 0})

        def client(c):
            out = []
            for r in range(args.requests):
                first = (c * args.requests + r) * args.images
                rows = slice(first, first + args.images)
                t0 = time.perf_counter()
                scores = remote(images[rows], prompts[rows])
                out.append((rows, scores, time.perf_counter() - t0))
            return out

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            results = [x for part in pool.map(client, range(args.clients)) for x in part]
        wall = time.perf_counter() - start
        scored = requests.get(url + wire.HEALTH_PATH).json()["scored_images"]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)

    wrong = sum(not torch.equal(scores, expected[rows]) for rows, scores, _ in results)
    latency = np.array([t for _, _, t in results]) * 1000
    n_images = total_requests * args.images
    print(f"{args.clients} clients x {args.requests} requests x {args.images} images (64x64), --max-batch "
          f"{args.max_batch}, {torch.get_num_threads()} torch threads")
    print(f"server:     {total_requests / wall:.1f} requests/s, {n_images / wall:.1f} images/s; latency p50 "
          f"{np.percentile(latency, 50):.1f} ms, p99 {np.percentile(latency, 99):.1f} ms")
    print(f"in process: {n_images / reference_s:.1f} images/s (one request's batch at a time); server / in "
          f"process = {reference_s / wall:.2f}")
    print(f"responses: {len(results)} of {total_requests}, {wrong} with other scores than in process; "
          f"server scored {scored} images of {n_images} sent")
    if wrong or len(results) != total_requests or scored != n_images:
        sys.exit(1)


if __name__ == "__main__":
    main()
