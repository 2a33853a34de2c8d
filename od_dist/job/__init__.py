"""A task's life: config, roles, servers, strategies, devices, the trainer and the local launcher."""
