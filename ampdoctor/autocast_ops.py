"""Which operations autocast runs in which dtype, per device: the op lists of torch's "Autocast Op Reference"
(torch.amp documentation: "CUDA Ops that can autocast to float16 / to float32 / that promote to the widest input
type", "CPU Ops that can autocast to lower precision / to float32"), as data. The rules read what a run actually did
(the dtype each observed module output had, the dtype each replayed operation produced); these lists say what the
same code does on another device: the CPU leaves exp, softmax, log, pow and layer_norm in the input's dtype, where
CUDA computes them in FP32, so a fault seen on one device may not exist on the other.

tests/test_autocast_ops.py checks the CPU lists against real CPU autocast on this machine; benchmarks/device_check.py
checks the CUDA lists on a GPU.
"""

from __future__ import annotations

# CUDA: computed in the autocast dtype (float16 or bfloat16).
CUDA_LOWER = frozenset(
    """__matmul__ addbmm addmm addmv addr baddbmm bmm chain_matmul multi_dot conv1d conv2d conv3d conv_transpose1d
    conv_transpose2d conv_transpose3d GRUCell linear LSTMCell matmul mm mv prelu RNNCell""".split()
)
# CUDA: computed in float32 whatever the input's dtype.
CUDA_FP32 = frozenset(
    """__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin binary_cross_entropy_with_logits cosh cosine_embedding_loss
    cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp expm1 group_norm hinge_embedding_loss kl_div
    l1_loss layer_norm log log_softmax log10 log1p log2 margin_ranking_loss mse_loss multilabel_margin_loss
    multi_margin_loss nll_loss norm normalize pdist poisson_nll_loss pow prod reciprocal rsqrt sinh smooth_l1_loss
    soft_margin_loss softmax softmin softplus sum renorm tan triplet_margin_loss""".split()
)
# CUDA: computed in the widest of the inputs' dtypes.
CUDA_PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot grid_sample index_put scatter_add tensordot".split())
# CPU: computed in the autocast dtype (bfloat16 by default, float16 when asked).
CPU_LOWER = frozenset(
    """conv1d conv2d conv3d bmm mm linalg_vecdot baddbmm addmm addbmm linear _convolution matmul conv_tbc
    mkldnn_rnn_layer conv_transpose1d conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention
    _native_multi_head_attention""".split()
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
    linalg_svd linalg_eig linalg_eigh linalg_lstsq linalg_inv_ex""".split()
)

LISTS = {
    "cuda": {"lower": CUDA_LOWER, "float32": CUDA_FP32, "promote": CUDA_PROMOTE},
    "cpu": {"lower": CPU_LOWER, "float32": CPU_FP32, "promote": frozenset()},
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
