"""The one table of rules: stable id -> check function. Disable or re-threshold a rule by id:
``ampdoctor.diagnose(path, rules={"grad-underflow": {"min_share": 0.05}, "amp-inactive": None})``."""

from __future__ import annotations

from . import (
    anomaly,
    clipping,
    convergence,
    divergence,
    division,
    dynamics,
    fp8,
    fsdp,
    lossfn,
    overflow,
    policy,
    precision,
    ranks,
    scaling,
    throughput,
    underflow,
    validation,
    weights,
)
from .result import Rule, suppressed_by

RULES = {
    r.id: r
    for r in (
        Rule("divergence", divergence.divergence, "the optimisation blew up (learning rate), not the loss scale"),
        Rule(
            "init-scale-too-high",
            scaling.init_scale_too_high,
            "NaN/skipped steps early: the initial loss scale",
            suppressed_by=suppressed_by("divergence")  # the skips follow the blow-up, not the start value
            + suppressed_by("loss-nonfinite", when=lossfn.skips_from_loss),
        ),
        Rule(
            "forward-overflow",
            overflow.forward_overflow,
            "a module produced Inf/NaN in the forward pass",
            suppressed_by=suppressed_by("divergence", when=overflow.after_blowup)
            + suppressed_by("division-by-zero", when=division.same_module)
            + suppressed_by("outlier-batch", when=anomaly.within_steps),  # the batch, not the layer
        ),
        Rule(
            "outlier-batch",
            anomaly.outlier_batch,
            "one batch far beyond the usual inputs made a NaN/Inf or a spike",
            suppressed_by=suppressed_by("loss-scale-collapse", when=anomaly.batches_collapsed_scale),
        ),
        Rule("loss-spike", anomaly.loss_spike, "a finite loss or gradient-norm spike: the layers that jumped, and why"),
        Rule("healed", anomaly.healed, "heal=True kept a module in FP32 during the run"),
        Rule(
            "division-by-zero",
            division.division_by_zero,
            "NaN/Inf from a denominator the format rounded to 0 (a normalisation's eps lost)",
            suppressed_by=suppressed_by("divergence"),
        ),
        Rule(
            "loss-nonfinite",
            lossfn.loss_nonfinite,
            "the loss function produced NaN/Inf from finite model outputs",
            suppressed_by=suppressed_by("divergence"),
        ),
        Rule(
            "loss-scale-collapse",
            scaling.loss_scale_collapse,
            "the loss scale falls without recovery",
            suppressed_by=suppressed_by("divergence")  # a diverged run's scale falls because its values blew up
            + suppressed_by("loss-nonfinite", when=lossfn.collapse_from_loss)
            + suppressed_by("division-by-zero", when=division.same_module),
        ),
        Rule(
            "grad-underflow",
            underflow.grad_underflow,
            "gradients lost to FP16 underflow",
            suppressed_by=suppressed_by("divergence")  # a diverged run's gradients say nothing about its precision
            + suppressed_by("forward-overflow", when=underflow.scale_fell),
        ),
        Rule("clip-before-unscale", clipping.clip_before_unscale, "gradient clipping applied to the scaled gradients"),
        Rule(
            "weights-nonfinite",
            weights.weights_nonfinite,
            "the optimizer step turned weights NaN/Inf",
            suppressed_by=suppressed_by("divergence", when=weights.eps_not_lost),
        ),
        Rule("weight-update-lost", weights.weight_update_lost, "half-precision weights swallow small updates"),
        Rule("grad-range-anomaly", weights.grad_range_anomaly, "a layer's gradients orders of magnitude off"),
        Rule("precision-policy", policy.precision_policy, "loss/normalisation/softmax computed in half precision"),
        Rule("amp-inactive", policy.amp_inactive, "AMP intended but not active"),
        Rule("fsdp-reduce-dtype", fsdp.fsdp_reduce_dtype, "FSDP reduces the gradients in half precision"),
        Rule("fsdp-fp16-scaler", fsdp.fsdp_fp16_scaler, "FSDP computes in FP16 without a ShardedGradScaler"),
        Rule("input-pipeline-bound", throughput.input_pipeline_bound, "data wait dominates the step time"),
        Rule("late-degradation", dynamics.late_degradation, "a late loss trend break a loss-scaler dynamic explains"),
        Rule("val-oscillation", validation.val_oscillation, "a validation metric oscillates beyond its trend"),
        Rule(
            "slow-convergence",
            convergence.slow_convergence,
            "slower than a reference run with nothing numeric to blame",
            suppressed_by=suppressed_by("grad-underflow", when=convergence.material)
            + suppressed_by("clip-before-unscale"),  # a higher learning rate does not undo 1/scale
        ),
        Rule("precision-loss", precision.precision_loss, "a layer loses more precision than its size explains"),
        Rule(
            "fp16-readiness",
            underflow.fp16_readiness,
            "an FP32/BF16 run: would it survive FP16?",
            suppressed_by=suppressed_by("divergence"),  # a diverged run would not train in any format
        ),
        Rule(
            "fp8-readiness",
            fp8.fp8_readiness,
            "which layers FP8 with delayed scaling would lose, which recipe keeps them",
            suppressed_by=suppressed_by("divergence"),  # a blown-up run says nothing about FP8's ranges
        ),
        Rule("rank-nonfinite", ranks.rank_nonfinite, "NaN/Inf produced on some ranks only", scope="ranks"),
        Rule("rank-scale-divergence", ranks.rank_scale_divergence, "the ranks' loss scales part ways", scope="ranks"),
        Rule(
            "rank-straggler", ranks.rank_straggler, "one rank's steps or data wait hold the others back", scope="ranks"
        ),
    )
}
