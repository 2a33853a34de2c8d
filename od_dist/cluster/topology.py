"""Who connects to whom: the peers that open connections to a task's port, for the firewall lines
of the generated scripts and doctor's probes. No TensorFlow here."""

from __future__ import annotations

from od_dist.cluster.spec import PARAMETER_SERVER, Cluster, Task


def connecting_peers(cluster: Cluster, task: Task) -> tuple[Task, ...]:
    """The tasks that open connections to `task`'s port. Under parameter_server the master connects
    to every ps and worker and the workers reach the ps, and every ps and worker checks that the
    master's port is still open (od-dist's servers stop once the master stays gone past
    --wait_timeout); under multi_worker_mirrored every trainer talks to every other. The evaluator
    runs no server: nothing connects to it; it probes the lead task's port (the master, else
    worker 0) to know training is alive, so that port is open to it too."""
    masters, workers = cluster.tasks_of("master"), cluster.tasks_of("worker")
    if task.role == "evaluator" or task.address.port is None:
        return ()
    if cluster.strategy == PARAMETER_SERVER and cluster.min_trainers:
        # An elastic job: any member may coordinate a round (host/elastic.py), and the ps check its port.
        members = masters + workers
        others = tuple(t for t in members if t != task)
        peers = members if task.role == "ps" else others + cluster.tasks_of("ps")
    elif cluster.strategy == PARAMETER_SERVER:
        servers = cluster.tasks_of("ps") + workers
        peers = {"ps": masters + workers, "worker": masters, "master": servers}.get(task.role, ())
    else:
        peers = tuple(t for t in masters + workers if t != task)
    if task == cluster.lead_task():
        peers += cluster.tasks_of("evaluator")
    return peers


def feed_readers(cluster: Cluster) -> tuple[Task, ...]:
    """The tasks that fetch the lead's checkpoints from its checkpoint_port: the evaluator, and in an
    elastic parameter_server job every member (a worker keeps a copy of the coordinator's)."""
    if not cluster.checkpoint_feed():
        return ()
    copies = cluster.members() if cluster.strategy == PARAMETER_SERVER and cluster.min_trainers else ()
    return cluster.tasks_of("evaluator") + copies


def model_dir_line(cluster: Cluster) -> str:
    """Whether --model_dir must be a shared folder (it need not: task/controller.py,
    protocol/checkpoint_feed.py), in the words of the scripts' README and doctor."""
    if cluster.strategy == PARAMETER_SERVER and cluster.min_trainers and cluster.checkpoint_port:
        kept = (
            "The round's coordinator writes the checkpoints into its own `--model_dir`, and every "
            "worker keeps a copy from its checkpoint_port, so any may coordinate the next round"
        )
    elif cluster.strategy == PARAMETER_SERVER:
        kept = "The master writes the checkpoints into its own `--model_dir`"
    else:
        kept = (
            "Every trainer keeps the checkpoints in its own `--model_dir`, and one whose folder is new "
            "or behind resumes from the others' newest"
        )
    line = f"`--model_dir` need not be a shared folder: {kept}."
    evaluators = cluster.tasks_of("evaluator")
    lead = cluster.lead_task()
    if evaluators and lead and evaluators[0].address.host != lead.address.host:
        line += (
            f" The evaluator fetches each new checkpoint from the {lead.role}'s checkpoint_port "
            f"({cluster.checkpoint_port})."
            if cluster.checkpoint_feed()
            else " The evaluator's machine does not see them: add `checkpoint_port` to the cluster file "
            "(the master then serves them to it), or give both the same shared folder."
        )
    return line + " A shared folder works too: nothing is written into it twice."
