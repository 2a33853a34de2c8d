"""What is written for machines: per-machine launch scripts and their README, the Kubernetes
manifest (a JobSet by default, or a Kubeflow TFJob) and the Slurm batch script."""
