"""What runs inside a TensorFlow task: its role, server, strategy, devices, the stop protocol and the
trainer. Builds on od_dist.host's TensorFlow-free parts; the host side never imports this."""
