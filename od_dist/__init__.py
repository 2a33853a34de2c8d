"""od-dist: one cluster file -> a distributed TensorFlow object-detection training job."""

__version__ = "0.1.0"
