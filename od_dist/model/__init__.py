"""The detector:

pipeline.py  pipeline files -> Model Garden experiment configs, checked (keys, values, the
             cluster's strategy, and that the model builds)
batch.py     the global batch over the replicas in sync: checked before anything starts, split or
             scaled by each trainer
export.py    a checkpoint -> a SavedModel with its label map (`od-dist export`)
predict.py   a SavedModel on images -> drawn PNGs and detections.json (`od-dist predict`)
report.py    a run's event files -> one PNG of its curves (`od-dist report`)
"""
