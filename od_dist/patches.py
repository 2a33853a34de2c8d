"""Every use of a private API of TensorFlow, Orbit, tf_keras and Model Garden, in one place.

Each entry of PATCHES says what it touches, why, and the version of its library it was written
against; the functions below are the only code of od_dist that reaches into those libraries'
private names. `check()` runs at the start of every TensorFlow task (trainer, server, evaluator,
eval, export): when an attribute a patch needs is missing, as after a library upgrade, it ends the
task with one line naming the patch and the installed version (exit 2, INVALID: nothing was
started) instead of letting the patch fail silently mid-run (a renamed `Controller._train_n_steps`
would drop the save on stop, the loop guard and the progress lines without an error). An attribute
that a library sets on its instances (`held`) cannot be seen on the class: `check()` sees its class,
and the patch reads it through `_held`, which ends the task the same way where the instance is first
at hand, before any step (no getattr default: a rename would be other behaviour, not an error).

The libraries are imported inside the functions: od_dist's host side imports this module without
TensorFlow. Not here: `sys._getframe` (host/console.py), the standard library's own and documented.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import os
import sys
from dataclasses import dataclass

from od_dist.protocol import exit_codes

# The distributions whose versions the patches were written against (pip show).
TENSORFLOW = ("tensorflow", "2.20.0")
MODEL_GARDEN = ("tf-models-official", "2.20.0")  # Model Garden (official.*), and Orbit with it
TF_KERAS = ("tf_keras", "2.20.1")


@dataclass(frozen=True)
class Patch:
    name: str
    library: tuple[str, str]  # (distribution, the version it was written against)
    needs: tuple[str, ...]  # "module:attribute.attribute": what must exist
    touches: str
    why: str
    held: tuple[str, ...] = ()  # "module:Class.attribute" set on instances: its class checked by check()


PATCHES = (
    Patch(
        "orbit-quiet-log",
        MODEL_GARDEN,
        ("orbit.controller:_log",),
        "rebinds orbit.controller's module-level _log (quiet_orbit_log)",
        "orbit prints each loop's and evaluation's whole output dict; od-dist's one-line progress and "
        "eval lines say it, so those dicts go to the absl INFO log only",
    ),
    Patch(
        "orbit-train-loop",
        MODEL_GARDEN,
        ("orbit:Controller._train_n_steps",),
        "overrides orbit.Controller._train_n_steps (task/controller.py)",
        "the one hook around each training loop: progress line, loop guard, stop with a checkpoint "
        "at the loop boundary, the last-loop callback",
    ),
    Patch(
        "orbit-save-now",
        MODEL_GARDEN,
        ("orbit:Controller._sync_on_async_checkpointing",),
        "reads and sets Controller._checkpoint_options, calls _sync_on_async_checkpointing (save_now, "
        "save_io_on, sync_saves)",
        "a stop saves a checkpoint at once, with the options and the async wait orbit's own save uses",
        held=("orbit:Controller._checkpoint_options",),
    ),
    Patch(
        "checkpoint-next-save",
        TENSORFLOW,
        (),
        "sets CheckpointManager._last_checkpoint_step (count_saves_from)",
        "a multi_worker_mirrored worker restored from model_dir (not its own folder) counts its next "
        "save from that step, as the master does: saves are collective",
        held=("tensorflow:train.CheckpointManager._last_checkpoint_step",),
    ),
    Patch(
        "checkpoint-chosen",
        TENSORFLOW,
        (),
        "sets CheckpointManager._latest_checkpoint (restore_from)",
        "`eval --checkpoint`: the Controller restores the checkpoint asked for as it starts, in its "
        "one restore, and says so, rather than the latest first",
        held=("tensorflow:train.CheckpointManager._latest_checkpoint",),
    ),
    Patch(
        "coco-per-class",
        MODEL_GARDEN,
        ("official.vision.evaluation.coco_evaluator:COCOEvaluator._retrieve_per_category_metrics",),
        "sets a COCOEvaluator's _per_category_metrics and _retrieve_per_category_metrics (per_class_from)",
        "Model Garden's per-category metrics read an attribute only a patched pycocotools has and give "
        "nothing with the stock one: od-dist's per-class AP (model/metrics.py) goes in their place",
        held=("official.vision.evaluation.coco_evaluator:COCOEvaluator._per_category_metrics",),
    ),
    Patch(
        "orbit-first-loop",
        MODEL_GARDEN,
        ("orbit:Controller._maybe_save_checkpoint",),
        "overrides orbit.Controller._maybe_save_checkpoint (task/controller.py)",
        "the one-step first loop of a start is not saved, as orbit would when nothing is saved yet: "
        "the saves fall on the steps_per_loop grid as before",
    ),
    Patch(
        "local-initial-values",
        TENSORFLOW,
        (
            "tensorflow.python.distribute.collective_all_reduce_strategy:"
            "CollectiveAllReduceExtended._get_variable_creator_initial_value",
            "tensorflow.python.distribute.mirrored_strategy:MirroredExtended._get_variable_creator_initial_value",
        ),
        "sets a MultiWorkerMirroredStrategy's extended._get_variable_creator_initial_value for a while "
        "(local_initial_values)",
        "each variable's initial value broadcast from the chief in a collective of its own (614 for "
        "the demo, 3.5-4.5 s of a core at every start) is replaced by one broadcast of the checkpoint's "
        "variables when training starts at step 0 or a trainer's folder is behind (task/controller.py); "
        "trainers that all hold the step restore their own copies",
    ),
    Patch(
        "optimizer-slots",
        TF_KERAS,
        ("tf_keras.optimizers.legacy:Optimizer._create_all_weights",),
        "calls a Keras 2 optimizer's _create_all_weights (create_optimizer_slots)",
        "slots made before the first step spare a second trace of the whole train loop",
    ),
    Patch(
        "sync-on-read-reads",
        TENSORFLOW,
        (
            "tensorflow.python.distribute.values:SyncOnReadVariable._get_cross_replica",
            "tensorflow.python.distribute.values:SyncOnReadVariable._get_on_device_or_primary",
        ),
        "rebinds SyncOnReadVariable._get_cross_replica for a while (replica_copies_read, "
        "reading_batch_norm_once)",
        "batch-norm statistics read while the model is built, and for each save, take one batched "
        "all-reduce (or none) instead of one collective per variable",
    ),
    Patch(
        "strategy-resolver",
        TENSORFLOW,
        (),
        "reads a ParameterServerStrategy's _cluster_resolver (cluster_resolver)",
        "which trainer this is and how many parameter_server workers run the steps: its public "
        "cluster_resolver is None (TensorFlow's looks on the strategy's extended, as 2.20 sets it for "
        "multi_worker_mirrored only)",
        held=("tensorflow:distribute.experimental.ParameterServerStrategy._cluster_resolver",),
    ),
    Patch(
        "trainer-is-async",
        MODEL_GARDEN,
        (),
        "reads Model Garden's Trainer._is_async (is_async)",
        "parameter_server: each loop is spread over every worker only when it runs asynchronously",
        held=("official.core.base_trainer:Trainer._is_async",),
    ),
    Patch(
        "orbit-train-iterator",
        MODEL_GARDEN,
        (),
        "sets orbit.StandardTrainer._train_iter to None (fresh_train_iterators)",
        "parameter_server: a loop that ended on a worker's input iterator TensorFlow cancelled (a step "
        "aborted by a transient ps error, retried on that iterator) goes on with new iterators, which "
        "orbit makes from its train dataset when it holds none",
        held=("orbit:StandardTrainer._train_iter",),
    ),
    Patch(
        "checkpoint-state",
        TENSORFLOW,
        ("tensorflow:__internal__.train.update_checkpoint_state",),
        "calls tf.__internal__.train.update_checkpoint_state (update_checkpoint_state)",
        "a model_dir's checkpoint file names a complete checkpoint that a save left unnamed",
    ),
    Patch(
        "communication-options",
        TENSORFLOW,
        (),
        "merges into a strategy's extended._communication_options (merge_communication_options)",
        "--all_reduce_packs: the pack size is known only once the model is built, after the strategy",
        held=(
            "tensorflow.python.distribute.collective_all_reduce_strategy:"
            "CollectiveAllReduceExtended._communication_options",
        ),
    ),
    Patch(
        "model-garden-all-reduce",
        MODEL_GARDEN,
        (
            "official.common.distribute_utils:_collective_communication",
            "official.common.distribute_utils:_mirrored_cross_device_ops",
        ),
        "calls distribute_utils._collective_communication and _mirrored_cross_device_ops",
        "runtime.all_reduce_alg/num_packs mean what they mean in Model Garden's own strategies",
    ),
    Patch(
        "moving-average-inner",
        MODEL_GARDEN,
        (),
        "reads Model Garden's ExponentialMovingAverage._optimizer (inner_optimizer)",
        "--all_reduce_dtype sets the gradient aggregator of the optimizer that all-reduces",
        held=("official.modeling.optimization:ExponentialMovingAverage._optimizer",),
    ),
    Patch(
        "eager-executor",
        TENSORFLOW,
        (
            "tensorflow.python.eager.context:executor_scope",
            "tensorflow.python.eager.executor:new_executor",
        ),
        "runs remote ops under a new eager executor (own_executor)",
        "a failed remote op poisons the executor it ran in: each server's stop marker gets its own",
    ),
    Patch(
        "registered-experiments",
        MODEL_GARDEN,
        ("official.core.exp_factory:_REGISTERED_CONFIGS",),
        "reads exp_factory._REGISTERED_CONFIGS (registered_experiments)",
        "the list of detection experiments `pipeline` commands offer; Model Garden has no public one",
    ),
    Patch(
        "centernet-gather",
        MODEL_GARDEN,
        ("official.projects.centernet.ops.loss_ops:get_batch_predictions_from_indices",),
        "rebinds loss_ops.get_batch_predictions_from_indices (gather_centernet_inside)",
        "CenterNet's loss gathers padding at index -1: zeros on GPUs, InvalidArgumentError on a CPU",
    ),
    Patch(
        "tflite-no-background",
        MODEL_GARDEN,
        (
            "official.vision.modeling.layers.detection_generator:_generate_detections_tflite_implements_signature",
        ),
        "rebinds detection_generator._generate_detections_tflite_implements_signature for an export "
        "(tflite_without_background)",
        "Model Garden gives TFLite's detection op every score column, its background too, which "
        "RetinaNet scores high everywhere; one class fewer makes the op skip it (its label offset), "
        "as Model Garden's own NMS does and as the Object Detection API's TFLite models count classes",
    ),
    Patch(
        "keras-without-pandas",
        TF_KERAS,
        ("tf_keras.src.engine.data_adapter:pd",),
        "imports TensorFlow (and the tf_keras it loads) with pandas hidden, so that tf_keras's "
        "data_adapter's optional pandas is None (import_tensorflow)",
        "pandas is there only for Model.fit on DataFrames, which od-dist never calls: 0.3-0.5 s of "
        "every task's start",
    ),
    Patch(
        "keras-no-traces",
        TF_KERAS,
        ("tf_keras.src.saving.legacy.saved_model.utils:keras_option_scope",),
        "enters tf_keras's keras_option_scope(save_traces=False) (without_keras_traces)",
        "an export is its serving signature; Keras's layer traces halve its speed and its loads'",
    ),
)


def _missing(need: str) -> bool:
    module_name, _, path = need.partition(":")
    try:
        value = importlib.import_module(module_name)
    except ImportError:
        return True
    for part in path.split("."):
        if not hasattr(value, part):
            return True
        value = getattr(value, part)
    return False


def installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _line(patch: Patch, need: str) -> str:
    distribution, written_for = patch.library
    return (
        f"od-dist: patch '{patch.name}' needs {need.replace(':', '.')}, missing in "
        f"{distribution} {installed(distribution)} (written against {written_for}); install "
        f"{distribution}=={written_for}, or update od_dist/patches.py; exit {exit_codes.INVALID}"
    )


def problems(libraries=None) -> list[str]:
    """One line for each patch (of `libraries`, distribution names; None: all) whose attribute is
    missing here (for a `held` attribute, its class)."""
    found = []
    for patch in PATCHES:
        if libraries is not None and patch.library[0] not in libraries:
            continue
        for need in patch.needs + tuple(h.rsplit(".", 1)[0] for h in patch.held):
            if _missing(need):
                found.append(_line(patch, need))
                break
    return found


def _end(line: str):
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(exit_codes.INVALID)


def check(libraries=None) -> None:
    """At a TensorFlow task's start: ends it with one line and exit 2 (INVALID) when an attribute a
    patch needs is missing (the first such patch)."""
    found = problems(libraries)
    if found:
        _end(found[0])


_ABSENT = object()


def _held(patch_name: str, instance, attribute: str):
    """`instance.attribute`, which patch `patch_name` declares `held`: a missing one ends the task
    with check()'s line and exit 2, here, rather than fail or change what the patch does."""
    value = getattr(instance, attribute, _ABSENT)
    if value is _ABSENT:
        patch = next(p for p in PATCHES if p.name == patch_name)
        _end(_line(patch, next(h for h in patch.held if h.endswith(f".{attribute}"))))
    return value


def check_controller(controller) -> None:
    """orbit-save-now, checkpoint-next-save: an orbit.Controller just made holds what its saves read
    and set later (a stop's save comes mid-run): a renamed one ends the task now, before any step."""
    _held("orbit-save-now", controller, "_checkpoint_options")
    manager = controller.checkpoint_manager
    if manager is not None and manager.checkpoint_interval:  # TensorFlow sets it only then
        _held("checkpoint-next-save", manager, "_last_checkpoint_step")


# ----- orbit ----------------------------------------------------------------------------------


_LOGGED_SAVES: list[str] = []  # folders whose saves orbit-quiet-log sends to the log only


def log_saves_into(folder: str) -> None:
    """orbit-quiet-log: orbit's "saved checkpoint to <folder>/..." goes to the log, not the console."""
    _LOGGED_SAVES.append(os.path.join(folder, ""))


def quiet_orbit_log(to_log) -> None:
    """orbit-quiet-log: orbit's messages that carry an output dict go to `to_log`; the others
    (checkpoint saves and restores) still print."""
    from orbit import controller as orbit_controller

    printing_log = orbit_controller._log
    if getattr(printing_log, "od_dist", False):
        return

    def quiet_train_log(message: str):
        if "| output:" in message:  # train and eval dicts; the eval one is a screenful
            to_log(message)
        elif any(message.startswith(f"saved checkpoint to {folder}") for folder in _LOGGED_SAVES):
            to_log(message)  # a worker's copy in a temporary folder, dropped: the master's line counts
        else:
            printing_log(message)

    quiet_train_log.od_dist = True
    orbit_controller._log = quiet_train_log


def save_now(controller, step: int):
    """orbit-save-now: a checkpoint at `step`, now, as orbit's own save makes it; its path."""
    path = controller.checkpoint_manager.save(
        checkpoint_number=step,
        check_interval=False,
        options=_held("orbit-save-now", controller, "_checkpoint_options"),
    )
    controller._sync_on_async_checkpointing()
    return path


def save_io_on(controller, device: str):
    """orbit-save-now: orbit's saves read and write every file on `device` (its CheckpointOptions),
    and those options, for a restore."""
    import tensorflow as tf

    enable_async = _held("orbit-save-now", controller, "_checkpoint_options").enable_async
    controller._checkpoint_options = tf.train.CheckpointOptions(
        experimental_io_device=device, enable_async=enable_async
    )
    return controller._checkpoint_options


def sync_saves(controller) -> None:
    """orbit-save-now: waits for an asynchronous save (none to save here)."""
    controller._sync_on_async_checkpointing()


# ----- TensorFlow -----------------------------------------------------------------------------


def count_saves_from(manager, step: int) -> None:
    """checkpoint-next-save: `manager` counts its next save's interval from `step`."""
    _held("checkpoint-next-save", manager, "_last_checkpoint_step")
    manager._last_checkpoint_step = step


def restore_from(manager, path: str) -> None:
    """checkpoint-chosen: `manager` restores `path` where it would restore its latest."""
    _held("checkpoint-chosen", manager, "_latest_checkpoint")
    manager._latest_checkpoint = path


def per_class_from(evaluator, compute) -> None:
    """coco-per-class: a COCOEvaluator's per-category metrics are `compute(coco_eval)` (its box
    evaluation; none for masks and keypoints)."""
    _held("coco-per-class", evaluator, "_per_category_metrics")
    evaluator._per_category_metrics = True
    evaluator._retrieve_per_category_metrics = lambda coco_eval, prefix="": (
        {} if prefix else compute(coco_eval)
    )


@contextlib.contextmanager
def replica_copies_read():
    """sync-on-read-reads: while inside, a SyncOnReadVariable read across replicas gives this
    replica's copy rather than all-reducing the copies (trainer.py says when that holds)."""
    from tensorflow.python.distribute import values

    all_reduced = values.SyncOnReadVariable._get_cross_replica
    values.SyncOnReadVariable._get_cross_replica = lambda self: self._get_on_device_or_primary()
    try:
        yield
    finally:
        values.SyncOnReadVariable._get_cross_replica = all_reduced


def reading_batch_norm_once(save, strategy, variables):
    """sync-on-read-reads: ``save`` (a CheckpointManager's), reading the model's batch-norm
    statistics for the checkpoint in one batched all-reduce under multi_worker_mirrored. TensorFlow
    saves a SyncOnReadVariable's mean over the replicas, read eagerly one variable at a time: one
    collective and one new thread pool each, 3.3 s per save for the demo's 256 statistics (about
    0.1 s on one machine). The values saved are the same means."""
    import tensorflow as tf
    from tensorflow.python.distribute import values

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return save
    means = [
        v
        for v in variables
        if isinstance(v, values.SyncOnReadVariable) and v.aggregation == tf.VariableAggregation.MEAN
    ]
    if not means:
        return save

    ids = {id(v) for v in means}

    @functools.wraps(save)
    def saving(*args, **kwargs):
        reduced = {}
        read_one = values.SyncOnReadVariable._get_cross_replica

        def read(var):
            if id(var) not in ids or not tf.executing_eagerly():
                return read_one(var)
            if not reduced:  # the save's first read; every trainer reads in the same order
                pairs = [(v, v) for v in means]
                results = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
                reduced.update(
                    {id(v): strategy.experimental_local_results(r)[0] for v, r in zip(means, results)}
                )
            return reduced[id(var)]

        values.SyncOnReadVariable._get_cross_replica = read
        try:
            return save(*args, **kwargs)
        finally:
            values.SyncOnReadVariable._get_cross_replica = read_one

    return saving


def cluster_resolver(strategy):
    """strategy-resolver: a strategy's cluster resolver (None for one machine's)."""
    import tensorflow as tf

    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        return _held("strategy-resolver", strategy, "_cluster_resolver")
    return strategy.cluster_resolver


def update_checkpoint_state(*args, **kwargs) -> None:
    """checkpoint-state: writes a model_dir's `checkpoint` file (TensorFlow's arguments)."""
    import tensorflow as tf

    tf.__internal__.train.update_checkpoint_state(*args, **kwargs)


def merge_communication_options(dist, options) -> None:
    """communication-options: `options` merged into every all-reduce of `dist` (its options are
    fixed when the strategy is built)."""
    extended = dist.extended
    merged = _held("communication-options", extended, "_communication_options").merge(options)
    extended._communication_options = merged


@contextlib.contextmanager
def own_executor():
    """eager-executor: the ops inside run in a new synchronous eager executor of their own."""
    from tensorflow.python.eager import context
    from tensorflow.python.eager import executor as executor_lib

    with context.executor_scope(executor_lib.new_executor(enable_async=False)):
        yield


# ----- tf_keras -------------------------------------------------------------------------------


def import_tensorflow(keras: bool = True) -> None:
    """keras-without-pandas: imports TensorFlow, and with TF_USE_LEGACY_KERAS the tf_keras it
    loads (Model Garden's Keras), as if pandas were not installed; pandas itself stays importable
    for any other module. `keras` False (a ps or worker server, which runs the functions its
    coordinator sends and no Python model code): without Keras at all, which TensorFlow's import
    then skips: a ps ready in 3.3 s instead of 3.8 s (`benchmarks/startup.py --cases ps`,
    2026-12-02)."""
    if "tensorflow" in sys.modules or "pandas" in sys.modules:
        return
    hidden = ["pandas"] if keras else ["pandas", "tf_keras", "keras"]
    hidden = [name for name in hidden if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import NAME` raises ImportError (the import system's rule)
    try:
        import tensorflow  # noqa: F401
    finally:
        for name in hidden:
            del sys.modules[name]


@contextlib.contextmanager
def local_initial_values(strategy, on: bool = True):
    """local-initial-values: while inside (and `on`), the variables a multi_worker_mirrored
    trainer creates take this trainer's own initial values, as on one machine, without the chief's
    broadcast of each; the caller sets them all to one trainer's before any step (one broadcast, or
    a restore of one save on every trainer), and may end it early (end_local_initial_values)."""
    from tensorflow.python.distribute import collective_all_reduce_strategy, mirrored_strategy

    extended = strategy.extended
    if on and isinstance(extended, collective_all_reduce_strategy.CollectiveAllReduceExtended):
        own = mirrored_strategy.MirroredExtended._get_variable_creator_initial_value
        extended._get_variable_creator_initial_value = functools.partial(own, extended)
    try:
        yield
    finally:
        end_local_initial_values(strategy)


def end_local_initial_values(strategy) -> None:
    """local-initial-values: variables made from now on get TensorFlow's broadcast again."""
    strategy.extended.__dict__.pop("_get_variable_creator_initial_value", None)


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


# ----- Model Garden ---------------------------------------------------------------------------


def collective_communication(all_reduce_alg: str | None):
    """model-garden-all-reduce: Model Garden's CommunicationImplementation for all_reduce_alg."""
    from official.common import distribute_utils

    return distribute_utils._collective_communication(all_reduce_alg)


def mirrored_cross_device_ops(all_reduce_alg: str | None, num_packs: int):
    """model-garden-all-reduce: Model Garden's cross-device ops for all_reduce_alg/num_packs."""
    from official.common import distribute_utils

    return distribute_utils._mirrored_cross_device_ops(all_reduce_alg, num_packs)


def inner_optimizer(optimizer):
    """moving-average-inner: the optimizer Model Garden's moving average wraps, else None."""
    from official.modeling.optimization import ExponentialMovingAverage

    if not isinstance(optimizer, ExponentialMovingAverage):
        return None
    return _held("moving-average-inner", optimizer, "_optimizer")


def is_async(trainer) -> bool:
    """trainer-is-async: whether Model Garden's Trainer runs its loops asynchronously."""
    return bool(_held("trainer-is-async", trainer, "_is_async"))


def check_train_iterator(trainer) -> None:
    """orbit-train-iterator: the trainer holds what fresh_train_iterators sets (it is needed
    mid-run): a renamed one ends the task as its first loop is made, before any step."""
    _held("orbit-train-iterator", trainer, "_train_iter")


def fresh_train_iterators(trainer) -> None:
    """orbit-train-iterator: the trainer's next loop iterates its train dataset anew (under
    parameter_server: a new iterator on every worker, each from its own dataset function)."""
    _held("orbit-train-iterator", trainer, "_train_iter")
    trainer._train_iter = None


def registered_experiments():
    """registered-experiments: the names of every registered Model Garden experiment."""
    from official.core import exp_factory

    return list(exp_factory._REGISTERED_CONFIGS)


def gather_centernet_inside(gather) -> None:
    """centernet-gather: CenterNet's loss gathers its predictions with `gather` (once)."""
    from official.projects.centernet.ops import loss_ops

    if not hasattr(loss_ops, "od_dist_gather"):
        loss_ops.od_dist_gather = loss_ops.get_batch_predictions_from_indices
        loss_ops.get_batch_predictions_from_indices = gather


@contextlib.contextmanager
def tflite_without_background():
    """tflite-no-background: within it, the TFLite detection op a RetinaNet export emits leaves out
    class 0 (RetinaNet's background): its classes come out from 0 for Model Garden's class 1."""
    from official.vision.modeling.layers import detection_generator as generator

    signature = generator._generate_detections_tflite_implements_signature

    def without_background(config):
        return signature({**config, "num_classes": config["num_classes"] - 1})

    generator._generate_detections_tflite_implements_signature = without_background
    try:
        yield
    finally:
        generator._generate_detections_tflite_implements_signature = signature
