"""tf_keras's private names (Model Garden's Keras, under TF_USE_LEGACY_KERAS): optimizer slots,
SavedModel traces."""

from __future__ import annotations

from od_dist.patches.base import TF_KERAS, Patch

PATCHES = (
    Patch(
        "optimizer-slots",
        TF_KERAS,
        ("tf_keras.optimizers.legacy:Optimizer._create_all_weights",),
        "calls a Keras 2 optimizer's _create_all_weights (create_optimizer_slots)",
        "slots made before the first step spare a second trace of the whole train loop",
    ),
    Patch(
        "keras-no-traces",
        TF_KERAS,
        ("tf_keras.src.saving.legacy.saved_model.utils:keras_option_scope",),
        "enters tf_keras's keras_option_scope(save_traces=False) (without_keras_traces)",
        "an export is its serving signature; Keras's layer traces halve its speed and its loads'",
    ),
)


def create_optimizer_slots(optimizer, variables) -> None:
    """optimizer-slots: the optimizer's slot variables for `variables`, made now."""
    if hasattr(optimizer, "_create_all_weights"):  # Keras 2's optimizers (Model Garden's default)
        optimizer._create_all_weights(variables)
    elif hasattr(optimizer, "build"):  # Keras 3's
        optimizer.build(variables)


def without_keras_traces():
    """keras-no-traces: a scope in which a SavedModel export skips Keras's layer traces."""
    from tf_keras.src.saving.legacy.saved_model import utils

    return utils.keras_option_scope(save_traces=False)
