"""What runs beside a task on a host, and never imports TensorFlow: the config decided before it,
starting and supervising tasks, the watchdog process, launch, doctor, the console."""
