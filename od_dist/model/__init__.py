"""The detector: pipeline files to Model Garden experiment configs."""
