"""The cluster file: its frozen model, validation rules, safe YAML and this machine's addresses.

Nothing here imports TensorFlow, so validate, tf-config and --help stay fast.
"""
