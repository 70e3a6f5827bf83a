"""Device profiles for `mm-grpo plan`: peak dense bf16 FLOP/s, HBM, interconnect bandwidths.

Public figures (vendors' datasheets and public reports), not measured here. Bandwidths are
per device and per direction, in bytes/s: `intra_node_bw` within a node (NVLink / HCCS),
`inter_node_bw` the device's share of the node's network (InfiniBand / RoCE NICs).

- Atlas 800T A2: 8 Ascend 910B NPUs per node, 64 GB HBM2e each. bf16/fp16 peak ~313 TFLOP/s
  per NPU (910B3, as publicly reported for the 800T A2), HBM ~1.6 TB/s; HCCS full mesh between
  the 8 NPUs, 392 GB/s per NPU (both directions: 196 GB/s each way); 8 x 200GE RoCE ports per node, one per NPU
  (25 GB/s). Source: Huawei Atlas 800T A2 product page and public 910B reports.
- H800 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 400 GB/s (total both
  directions; 200 GB/s per direction), typically 8 x 400 Gb/s InfiniBand per node (50 GB/s
  per GPU). Source: NVIDIA H800 datasheet (NVLink cut to 400 GB/s from the H100's 900 GB/s).
- H100 SXM5: 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 GB/s per
  direction), 8 x 400 Gb/s NDR InfiniBand per node (50 GB/s per GPU). Source: NVIDIA H100
  datasheet (DGX H100).
- H200 SXM: 989 TFLOP/s dense bf16 (the H100's compute), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s
  (450 GB/s per direction), 8 x 400 Gb/s InfiniBand per node (50 GB/s per GPU). Source: NVIDIA H200
  datasheet (HGX H200).

`matmul_bf16_flops` is measured, not a datasheet figure: the bf16 matmul rate
bench/bench_grpo.matmul_throughput reaches (8192^3, median of 3) on that card, the rate the time
model's efficiencies are relative to (a family's calibration: families/flux/calibration.py). H200: 791 TFLOP/s (issue 48's run, the
calibration's); H100: 732 TFLOP/s (docs/performance.md, the 512 px FLUX.1-dev run; 747 and 769 in
two other runs). A profile without one (None) is taken at MATMUL_FRACTION_OF_PEAK of its
peak: the H800 (the H100's chip, not measured here) and the Atlas 800T A2 (not measured: an
assumption). `compiles`: whether torch.compile compiles there (on Ascend MindSpeed's adaptor turns
it into a no-op, so compiled blocks run eager).
"""
import dataclasses
from typing import Optional

GB = 10 ** 9
# For a device profile without a measured matmul rate: this fraction of its datasheet peak, the
# H200's (791 TFLOP/s of 989, bench/bench_grpo.matmul_throughput on 2026-11-27). An assumption for
# any other device (Ascend's included).
MATMUL_FRACTION_OF_PEAK = 791.0 / 989.0


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    peak_bf16_flops: float  # dense, per device
    memory_bytes: float  # HBM per device
    hbm_bw: float  # bytes/s
    intra_node_bw: float  # bytes/s per direction, device to device within a node
    inter_node_bw: float  # bytes/s per direction, per device across nodes
    devices_per_node: int = 8
    matmul_bf16_flops: Optional[float] = None  # measured bf16 GEMM rate (None: not measured)
    compiles: bool = True  # torch.compile compiles (Ascend under MindSpeed: no)

    @property
    def matmul_rate(self) -> float:
        """The bf16 matmul rate the time model scales: measured, else MATMUL_FRACTION_OF_PEAK of the
        datasheet peak."""
        return self.matmul_bf16_flops or self.peak_bf16_flops * MATMUL_FRACTION_OF_PEAK


DEVICES = {
    "atlas-800t-a2": Device("Atlas 800T A2 (Ascend 910B)", 313e12, 64 * GB, 1.6e12, 196e9, 25e9, compiles=False),
    "h800": Device("H800 SXM", 989e12, 80 * GB, 3.35e12, 200e9, 50e9),
    "h100": Device("H100 SXM", 989e12, 80 * GB, 3.35e12, 450e9, 50e9, matmul_bf16_flops=732e12),
    "h200": Device("H200 SXM", 989e12, 141 * GB, 4.8e12, 450e9, 50e9, matmul_bf16_flops=791e12),
}


def device(name: str, memory_gb: float = None, matmul_tflops: float = None) -> Device:
    """A profile by name, its memory replaced by `memory_gb` (GB = 1e9 bytes) and its measured bf16
    matmul rate by `matmul_tflops` (TFLOP/s) when given."""
    if name not in DEVICES:
        raise ValueError(f"unknown device profile {name!r}; choose one of {', '.join(DEVICES)}")
    d = DEVICES[name]
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError(f"--device-memory must be > 0 GB, got {memory_gb}")
        d = dataclasses.replace(d, memory_bytes=memory_gb * GB)
    if matmul_tflops is not None:
        if matmul_tflops <= 0:
            raise ValueError(f"--matmul-tflops must be > 0, got {matmul_tflops}")
        d = dataclasses.replace(d, matmul_bf16_flops=matmul_tflops * 1e12)
    return d
