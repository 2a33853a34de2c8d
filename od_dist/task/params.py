"""The pipeline as a task trains or evaluates it: Model Garden's config, with what the cluster does to
it said in one line each (the meetings of sync_every, the batch over the replicas in sync)."""

from __future__ import annotations

from od_dist.host.config import TrainConfig
from od_dist.task import local_sgd


def load_params(path: str, params_override: str | None, strategy_name: str):
    """The pipeline as a Model Garden config; raises pipeline.PipelineError (invalid input)."""
    from od_dist.model import pipeline

    return pipeline.load_pipeline(path, params_override, strategy_name)


def of_task(config: TrainConfig):
    """The pipeline, and on a trainer of replicas in sync, what their count does to its batch
    (one line; raises pipeline.PipelineError when it cannot be done)."""
    from od_dist.model import batch

    params = load_params(config.pipeline, config.params_override, config.strategy_name)
    meeting = local_sgd.of_cluster(config.selected.cluster)
    if config.in_sync and meeting:
        print(f"sync_every: {local_sgd.loop_every(params, meeting)}", flush=True)
    if config.in_sync and config.fixed_replica_batch:
        print(f"--fixed_replica_batch: {batch.scale_for_replicas(params, config.replicas)}", flush=True)
    elif config.in_sync and config.replicas > 1:
        print(f"batch: {batch.split_over_replicas(params, config.replicas)}", flush=True)
    return params
