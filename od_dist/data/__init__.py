"""Datasets as Model Garden's detection records (TensorFlow imported lazily, by each tool):

shapes.py    the synthetic shapes dataset of the demo (`od-dist data shapes`)
voc.py       Pascal VOC / labelImg XML -> records (`od-dist data voc`)
coco.py      COCO JSON -> records (`od-dist data coco`)
records.py   what the converters share: label maps, the train/val split, sharded writing
             through a staging folder, checks of boxes and images, the summary
check.py     reads every record a pipeline uses and checks it (`od-dist data check`)
"""

__all__ = ["CLASSES", "DEFAULT_DIR", "write_dataset"]


def __getattr__(name):
    # Lazy, so `python -m od_dist.data.shapes` does not import the module twice.
    if name in __all__:
        from od_dist.data import shapes

        return getattr(shapes, name)
    raise AttributeError(name)
