"""The contract between a task and whoever runs it (a supervisor, a shell, Kubernetes): exit codes,
the notes a task leaves its supervisor. No TensorFlow, nothing of od_dist above it."""
