"""What a task's imports of TensorFlow and Model Garden leave out: modules that they import and that
no od-dist task uses, hidden (the import fails, as if not installed, and the importer goes on
without them) or deferred (loaded at the first use of one of their names).

The CPU seconds each saves at every task's start were measured with `python -X importtime` and
`benchmarks/startup.py`; what trains is unchanged (`benchmarks/same_training.py`)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

from od_dist.patches.base import MODEL_GARDEN, TENSORFLOW, TF_KERAS, Patch

PATCHES = (
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
        "tensorflow-without-gce",
        TENSORFLOW,
        ("tensorflow.python.distribute.cluster_resolver.gce_cluster_resolver:_GOOGLE_API_CLIENT_INSTALLED",),
        "imports TensorFlow with googleapiclient hidden, so that its GCE cluster resolver finds the "
        "Google API client not installed (import_tensorflow)",
        "only TensorFlow's GCEClusterResolver uses it, which od-dist never makes (its clusters are "
        "its cluster files): 0.26 s of CPU in every task that imports TensorFlow's distribute",
    ),
    Patch(
        "model-garden-deferred",
        MODEL_GARDEN,
        (
            "official.vision.utils.object_detection.visualization_utils:plt",
            "official.core.input_reader:tfds",
        ),
        "imports Model Garden with matplotlib.pyplot and tensorflow_datasets deferred: loaded at "
        "the first use of a name of theirs (import_tensorflow)",
        "Model Garden's drawing (pyplot, for mask and keypoint figures) and its TFDS inputs "
        "(`tfds_name`) import them at its import; a trainer or evaluator reading TFRecords uses "
        "neither: 0.47 s and 0.19 s of CPU of every such task's start",
    ),
)


# model-garden-deferred: imported by Model Garden, used by no task's start; each module's code runs at
# the first use of one of its names.
DEFERRED = ("matplotlib.pyplot", "tensorflow_datasets")


def import_tensorflow(keras: bool = True) -> None:
    """keras-without-pandas, tensorflow-without-gce: imports TensorFlow, and with
    TF_USE_LEGACY_KERAS the tf_keras it loads (Model Garden's Keras), as if pandas and
    googleapiclient were not installed; both stay importable for any other module. `keras` False
    (a ps or worker server, which runs the functions its coordinator sends and no Python model
    code): without Keras at all, which TensorFlow's import then skips: a ps ready in 3.3 s instead
    of 3.8 s (`benchmarks/startup.py --cases ps`, 2026-12-02). model-garden-deferred: with Keras,
    the modules DEFERRED are deferred wherever this process first imports them (Model Garden's
    import, or check()'s of its patches' modules)."""
    if "tensorflow" in sys.modules or "pandas" in sys.modules:
        return
    hidden = ["pandas", "googleapiclient"] if keras else ["pandas", "googleapiclient", "tf_keras", "keras"]
    hidden = [name for name in hidden if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # `import NAME` raises ImportError (the import system's rule)
    try:
        import tensorflow  # noqa: F401
    finally:
        for name in hidden:
            del sys.modules[name]
    if keras:
        sys.meta_path.insert(0, _Deferring(name for name in DEFERRED if name not in sys.modules))


class _DeferredLoader(importlib.abc.Loader):
    """Makes a module whose code runs at the first look-up of a name it does not hold yet. Its
    import-system attributes (`__file__`, `__spec__`, `__path__`) are there from the start:
    autograph reads every loaded module's `__file__` as it converts a function, which would load a
    lazy module of the standard library's (importlib.util.LazyLoader) at the first trace."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        loader, lock = self.loader, threading.Lock()

        def load_and_get(name):
            with lock:  # one thread runs the module's code; the others wait for it, then look up
                if module.__dict__.get("__getattr__") is load_and_get:
                    del module.__dict__["__getattr__"]
                    module.__loader__ = module.__spec__.loader = loader
                    loader.exec_module(module)
            return getattr(module, name)

        module.__getattr__ = load_and_get  # a module's own __getattr__ (PEP 562): its missing names


class _Deferring(importlib.abc.MetaPathFinder):
    """Finds the modules `names` as the import system would, each with a _DeferredLoader."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferredLoader(spec.loader)
        return spec
