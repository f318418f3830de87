"""Dense peak FLOP/s per device, for MFU.

MFU is only as honest as its denominator, so every figure below is a *dense* (no 2:4 sparsity)
tensor-core peak taken from the vendor's public datasheet named in the comment next to it, per
device as PyTorch sees one (one GPU; one TPU chip; one logical NeuronCore on Trainium). Figures
are FLOP/s. A device that matches no entry gets ``None`` (and the caller warns once): a guessed
peak would give a plausible-looking but wrong MFU.

Override without editing this table: ``MFUMonitor(peak_flops=...)`` or the environment variable
``FSDP_STRATEGIES_PEAK_FLOPS`` (FLOP/s per device, e.g. ``989e12``). CPUs have no entry: give the
peak explicitly.
"""

from __future__ import annotations

import os
import re
from typing import Literal, get_args

__all__ = ["PEAK_FLOPS", "PEAK_FLOPS_ENV", "lookup_peak_flops", "peak_flops_from_env"]

PEAK_FLOPS_ENV = "FSDP_STRATEGIES_PEAK_FLOPS"

T = 1e12

# key -> {dtype: dense FLOP/s}. Keys are matched by the patterns in _PATTERNS (most specific first).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100), SXM column: BF16/FP16 1,979 TF and
    # FP8 3,958 TF "with sparsity" -> half dense; TF32 989 sparse -> 494.7 dense.
    "h100-sxm": {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp8": 1978.9 * T, "fp32": 67 * T},
    # Same datasheet, PCIe column: BF16 1,513 TF sparse, FP8 3,026 sparse, TF32 756 sparse.
    "h100-pcie": {"bf16": 756.5 * T, "fp16": 756.5 * T, "tf32": 378 * T, "fp8": 1513 * T, "fp32": 51 * T},
    # Same datasheet, H100 NVL column (per GPU): BF16 1,671 TF sparse, FP8 3,341 sparse, TF32 835 sparse.
    "h100-nvl": {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp8": 1670.5 * T, "fp32": 60 * T},
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200), H200 SXM column: same tensor
    # throughput as H100 SXM (BF16 1,979 TF sparse, FP8 3,958 sparse, TF32 989 sparse).
    "h200-sxm": {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp8": 1978.9 * T, "fp32": 67 * T},
    # Same datasheet, H200 NVL column: BF16 1,671 TF sparse, FP8 3,341 sparse, TF32 835 sparse.
    "h200-nvl": {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T, "fp8": 1670.5 * T, "fp32": 60 * T},
    # NVIDIA GH200 Grace Hopper datasheet: the Hopper GPU has the H100/H200 SXM tensor throughput
    # (BF16 1,979 TF sparse, FP8 3,958 sparse).
    "gh200": {"bf16": 989.4 * T, "fp16": 989.4 * T, "tf32": 494.7 * T, "fp8": 1978.9 * T, "fp32": 67 * T},
    # NVIDIA HGX B200 spec (nvidia.com/en-us/data-center/hgx): 8 GPUs = FP16/BF16 36 PF and FP8 72 PF
    # with sparsity, TF32 18 PF -> per GPU dense BF16 2.25 PF, FP8 4.5 PF, TF32 1.125 PF.
    "b200": {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1125 * T, "fp8": 4500 * T},
    # NVIDIA HGX B300 spec (same page): 8 GPUs = FP16/BF16 36 PF and FP8 72 PF with sparsity
    # (Blackwell Ultra raises FP4, not BF16) -> per GPU dense BF16 2.25 PF, FP8 4.5 PF.
    "b300": {"bf16": 2250 * T, "fp16": 2250 * T, "tf32": 1125 * T, "fp8": 4500 * T},
    # NVIDIA GB200 NVL72 spec (nvidia.com/en-us/data-center/gb200-nvl72): 72 GPUs = FP16/BF16 360 PF
    # and FP8 720 PF with sparsity, TF32 180 PF -> per GPU dense BF16 2.5 PF, FP8 5 PF, TF32 1.25 PF.
    "gb200": {"bf16": 2500 * T, "fp16": 2500 * T, "tf32": 1250 * T, "fp8": 5000 * T},
    # NVIDIA A100 datasheet (nvidia.com/en-us/data-center/a100), SXM and PCIe alike: BF16/FP16
    # 312 TF dense, TF32 156 TF dense, FP32 19.5 TF. No FP8.
    "a100": {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    # NVIDIA L4 datasheet (nvidia.com/en-us/data-center/l4): BF16/FP16 242 TF, FP8 485 TF, TF32 120 TF,
    # all "with sparsity" -> half dense; FP32 30.3 TF.
    "l4": {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp8": 242.5 * T, "fp32": 30.3 * T},
    # NVIDIA L40S datasheet (nvidia.com/en-us/data-center/l40s): BF16/FP16 362.05 TF dense (733 sparse),
    # FP8 733 TF dense, TF32 183 TF dense, FP32 91.6 TF.
    "l40s": {"bf16": 362.05 * T, "fp16": 362.05 * T, "tf32": 183 * T, "fp8": 733 * T, "fp32": 91.6 * T},
    # NVIDIA L40 datasheet: BF16/FP16 362 TF with sparsity, FP8 724 sparse, TF32 181 sparse.
    "l40": {"bf16": 181 * T, "fp16": 181 * T, "tf32": 90.5 * T, "fp8": 362 * T, "fp32": 90.5 * T},
    # NVIDIA A10 datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/a10-datasheet.pdf):
    # BF16/FP16 125 TF dense, TF32 62.5 TF dense, FP32 31.2 TF. AWS's A10G (g5) is an A10-class part
    # for which NVIDIA publishes no separate sheet; the A10 figures are used.
    "a10g": {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T},
    "a10": {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T},
    # AMD Instinct MI300X data sheet (amd.com/.../instinct-mi300x-data-sheet.pdf): BF16/FP16 1,307.4 TF
    # dense, FP8 2,614.9 TF dense, TF32 653.7 TF, FP32 matrix 163.4 TF.
    "mi300x": {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp8": 2614.9 * T,
               "fp32": 163.4 * T},
    # AMD Instinct MI325X data sheet: same compute die as MI300X (BF16 1,307.4 TF dense, FP8 2,614.9).
    "mi325x": {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "tf32": 653.7 * T, "fp8": 2614.9 * T,
               "fp32": 163.4 * T},
    # AMD Instinct MI355X data sheet (amd.com/en/products/accelerators/instinct/mi350/mi355x.html):
    # BF16/FP16 2,516.6 TF dense (5,033.2 with sparsity), FP8 5,033.2 TF dense, FP32 157.3 TF.
    "mi355x": {"bf16": 2516.6 * T, "fp16": 2516.6 * T, "fp8": 5033.2 * T, "fp32": 157.3 * T},
    # Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e),
    # per chip, BF16: v4 275 TF, v5e 197 TF, v5p 459 TF, v6e (Trillium) 918 TF (their second figure is
    # INT8 TOPS, not FP8, so no fp8 entry).
    "tpu-v4": {"bf16": 275 * T},
    "tpu-v5e": {"bf16": 197 * T},
    "tpu-v5p": {"bf16": 459 * T},
    "tpu-v6e": {"bf16": 918 * T},
    # AWS Trainium (aws.amazon.com/machine-learning/trainium): Trainium1 chip = 190 TF BF16/FP16 over
    # 2 NeuronCore-v2 -> 95 TF per NeuronCore (one torch-neuronx device).
    "trn1": {"bf16": 95 * T, "fp16": 95 * T},
    # Trainium2 chip = 667 TF dense BF16 and 1,299 TF dense FP8 over 8 NeuronCore-v3; torch-neuronx
    # shows one device per logical core, 2 physical cores at the default LNC=2 -> 166.75 TF BF16.
    "trn2": {"bf16": 166.75 * T, "fp16": 166.75 * T, "fp8": 324.75 * T},
}

# (regex on the lower-cased device name, key). Order matters: specific names before their
# substrings ("gh200" before "h200", "gb200" before "b200", "l40s" before "l40" before "l4").
_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"gh200", "gh200"),
    (r"gb200", "gb200"),
    (r"h100.*nvl", "h100-nvl"),
    (r"h100.*pcie", "h100-pcie"),
    (r"h100", "h100-sxm"),  # "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM5 ..."
    (r"h200.*nvl", "h200-nvl"),
    (r"h200", "h200-sxm"),  # "NVIDIA H200"
    (r"b300", "b300"),
    (r"b200", "b200"),
    (r"a100", "a100"),
    (r"l40s", "l40s"),
    (r"l40\b", "l40"),
    (r"\bl4\b", "l4"),
    (r"a10g", "a10g"),
    (r"\ba10\b", "a10"),
    (r"mi355x", "mi355x"),
    (r"mi325x", "mi325x"),
    (r"mi300x", "mi300x"),
    (r"v6e|v6 lite|trillium", "tpu-v6e"),
    (r"v5p", "tpu-v5p"),
    (r"v5e|v5 lite|v5litepod", "tpu-v5e"),
    (r"tpu v4|^v4$", "tpu-v4"),
    (r"trn2|trainium2", "trn2"),
    (r"trn1|trainium1?\b", "trn1"),
)

PeakDType = Literal["bf16", "fp16", "tf32", "fp8", "fp32"]
DTYPES: tuple[str, ...] = get_args(PeakDType)


def device_key(device_name: str) -> str | None:
    """The table key for a device name (e.g. ``torch.cuda.get_device_name()``), or None."""
    name = device_name.lower()
    for pattern, key in _PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def lookup_peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype`` (bf16/fp16/tf32/fp8/fp32), or None if unknown."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}.")
    key = device_key(device_name)
    if key is None:
        return None
    return PEAK_FLOPS[key].get(dtype)


def peak_flops_from_env() -> float | None:
    """``FSDP_STRATEGIES_PEAK_FLOPS`` as FLOP/s, or None when unset; a bad value raises naming the
    variable."""
    raw = os.environ.get(PEAK_FLOPS_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(
            f"{PEAK_FLOPS_ENV}={raw!r} is not a positive number. Fix: set it to the dense peak FLOP/s of one "
            "device, e.g. 989e12 for an H100 SXM in bf16, or unset it."
        )
    return value
