"""Which operations autocast runs in which dtype, per device: the op lists of torch's "Autocast Op Reference"
(torch.amp documentation: "CUDA Ops that can autocast to float16 / to float32 / that promote to the widest input
type", "CPU Ops that can autocast to lower precision / to float32"), as data. The rules read what a run actually did
(the dtype each observed module output had, the dtype each replayed operation produced); these lists say what the
same code does on another device: the CPU leaves exp, softmax, log, pow and layer_norm in the input's dtype, where
CUDA computes them in FP32, so a fault seen on one device may not exist on the other.

The lists hold the documentation's names and the aten names torch registers autocast kernels under (the names a
replay's dispatch mode sees). ``SAMPLES`` calls one op each, as data (expressions, evaluated by ``observe`` with torch
imported there: this module is on the offline side); ``observe`` runs a sample under a device's autocast and says
which rule the output dtypes show, ``check`` compares every sample with the lists. tests/test_autocast_ops.py runs
``check`` on the CPU and checks that every op torch registers an autocast kernel for (CPU and CUDA) is on a list;
benchmarks/device_check.py runs ``check`` on a GPU.
"""

from __future__ import annotations

import re

# CUDA: computed in the autocast dtype (float16 or bfloat16). The second line: aten names of the same ops and those
# torch registers beyond the documentation (torch 2.13).
CUDA_LOWER = frozenset(
    """__matmul__ addbmm addmm addmv addr baddbmm bmm chain_matmul multi_dot conv1d conv2d conv3d conv_transpose1d
    conv_transpose2d conv_transpose3d GRUCell linear LSTMCell matmul mm mv prelu RNNCell
    _convolution convolution conv_tbc cudnn_convolution cudnn_convolution_transpose einsum linalg_vecdot
    linalg_multi_dot _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention""".split()
)
# CUDA: computed in float32 whatever the input's dtype.
CUDA_FP32 = frozenset(
    """__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin binary_cross_entropy_with_logits cosh cosine_embedding_loss
    cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp expm1 group_norm hinge_embedding_loss kl_div
    l1_loss layer_norm log log_softmax log10 log1p log2 margin_ranking_loss mse_loss multilabel_margin_loss
    multi_margin_loss nll_loss norm normalize pdist poisson_nll_loss pow prod reciprocal rsqrt sinh smooth_l1_loss
    soft_margin_loss softmax softmin softplus sum renorm tan triplet_margin_loss
    native_layer_norm rms_norm frobenius_norm nuclear_norm linalg_vector_norm linalg_matrix_norm logsumexp nll_loss2d
    huber_loss upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d _upsample_nearest_exact2d
    upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d _upsample_bilinear2d_aa
    upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""".split()
)
# CUDA: computed in the widest of the inputs' dtypes.
CUDA_PROMOTE = frozenset(
    "addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot vdot grid_sampler".split()
)
# CUDA: refused under autocast (an error that names binary_cross_entropy_with_logits instead).
CUDA_BANNED = frozenset(["binary_cross_entropy"])
# CPU: computed in the autocast dtype (bfloat16 by default, float16 when asked).
CPU_LOWER = frozenset(
    """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear _convolution matmul conv_tbc
    mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
    _native_multi_head_attention _addmm_activation""".split()
)
# CPU: computed in float32.
CPU_FP32 = frozenset(
    """avg_pool3d binary_cross_entropy grid_sampler polar prod quantile nanquantile stft cdist trace
    view_as_complex cholesky cholesky_inverse cholesky_solve inverse lu_solve orgqr ormqr pinverse max_pool3d
    max_unpool2d max_unpool3d adaptive_avg_pool3d reflection_pad1d reflection_pad2d replication_pad1d
    replication_pad2d replication_pad3d mse_loss cosine_embedding_loss nll_loss nll_loss2d hinge_embedding_loss
    poisson_nll_loss smooth_l1_loss cross_entropy_loss l1_loss huber_loss margin_ranking_loss soft_margin_loss
    triplet_margin_loss multi_margin_loss ctc_loss kl_div multilabel_margin_loss binary_cross_entropy_with_logits
    fft_fft fft_ifft fft_fft2 fft_ifft2 fft_fftn fft_ifftn fft_rfft fft_irfft fft_rfft2 fft_irfft2 fft_rfftn
    fft_irfftn fft_hfft fft_ihfft linalg_cond linalg_matrix_rank linalg_solve linalg_cholesky linalg_svdvals
    linalg_eigvals linalg_eigvalsh linalg_inv linalg_householder_product linalg_tensorinv linalg_tensorsolve
    fake_quantize_per_tensor_affine geqrf _lu_with_info qr svd triangular_solve fractional_max_pool2d
    fractional_max_pool3d adaptive_max_pool3d multilabel_margin_loss_forward linalg_qr linalg_cholesky_ex
    linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex grid_sampler_2d grid_sampler_3d
    _grid_sampler_2d_cpu_fallback""".split()
)
# CPU: computed in the widest of the inputs' dtypes.
CPU_PROMOTE = frozenset("stack cat index_copy".split())

LISTS = {
    "cuda": {"lower": CUDA_LOWER, "float32": CUDA_FP32, "promote": CUDA_PROMOTE},
    "cpu": {"lower": CPU_LOWER, "float32": CPU_FP32, "promote": CPU_PROMOTE},
}


def short_name(op: str) -> str:
    """``aten::exp`` or ``aten::log_softmax.int`` -> ``exp`` / ``log_softmax``."""
    return op.rsplit("::", 1)[-1].split(".")[0]


def autocast_rule(op: str, device_type: str) -> str | None:
    """How autocast treats ``op`` on ``device_type``: "lower" (the autocast dtype), "float32", "promote", or None
    (not on the device's lists: it runs in the dtype of its inputs)."""
    lists = LISTS.get(device_type)
    if lists is None:
        return None
    name = short_name(op)
    for rule, ops in lists.items():
        if name in ops:
            return rule
    return None


def computes_in_float32_on(op: str, device_type: str) -> bool:
    """Whether autocast runs ``op`` in float32 on ``device_type`` (so an overflow of its half-precision output seen on
    another device would not happen there)."""
    return autocast_rule(op, device_type) == "float32"


# -- observing the rules on a device ----------------------------------------------------------------------------------
# One call per op, as data: an expression over x (4 x 8, in the dtype under test), w (8 x 8, x's dtype), y (4 x 8,
# float32 in a mixed-dtype call: the second input of the "promote" ops), i (4 int64 indices), torch and F
# (torch.nn.functional). The op is what the expression dispatches first (no sample decomposes into a listed op: einsum
# or tensordot would show mm's rule). "promote" is observable only on ops that refuse mixed dtypes without autocast
# (addcmul, cat promote by themselves), so those are the ones sampled.
SAMPLES = {
    # on the lower-precision lists
    "mm": "torch.mm(x, w)",
    "bmm": "torch.bmm(x[None], w[None])",
    "addmm": "torch.addmm(x[:, :8] * 0, x, w)",
    "baddbmm": "torch.baddbmm((x[:, :8] * 0)[None], x[None], w[None])",
    "addbmm": "torch.addbmm(x[:, :8] * 0, x[None], w[None])",
    "matmul": "torch.matmul(x, w)",
    "linear": "F.linear(x, w)",
    "conv1d": "F.conv1d(x[None], w[:2, :4, None].expand(2, 4, 3).contiguous())",
    "conv2d": "F.conv2d(x[None, None], w[None, None, :3, :3])",
    "conv_transpose1d": "F.conv_transpose1d(x[None], w[:4, :2, None])",
    "prelu": "F.prelu(x, w[0, :1])",
    "addmv": "torch.addmv(x[:, 0], x, w[:, 0])",
    "addr": "torch.addr(w, w[0], w[1])",
    "mv": "torch.mv(x, w[:, 0])",
    "linalg_vecdot": "torch.linalg.vecdot(x, x)",
    "scaled_dot_product_attention": "F.scaled_dot_product_attention(x[None], x[None], x[None])",
    # on the float32 lists
    "mse_loss": "F.mse_loss(x, x * 0.5)",
    "l1_loss": "F.l1_loss(x, x * 0.5)",
    "huber_loss": "F.huber_loss(x, x * 0.5)",
    "nll_loss": "F.nll_loss(x, i)",
    "kl_div": "F.kl_div(x, x.abs(), reduction='batchmean')",
    "cdist": "torch.cdist(x, x)",
    "prod": "torch.prod(x, dim=1)",
    "binary_cross_entropy_with_logits": "F.binary_cross_entropy_with_logits(x, x.sigmoid())",
    # float32 on CUDA, the input's dtype on the CPU
    "exp": "torch.exp(x)",
    "log": "torch.log(x.abs() + 1)",
    "pow": "torch.pow(x, 2)",
    "rsqrt": "torch.rsqrt(x.abs() + 1)",
    "softmax": "torch.softmax(x, -1)",
    "log_softmax": "torch.log_softmax(x, -1)",
    "logsumexp": "torch.logsumexp(x, -1)",
    "softplus": "F.softplus(x)",
    "layer_norm": "F.layer_norm(x, (8,))",
    "group_norm": "F.group_norm(x, 2)",
    "rms_norm": "F.rms_norm(x, (8,))",
    "sum": "x.sum(-1)",
    "cumsum": "torch.cumsum(x, -1)",
    "linalg_vector_norm": "torch.linalg.vector_norm(x)",
    "cosine_similarity": "F.cosine_similarity(x, x * 0.5)",
    "upsample_nearest1d": "F.interpolate(x[None], scale_factor=2.0)",
    # on no list: the input's dtype on both devices
    "relu": "torch.relu(x)",
    "gelu": "F.gelu(x)",
    "tanh": "torch.tanh(x)",
    "sigmoid": "torch.sigmoid(x)",
    "add": "torch.add(x, x)",
    "amax": "x.amax(-1)",
    # promote on CUDA (mixed dtypes are an error without autocast)
    "dot": "torch.dot(x[0], y[0])",
    "vdot": "torch.vdot(x[0], y[0])",
    "scatter_add": "torch.scatter_add(x, 1, i[:, None].expand(4, 8), y)",
    "index_put": "x.index_put((i,), y)",
    "cross": "torch.cross(x[:, :3], y[:, :3], dim=1)",
    "bilinear": "F.bilinear(x, y, w[None])",
}


def observe(op: str, device_type: str, dtype: str = "bfloat16") -> str | None:
    """Run ``op``'s sample under ``torch.autocast(device_type, dtype)`` and say which rule its output dtypes show:
    "lower" (float32 inputs give ``dtype``), "float32" (``dtype`` inputs give float32), "promote" (a ``dtype`` and a
    float32 input give float32), None (the inputs' dtype: on no list), or "unexpected <dtype>"."""
    import torch
    import torch.nn.functional as F

    low, f32 = getattr(torch, dtype), torch.float32
    expr = SAMPLES[op]

    def run(dx: torch.dtype, dy: torch.dtype) -> torch.dtype:
        g = torch.Generator().manual_seed(0)
        names = {
            "x": torch.randn(4, 8, generator=g).to(device_type, dx),
            "w": torch.randn(8, 8, generator=g).to(device_type, dx),
            "y": torch.randn(4, 8, generator=g).to(device_type, dy),
            "i": torch.tensor([0, 3, 1, 2], device=device_type),
        }
        with torch.autocast(device_type, dtype=low):
            out: torch.dtype = eval(expr, {"torch": torch, "F": F, **names}).dtype
        return out

    wide = run(f32, f32)
    if wide == low:
        return "lower"
    narrow = run(low, low)
    if narrow == f32:
        return "float32"
    if wide != f32 or narrow != low:
        return f"unexpected {str(wide if wide != f32 else narrow).replace('torch.', '')}"
    if re.search(r"\by\b", expr):  # a sample with a second input
        try:
            mixed = run(low, f32)
        except RuntimeError:  # mixed dtypes refused: autocast does not promote it on this device
            return None
        return "promote" if mixed == f32 else f"unexpected {str(mixed).replace('torch.', '')}"
    return None


def check(device_type: str, dtype: str = "bfloat16") -> list[tuple[str, str | None, str | None]]:
    """Every sample observed on the device: (op, the rule the lists give, the rule observed)."""
    return [(op, autocast_rule(op, device_type), observe(op, device_type, dtype)) for op in SAMPLES]
