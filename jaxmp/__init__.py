"""jaxmp: functional mixed precision for JAX.

Precision policies, loss scales, and loss scaling and FP32 master weights as
optax transformations; for less memory, stochastic rounding or Kahan summation of
half-precision params and compressed optimizer states; post-training quantisation (int8,
FP8, int4) for inference.
"""

from jaxmp._src import flax_hooks as _flax_hooks  # noqa: F401 (registers the Flax stand-ins)
from jaxmp._src.attention import dot_product_attention
from jaxmp._src.autocast import (
    FLOAT32_OPS,
    LOW_PRECISION_OPS,
    Autocast,
    autocast,
    autocast_jaxpr,
    float32_region,
)
from jaxmp._src.casting import cast_to_full, cast_to_half, cast_tree
from jaxmp._src.compress_state import CompressedLeaf, CompressStateState, compress_state
from jaxmp._src.distributed import pmean_in_float32, psum_in_float32, state_shardings
from jaxmp._src.dtypes import dtype_to_names, half_dtype
from jaxmp._src.fp8 import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8State,
    MXFP8BlockScaling,
)
from jaxmp._src.fp8_autocast import Float8Autocast, Float8Matmul
from jaxmp._src.grad import filter_value_and_grad, value_and_grad
from jaxmp._src.inspector import Inspect, LossScaleSuggestion, OpStats, Report, inspect
from jaxmp._src.kahan_summation import KahanSummationState, kahan_summation
from jaxmp._src.loss_scale import (
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxmp._src.loss_scale_plot import plot_loss_scale
from jaxmp._src.loss_scaling import LossScalingState, loss_scaling
from jaxmp._src.master_weights import MasterWeightsState, master_weights
from jaxmp._src.mixed_precision import default_loss_scale, mixed_precision
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.quantization.calibrate import calibrate
from jaxmp._src.quantization.kv_cache import KVCache
from jaxmp._src.quantization.plan import QuantizedLeaf, quantization_plan, quantize
from jaxmp._src.quantization.qat import QuantizationAware, quantization_aware
from jaxmp._src.quantization.recipes import (
    Float8Rowwise,
    Int4WeightOnly,
    Int8DynamicActivations,
    Int8WeightOnly,
    QuantizedArray,
)
from jaxmp._src.quantization.rules import Quantized, quantized
from jaxmp._src.state import (
    get_loss_scale,
    inner_state,
    loss_scale_metrics,
    schedule_free_eval_params,
)
from jaxmp._src.stochastic_rounding import (
    StochasticRoundingState,
    stochastic_round,
    stochastic_rounding,
)
from jaxmp._src.tree import all_finite, select_tree

__version__ = "0.1.0"


def __getattr__(name: str):
    # `jaxmp.linen` and `jaxmp.nnx` import flax; load them only when asked for. (Not with
    # `from jaxmp import ...`: that asks this function again.)
    if name == "linen":
        import jaxmp.linen

        return jaxmp.linen
    if name == "nnx":
        import jaxmp.nnx

        return jaxmp.nnx
    raise AttributeError(f"module 'jaxmp' has no attribute {name!r}")


__all__ = (
    "FLOAT32_OPS",
    "LOW_PRECISION_OPS",
    "Autocast",
    "CompressStateState",
    "CompressedLeaf",
    "autocast",
    "autocast_jaxpr",
    "float32_region",
    "DelayedScaling",
    "Float8Autocast",
    "Float8Matmul",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8State",
    "MXFP8BlockScaling",
    "DynamicLossScale",
    "KahanSummationState",
    "LossScale",
    "LossScalingState",
    "MasterWeightsState",
    "NoOpLossScale",
    "Policy",
    "Float8Rowwise",
    "Int4WeightOnly",
    "Int8DynamicActivations",
    "Int8WeightOnly",
    "KVCache",
    "QuantizationAware",
    "Quantized",
    "QuantizedArray",
    "QuantizedLeaf",
    "calibrate",
    "quantization_aware",
    "quantization_plan",
    "quantize",
    "quantized",
    "StaticLossScale",
    "StochasticRoundingState",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "cast_tree",
    "compress_state",
    "default_loss_scale",
    "dot_product_attention",
    "dtype_to_names",
    "filter_value_and_grad",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "Inspect",
    "LossScaleSuggestion",
    "OpStats",
    "Report",
    "inspect",
    "inner_state",
    "kahan_summation",
    "loss_scale_metrics",
    "loss_scaling",
    "master_weights",
    "mixed_precision",
    "plot_loss_scale",
    "pmean_in_float32",
    "psum_in_float32",
    "schedule_free_eval_params",
    "select_tree",
    "state_shardings",
    "stochastic_round",
    "stochastic_rounding",
    "value_and_grad",
)
