"""Throughput figures of a training run: tokens/s and model FLOPs utilisation (MFU).

MFU = tokens/s x training FLOPs per token (restopo.nn.flops, from the IR: sublayers, head and
the aggregations' own work, x3 for forward and backward) / (peak FLOP/s per device x devices).
The peak is `train.peak_tflops` (or `restopo train --peak-tflops`) when given, else a default
for the device: the dense bf16 tensor-core peak of known CUDA GPUs (the usual convention,
whatever precision the run uses); none on the CPU, whose peak depends on cores and clocks,
so a CPU run reports MFU only when told the peak.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Dense bf16 peak FLOP/s per device (vendor datasheets), matched by name in this order
# (a longer name first: "H100 PCIe" and "H100 NVL" before "H100", "L40S" and "L40" before
# "L4"). The NVL parts are the PCIe cards: 1671 TFLOP/s with sparsity, half that dense.
CUDA_PEAKS = (
    ("H200 NVL", 835.5e12), ("H200", 989e12), ("H100 PCIe", 756e12), ("H100 NVL", 835.5e12),
    ("H100", 989e12), ("A100", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12),
)


def default_peak(device: torch.device) -> float | None:
    """The dense bf16 peak FLOP/s of `device` when it is a known CUDA GPU, else None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in CUDA_PEAKS if key in name), None)


@dataclass(frozen=True)
class Throughput:
    """What turns a run's tokens/s into MFU: training FLOPs per token and the summed peak
    FLOP/s of the run's devices (None: no MFU)."""

    train_flops_per_token: float
    peak: float | None = None

    @classmethod
    def of(cls, train_flops_per_token: float, device: torch.device, devices: int = 1,
           peak_tflops: float | None = None) -> "Throughput":
        """`peak_tflops` per device if given, else the device's default."""
        per_device = peak_tflops * 1e12 if peak_tflops is not None else default_peak(device)
        return cls(train_flops_per_token, None if per_device is None else per_device * devices)

    def mfu(self, tokens_per_s: float) -> float | None:
        """The fraction of the peak the run's model FLOPs use, or None without a peak."""
        if self.peak is None:
            return None
        return tokens_per_s * self.train_flops_per_token / self.peak
