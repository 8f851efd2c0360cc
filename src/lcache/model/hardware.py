"""Accelerator peaks used to turn FLOPs into step time, each from its vendor datasheet.

Peaks are *dense* (no 2:4 sparsity), SXM parts. Model FLOP utilisation (MFU, Chowdhery et al.
2022, PaLM appendix B) is applied on top: achieved = peak x MFU.
"""

from __future__ import annotations

from dataclasses import dataclass

from lcache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator kind.

    Attributes:
        name: short name (``h100``).
        bf16_flops: dense BF16 peak, FLOP/s.
        fp8_flops: dense FP8 peak, FLOP/s; ``None`` where the part has no FP8 tensor cores.
        hbm_bytes: device memory in bytes.
        source: the datasheet the numbers come from.
    """

    name: str
    bf16_flops: float
    fp8_flops: float | None
    hbm_bytes: int
    source: str

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for ``bf16`` or ``fp8`` compute."""
        if precision == "fp8":
            if self.fp8_flops is None:
                raise ConfigError(f"{self.name} has no FP8 tensor cores; use --precision bf16 "
                                  "or give --peak-tflops")
            return self.fp8_flops
        return self.bf16_flops


# The datasheets print sparse figures with an asterisk ("1,979 TFLOPS*" BF16 on H100 SXM is
# with sparsity); the dense figure is half of it.
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 989.4e12, 1978.9e12, 80 * 10**9,
                    "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: BF16 1,979 / FP8 3,958 "
                    "TFLOPS with sparsity, 80 GB HBM3"),
    "h200": GpuSpec("h200", 989.4e12, 1978.9e12, 141 * 10**9,
                    "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: BF16 1,979 / FP8 3,958 "
                    "TFLOPS with sparsity, 141 GB HBM3e"),
    "a100": GpuSpec("a100", 312e12, None, 80 * 10**9,
                    "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM: BF16 312 TFLOPS "
                    "dense (624 with sparsity), no FP8, 80 GB HBM2e"),
}


def get_gpu(name: str) -> GpuSpec:
    """The accelerator named ``name``; the error lists those there are."""
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown GPU kind {name!r}; choose one of {', '.join(GPUS)} or give "
                          "peak_flops (--peak-tflops) and hbm_bytes") from None
