"""What is written for machines: per-machine launch scripts and the Kubernetes TFJob."""
