"""The cluster file: its frozen model, validation rules, 'host:port' addresses (hostport), one-line
problem messages, safe YAML, what each role does (duties), who connects to whom (topology), and
this machine's addresses and ports.

Nothing here imports TensorFlow, so validate, tf-config and --help stay fast.
"""
