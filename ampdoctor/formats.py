"""Numeric formats ampdoctor measures against: one table, used everywhere (collector, rules, figures)."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    """Limits of one floating-point format (IEEE-style, round to nearest even)."""

    name: str
    max: float            # largest finite value
    min_normal: float     # smallest positive normal value
    min_subnormal: float  # smallest positive subnormal value
    mantissa_bits: int    # explicit fraction bits

    @property
    def max_exp(self) -> int:
        """Binade of the largest finite value: max lies in [2^max_exp, 2^(max_exp+1))."""
        return math.floor(math.log2(self.max))

    @property
    def normal_exp(self) -> int:
        return round(math.log2(self.min_normal))

    @property
    def subnormal_exp(self) -> int:
        return round(math.log2(self.min_subnormal))

    def ulp(self, value: float) -> float:
        """Spacing of representable numbers at `value` (for 'update below half an ULP' checks)."""
        a = abs(value)
        if a < self.min_normal:
            return self.min_subnormal
        return 2.0 ** (math.floor(math.log2(a)) - self.mantissa_bits)


FP16 = Format("fp16", 65504.0, 2.0**-14, 2.0**-24, 10)
BF16 = Format("bf16", 3.3895313892515355e38, 2.0**-126, 2.0**-133, 7)
FP32 = Format("fp32", 3.4028234663852886e38, 2.0**-126, 2.0**-149, 23)
FP8_E4M3 = Format("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, 3)
FP8_E5M2 = Format("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2)

FORMATS = {f.name: f for f in (FP16, BF16, FP32, FP8_E4M3, FP8_E5M2)}

# torch dtype names (str(dtype) without the "torch." prefix) -> format
DTYPE_FORMATS = {
    "float16": FP16, "half": FP16,
    "bfloat16": BF16,
    "float32": FP32, "float": FP32,
    "float8_e4m3fn": FP8_E4M3, "float8_e5m2": FP8_E5M2,
}

REDUCED = ("float16", "bfloat16")  # the dtypes autocast computes in


def get(name: str) -> Format:
    """Format by name ("fp16", "bf16", ...) or torch dtype name ("float16", "torch.bfloat16")."""
    key = str(name).lower().replace("torch.", "")
    if key in FORMATS:
        return FORMATS[key]
    if key in DTYPE_FORMATS:
        return DTYPE_FORMATS[key]
    raise ValueError(f"Unknown numeric format {name!r}; known: {', '.join(FORMATS)}")
