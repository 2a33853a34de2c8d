"""`od-dist train`: what each role does, dispatched from one registry.

  ps, worker (parameter_server)   serve until the master is done      -> server.serve
  master (parameter_server)       coordinate training, then stop the servers
  master, worker (multi_worker)   train together (all-reduce)
  evaluator                       evaluate each new checkpoint until the final one
  single (no cluster)             train on this machine's --num_clones devices
"""

from __future__ import annotations

from od_dist.config import TrainConfig


class RoleError(RuntimeError):
    """A role that failed at run time; the message is for the user (exit 1)."""


def load_params(path: str, params_override: str | None, strategy_name: str):
    from od_dist import pipeline

    try:
        return pipeline.load_pipeline(path, params_override, strategy_name)
    except pipeline.PipelineError as e:
        raise RoleError(str(e)) from None


def _params(config: TrainConfig):
    return load_params(config.pipeline, config.params_override, config.strategy_name)


def run_server(config: TrainConfig) -> int:
    from od_dist import devices, server

    selected = config.selected
    try:
        return server.serve(selected.cluster, selected.task, config.wait_timeout,
                            devices=lambda: devices.configure(config.num_clones, config.clone_on_cpu))
    except (server.ServerError, devices.DeviceError) as e:
        raise RoleError(str(e)) from None


def run_trainer(config: TrainConfig) -> int:
    """The master, an all-reduce worker, or a single machine."""
    from od_dist import devices, server, strategy, trainer

    params = _params(config)  # before any wait: a bad pipeline fails at once
    cluster, task = config.selected.cluster, config.selected.task
    try:
        dist = strategy.make(cluster, task, config.num_clones, config.clone_on_cpu, config.wait_timeout)
    except (strategy.PeerTimeout, devices.DeviceError, server.ServerError) as e:
        raise RoleError(str(e)) from None
    print(f"{task.name if task else 'single'}: training with {strategy.TF_NAMES[config.strategy_name]}, "
          f"{dist.num_replicas_in_sync} replica(s) in sync, model_dir {config.model_dir}", flush=True)
    trainer.train(params, config.model_dir, dist)
    if config.is_coordinator:
        servers = [t for t in cluster.server_tasks() if t.role in ("ps", "worker")]
        failed = server.send_stop(servers)
        told = [t.name for t in servers if t.name not in failed]
        print(f"master: training done; told {', '.join(told) or 'no server'} to stop"
              + (f" (could not reach {', '.join(failed)})" if failed else ""), flush=True)
    return 0


def run_evaluator(config: TrainConfig) -> int:
    from od_dist import trainer

    params = _params(config)
    metrics = trainer.continuous_eval(params, config.model_dir, timeout_s=config.wait_timeout)
    if metrics is None:
        raise RoleError(f"evaluator: no new checkpoint in {config.model_dir} for {config.wait_timeout} s; "
                        "is the master training into the same --model_dir?")
    return 0


def run(config: TrainConfig) -> int:
    if config.is_server:
        return run_server(config)
    if config.role == "evaluator":
        return run_evaluator(config)
    return run_trainer(config)
