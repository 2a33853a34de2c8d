"""Datasets as Model Garden's detection records (TensorFlow imported lazily, by each tool):

shapes.py    the synthetic shapes dataset of the demo (`od-dist data shapes`)
voc.py       Pascal VOC / labelImg XML -> records (`od-dist data voc`)
coco.py      COCO JSON -> records (`od-dist data coco`)
odapi.py     Object Detection API records -> Model Garden's (`od-dist data odapi`)
records.py   what the converters share: label maps, the train/val split, sharded writing
             through a staging folder, box features, bad annotations reported, the summary
images.py    the image files the converters embed: format, bytes to store, inside --images
writing.py   writes into a user's folder: staged outputs moved into place, one file replaced
             whole, the files a command owns there listed in a manifest
errors.py    the data tools' one-line errors
textproto.py protobuf text format (pipeline.config, label maps), no schema needed
check.py     reads every record a pipeline uses and checks it (`od-dist data check`)
"""

__all__ = ["CLASSES", "DEFAULT_DIR", "write_dataset"]


def __getattr__(name):
    # Lazy, so `python -m od_dist.data.shapes` does not import the module twice.
    if name in __all__:
        from od_dist.data import shapes

        return getattr(shapes, name)
    raise AttributeError(name)
