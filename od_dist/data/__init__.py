"""Dataset tools: the synthetic shapes detection dataset (TensorFlow imported lazily)."""

from od_dist.data.shapes import CLASSES, DEFAULT_DIR, write_dataset

__all__ = ['CLASSES', 'DEFAULT_DIR', 'write_dataset']
