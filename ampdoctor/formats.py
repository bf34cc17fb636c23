"""Numeric formats ampdoctor measures against: one table, used everywhere (collector, rules, figures)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Format:
    """Limits of one floating-point format (IEEE-style, round to nearest even)."""

    name: str
    max: float  # largest finite value
    min_normal: float  # smallest positive normal value
    min_subnormal: float  # smallest positive subnormal value
    mantissa_bits: int  # explicit fraction bits
    saturates: bool = False  # torch's cast clamps to +-max instead of giving inf (float8_e4m3fn has no inf)

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

    # Rounding thresholds of a cast to this format (round to nearest, ties to even). Every count of "overflows",
    # "subnormal" or "flushed to zero" uses them, never max / min_normal / min_subnormal as they stand: e.g. FP16
    # rounds 3.5e-8 (in (2^-25, 2^-24)) up to 2^-24 and 65519 down to 65504.
    @property
    def flush_at(self) -> float:
        """|x| <= flush_at rounds to zero: half the smallest subnormal, whose odd mantissa loses the tie to 0."""
        return self.min_subnormal / 2

    @property
    def subnormal_below(self) -> float:
        """flush_at < |x| < subnormal_below rounds to a non-zero subnormal: half a subnormal step below the smallest
        normal (the tie goes to min_normal, whose mantissa is even)."""
        return self.min_normal - self.min_subnormal / 2

    @property
    def overflow_at(self) -> float:
        """Half an ULP above max: the rounding midpoint between max and the next value of its binade's grid."""
        return self.max + self.ulp(self.max) / 2

    @property
    def tie_overflows(self) -> bool:
        """Whether |x| == overflow_at overflows: ties go to the even mantissa, so yes when max's mantissa is odd
        (FP16, BF16, E5M2: all ones), no for E4M3 (max 448 = 1.110b x 2^8, the all-ones mantissa being NaN)."""
        mantissa: int = round((self.max / 2.0**self.max_exp - 1.0) * 2**self.mantissa_bits)
        return mantissa % 2 == 1

    @property
    def finite_limit(self) -> float:
        """The largest float64 magnitude that still rounds to a finite value: x overflows iff |x| > finite_limit."""
        return math.nextafter(self.overflow_at, 0.0) if self.tie_overflows else self.overflow_at

    def overflows(self, a: Any) -> Any:
        """Element-wise (numpy or torch, magnitudes |x|, finite or not): the cast leaves the finite range (inf, or
        for a saturating format the value clamped to max)."""
        return (a >= self.overflow_at) if self.tie_overflows else (a > self.overflow_at)

    def flushes(self, a: Any) -> Any:
        """Element-wise on magnitudes: a non-zero value that the cast rounds to zero."""
        return (a > 0) & (a <= self.flush_at)

    def subnormal(self, a: Any) -> Any:
        """Element-wise on magnitudes: the cast gives a non-zero subnormal (precision lost)."""
        return (a > self.flush_at) & (a < self.subnormal_below)

    def ulp(self, value: float) -> float:
        """Spacing of representable numbers at `value` (for 'update below half an ULP' checks)."""
        a = abs(value)
        if a < self.min_normal:
            return self.min_subnormal
        return 2.0 ** (math.floor(math.log2(a)) - self.mantissa_bits)


FP16 = Format("fp16", 65504.0, 2.0**-14, 2.0**-24, 10)
BF16 = Format("bf16", 3.3895313892515355e38, 2.0**-126, 2.0**-133, 7)
FP32 = Format("fp32", 3.4028234663852886e38, 2.0**-126, 2.0**-149, 23)
FP8_E4M3 = Format("fp8_e4m3", 448.0, 2.0**-6, 2.0**-9, 3, saturates=True)
FP8_E5M2 = Format("fp8_e5m2", 57344.0, 2.0**-14, 2.0**-16, 2)

FORMATS = {f.name: f for f in (FP16, BF16, FP32, FP8_E4M3, FP8_E5M2)}

# torch dtype names (str(dtype) without the "torch." prefix) -> format
DTYPE_FORMATS = {
    "float16": FP16,
    "half": FP16,
    "bfloat16": BF16,
    "float32": FP32,
    "float": FP32,
    "float8_e4m3fn": FP8_E4M3,
    "float8_e5m2": FP8_E5M2,
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
