"""Dataset tools: the synthetic shapes detection dataset (TensorFlow imported lazily)."""

__all__ = ["CLASSES", "DEFAULT_DIR", "write_dataset"]


def __getattr__(name):
    # Lazy, so `python -m od_dist.data.shapes` does not import the module twice.
    if name in __all__:
        from od_dist.data import shapes

        return getattr(shapes, name)
    raise AttributeError(name)
