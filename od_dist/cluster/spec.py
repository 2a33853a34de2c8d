"""The cluster model: one file, parsed once into a frozen object. Knows nothing of TensorFlow.

Roles use the cluster file's words (`master`, `worker`, `ps`, `evaluator`); `tf_job` maps them to
TensorFlow's task types (`master` -> `chief`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from od_dist.cluster import duties, hostport, messages, placement, safe_yaml, validate
from od_dist.cluster.validate import MULTI_WORKER_MIRRORED, PARAMETER_SERVER  # noqa: F401 (re-exported)

TF_JOB = {"master": "chief", "worker": "worker", "ps": "ps", "evaluator": "evaluator"}
FROM_TF_JOB = {
    "chief": "master",
    "master": "master",
    "worker": "worker",
    "ps": "ps",
    "evaluator": "evaluator",
}


class InvalidCluster(ValueError):
    """Invalid user input; `problems` are one-line messages, each with its fix."""

    def __init__(self, problems: list[str], source: str = ""):
        super().__init__("\n".join(problems))
        self.problems = list(problems)
        self.source = source


@dataclass(frozen=True)
class Address:
    host: str
    port: int | None

    def __str__(self) -> str:
        return hostport.format_address(self.host, self.port)


# The roles an elastic job's rounds are made of (Cluster.members).
MEMBER_ROLES = ("master", "worker")


@dataclass(frozen=True)
class Task:
    role: str  # master | worker | ps | evaluator
    index: int
    address: Address
    # Its name in the cluster file, where it differs from its place (a round of an elastic job
    # numbers its workers again): what every line calls it.
    shown: str | None = field(default=None, compare=False)

    @property
    def name(self) -> str:
        return self.shown or f"{self.role}:{self.index}"

    @property
    def key(self) -> str:
        """Where the task is written in the cluster file."""
        return self.role if self.role in ("master", "evaluator") else f"{self.role}[{self.index}]"

    @property
    def tf_job(self) -> str:
        return TF_JOB[self.role]


@dataclass(frozen=True)
class HostSettings:
    os: str | None = None  # linux or windows; None: not declared (scripts for both are written)
    python: str | None = None  # an interpreter: scripts run `<python> -m od_dist`
    venv: str | None = None  # a virtual environment: scripts activate it
    workdir: str | None = None
    num_clones: int | None = None
    user: str | None = None  # the account its start-at-boot units run as (cluster/accounts.py)


@dataclass(frozen=True)
class Cluster:
    strategy: str
    master: Address | None
    workers: tuple[Address, ...]
    ps: tuple[Address, ...] = ()
    evaluator: Address | None = None
    num_clones: int = 1
    hosts: Mapping[str, HostSettings] = field(default_factory=lambda: MappingProxyType({}))
    checkpoint_port: int | None = None  # the lead serves its newest checkpoint there
    min_trainers: int | None = None  # a group this large goes on without lost trainers (host/elastic.py)
    membership_port: int | None = None  # where each trainer machine's od-dist agrees the group
    # multi_worker_mirrored trainers that step alone and meet every this many steps (task/local_sgd.py)
    sync_every: int | None = None
    outer_learning_rate: float = validate.OUTER_LEARNING_RATE
    outer_momentum: float = validate.OUTER_MOMENTUM
    # A group of an elastic job (group()): the whole job's id, which its stop markers and checkpoint
    # feed keep whatever trainers train now, and its tasks' names in the file, by address.
    of_job: str | None = None
    file_names: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @functools.cached_property
    def _tasks_by_role(self) -> dict[str, tuple[Task, ...]]:
        """Built once: callers ask for a role's tasks once per task (scripts for 20,000 workers)."""
        out = {}
        names = self.file_names
        for role in ("master", "evaluator"):
            address = getattr(self, role)
            out[role] = (Task(role, 0, address, names.get(str(address))),) if address else ()
        for role, addresses in (("worker", self.workers), ("ps", self.ps)):
            out[role] = tuple(Task(role, i, a, names.get(str(a))) for i, a in enumerate(addresses))
        return out

    def tasks_of(self, role: str) -> tuple[Task, ...]:
        return self._tasks_by_role.get(validate.normalize_role(role), ())

    @functools.cached_property
    def _tasks(self) -> tuple[Task, ...]:
        return sum((self.tasks_of(r) for r in ("ps", "worker", "master", "evaluator")), ())

    def tasks(self) -> tuple[Task, ...]:
        """Every task, in the order a launcher would start them (servers first)."""
        return self._tasks

    @functools.cached_property
    def _roles_by_machine(self) -> dict[str, tuple[str, ...]]:
        """Built once, in the order of tasks(): each task's checks ask for its machine's roles, and
        a walk over every task per task is quadratic (scripts for 3,000 workers)."""
        out: dict[str, list[str]] = {}
        for t in self.tasks():
            out.setdefault(hostport.machine_of(t.address.host), []).append(t.role)
        return {m: tuple(roles) for m, roles in out.items()}

    def roles_on(self, host: str) -> tuple[str, ...]:
        """The roles of the tasks on `host`'s machine (every loopback address is this one)."""
        return self._roles_by_machine.get(hostport.machine_of(host), ())

    def tasks_on(self, is_local) -> tuple[Task, ...]:
        """The tasks whose host `is_local` says is this machine (all of a loopback cluster)."""
        return (
            self.tasks()
            if self.loopback_only()
            else tuple(t for t in self.tasks() if is_local(t.address.host))
        )

    def task(self, role: str, index: int = 0) -> Task:
        return self.tasks_of(role)[index]

    @functools.cached_property
    def _server_tasks(self) -> tuple[Task, ...]:
        return tuple(t for t in self.tasks() if t.role != "evaluator")

    def server_tasks(self) -> tuple[Task, ...]:
        """Tasks in the TensorFlow ClusterSpec. The evaluator runs no server and stays out: an
        evaluator listed in a parameter-server cluster hangs the coordinator."""
        return self._server_tasks

    @functools.cached_property
    def trainer_clones(self) -> tuple[int, int]:
        """(the trainers, the sum of their hosts' num_clones): built once, asked once per task."""
        hosts = [t.address.host for t in self.server_tasks() if self.runs_replicas(t.role)]
        return len(hosts), sum(self.clones_for(h) for h in hosts)

    def cluster_spec(self) -> dict[str, list[str]]:
        spec: dict[str, list[str]] = {}
        for t in self.server_tasks():
            spec.setdefault(t.tf_job, []).append(str(t.address))
        return spec

    def job_id(self) -> str:
        """A short name for this job, from its TensorFlow cluster (every server's address): the same
        on every machine that reads this file (or the TF_CONFIG made from it), another for any other
        job. Stop markers carry it, so two jobs sharing a working directory cannot stop each other."""
        if self.of_job:
            return self.of_job
        text = json.dumps(self.cluster_spec(), sort_keys=True)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]

    def tf_config(self, role: str, index: int = 0) -> dict:
        task = self.task(role, index)
        cluster = self.cluster_spec()
        if task.role == "evaluator":  # only the evaluator itself sees its entry
            cluster["evaluator"] = [str(task.address)]
        return {"cluster": cluster, "task": {"type": task.tf_job, "index": task.index}}

    def host_settings(self, host: str) -> HostSettings:
        return self.hosts.get(host, HostSettings())

    def clones_for(self, host: str) -> int:
        return self.host_settings(host).num_clones or self.num_clones

    def lead_task(self) -> Task | None:
        """The task whose port says training is alive, which the evaluator probes: the master, or
        worker 0 (TensorFlow's chief) in a multi_worker_mirrored cluster without one."""
        leads = self.tasks_of("master") or self.tasks_of("worker")
        return leads[0] if leads else None

    def checkpoint_feed(self) -> Address | None:
        """Where the lead serves its newest checkpoint (protocol/checkpoint_feed.py), if it does."""
        lead = self.lead_task()
        return Address(lead.address.host, self.checkpoint_port) if lead and self.checkpoint_port else None

    def checkpoint_feeds(self) -> tuple[Address, ...]:
        """Where a lead may serve the checkpoints: the lead's feed, and with min_trainers every
        trainer's machine's (the lead moves to a trainer still up when it is lost)."""
        feed = self.checkpoint_feed()
        if feed is None:
            return ()
        hosts = [feed.host] + [t.address.host for t in self.members() if self.min_trainers]
        return tuple(Address(h, feed.port) for h in dict.fromkeys(hosts))

    def side_ports(self, task: Task) -> tuple[tuple[int, str, str], ...]:
        """(port, what, its key in the file) that the od-dist of `task` serves beside the task's own
        port: the checkpoints on checkpoint_port (the lead's; with min_trainers any trainer may lead)
        and, with min_trainers, membership_port (host/elastic.py); once per machine, on its first
        trainer."""
        machine = hostport.machine_of(task.address.host)
        trainers = self.members() if self.min_trainers else ()
        first_here = task in trainers and task == next(
            t for t in trainers if hostport.machine_of(t.address.host) == machine
        )
        out = []
        if self.checkpoint_port and (task == self.lead_task() or first_here):
            out.append((self.checkpoint_port, "checkpoints", "checkpoint_port"))
        if first_here:
            out.append((self.membership_port, "membership", "membership_port"))
        return tuple(out)

    def trainers(self) -> tuple[Task, ...]:
        """The tasks that train (cluster/duties.py), the lead first."""
        ordered = self.tasks_of("master") + self.tasks_of("worker")
        return tuple(t for t in ordered if duties.of(self.strategy, t.role).is_trainer)

    def members(self) -> tuple[Task, ...]:
        """The tasks an elastic job's rounds are made of (min_trainers): the master and the workers,
        in the file's order. Under multi_worker_mirrored they are the trainers; under
        parameter_server any of them may coordinate a round (group())."""
        return tuple(t for role in MEMBER_ROLES for t in self.tasks_of(role))

    def membership_addresses(self) -> dict[str, tuple[str, int]]:
        """Where each member machine's od-dist serves its membership state (host/elastic.py): its first
        member's host and membership_port, by machine (hostport.machine_of), in the file's order."""
        out: dict[str, tuple[str, int]] = {}
        for t in self.members():
            out.setdefault(hostport.machine_of(t.address.host), (t.address.host, self.membership_port))
        return out

    def group(self, members) -> Cluster:
        """The cluster of an elastic job's round: the members named in `members` (by their names in
        this file), the others left out, the workers numbered again in order. Under
        multi_worker_mirrored without the master its first worker is TensorFlow's chief, the lead;
        under parameter_server the first of `members` is the master (the coordinator, at its own
        address) and the others its workers. The job's id stays this file's."""
        kept = {t.name: t for t in self.members() if t.name in members}
        if self.strategy == validate.PARAMETER_SERVER:
            master = kept[members[0]]
            workers = tuple(t.address for t in kept.values() if t is not master)
        else:
            master = kept.get("master:0")
            workers = tuple(t.address for t in self.tasks_of("worker") if t.name in kept)
        return dataclasses.replace(
            self,
            master=master.address if master else None,
            workers=workers,
            of_job=self.job_id(),
            file_names=MappingProxyType({str(t.address): t.name for t in kept.values()}),
        )

    def in_group(self, task: Task, members) -> Task:
        """`task` (of this file) as it is in group(members)."""
        if self.strategy == validate.PARAMETER_SERVER and task.role in MEMBER_ROLES:
            if task.name == members[0]:
                return Task("master", 0, task.address, task.name)
            others = [t.name for t in self.members() if t.name in members[1:]]
            return Task("worker", others.index(task.name), task.address, task.name)
        if task.role != "worker":
            return task
        before = [t for t in self.tasks_of("worker") if t.name in members and t.index < task.index]
        return Task("worker", len(before), task.address, task.name)

    def runs_replicas(self, role: str) -> bool:
        """Whether this role's processes run --num_clones replicas (cluster/duties.py): the others
        start whatever num_clones says."""
        return duties.of(self.strategy, role).runs_replicas

    def loopback_only(self) -> bool:
        return all(hostport.is_loopback(t.address.host) for t in self.tasks())


def _address(text: str) -> Address:
    return Address(*hostport.parse_address(text.strip(), need_port=False))


def from_document(doc, source: str = "") -> Cluster:
    """Validates a parsed cluster document and builds the cluster; raises InvalidCluster."""
    problems = validate.check_document(doc)
    if problems:
        raise InvalidCluster(problems, source)

    def addresses(role):
        value = doc.get(role) or []
        return tuple(_address(v) for v in ([value] if isinstance(value, str) else value))

    master = doc.get("master", doc.get("chief"))
    hosts = {hostport.host_key(h): HostSettings(**s) for h, s in (doc.get("hosts") or {}).items()}
    cluster = Cluster(
        strategy=validate.infer_strategy(doc),
        master=_address(master) if master else None,
        workers=addresses("worker"),
        ps=addresses("ps"),
        evaluator=_address(doc["evaluator"]) if doc.get("evaluator") else None,
        num_clones=doc.get("num_clones", 1),
        hosts=MappingProxyType(hosts),
        checkpoint_port=doc.get("checkpoint_port"),
        min_trainers=doc.get("min_trainers"),
        membership_port=doc.get("membership_port"),
        sync_every=doc.get("sync_every"),
        outer_learning_rate=float(doc.get("outer_learning_rate", validate.OUTER_LEARNING_RATE)),
        outer_momentum=float(doc.get("outer_momentum", validate.OUTER_MOMENTUM)),
    )
    problems = placement.check_equal_clones(cluster)
    if problems:
        raise InvalidCluster(problems, source)
    return cluster


def load(path: str) -> Cluster:
    try:
        doc = safe_yaml.load_file(path)
    except safe_yaml.YamlError as e:
        raise InvalidCluster([f"cluster file: {e}"], path) from None
    return from_document(doc, path)


def from_tf_config(text: str) -> tuple[Cluster, str, int]:
    """A TF_CONFIG (as Kubernetes TFJob sets it per pod) -> (cluster, role, index)."""
    source = "TF_CONFIG"
    try:
        config = json.loads(text)
    except ValueError as e:
        raise InvalidCluster([f"TF_CONFIG: not valid JSON ({e}); unset it or fix it"], source) from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise InvalidCluster(
            [
                "TF_CONFIG: no 'cluster' mapping; it must look like "
                '{"cluster": {"chief": [...], ...}, "task": {"type": "chief", "index": 0}}'
            ],
            source,
        )
    doc: dict = {}
    for job, entries in config["cluster"].items():
        role = FROM_TF_JOB.get(job)
        if role is None:
            raise InvalidCluster(
                [
                    messages.problem(
                        f"TF_CONFIG cluster.{job}",
                        job,
                        "unknown task type",
                        "use chief, worker, ps or evaluator",
                    )
                ],
                source,
            )
        if role in doc:
            raise InvalidCluster(
                [
                    messages.problem(
                        f"TF_CONFIG cluster.{job}",
                        job,
                        "chief and master are the same task type and both are given",
                        "keep only one",
                    )
                ],
                source,
            )
        if role in ("master", "evaluator"):
            if not isinstance(entries, list) or len(entries) != 1:
                raise InvalidCluster(
                    [
                        messages.problem(
                            f"TF_CONFIG cluster.{job}",
                            entries,
                            f"exactly one {job} is allowed",
                            "list one address",
                        )
                    ],
                    source,
                )
            entries = entries[0]
        doc[role] = entries
    task = config.get("task") or {}
    if not isinstance(task, dict):
        task = {"type": None}
    kind = task.get("type")
    role = FROM_TF_JOB.get(kind) if isinstance(kind, str) else None
    index = task.get("index", 0)
    if role is None or isinstance(index, bool) or not isinstance(index, int):
        raise InvalidCluster(
            [
                messages.problem(
                    "TF_CONFIG task",
                    task,
                    "no valid task type and index",
                    'add "task": {"type": "worker", "index": 0}',
                )
            ],
            source,
        )
    cluster = from_document(doc, source)
    problems = placement.check_task(cluster, role, index)
    if problems:
        raise InvalidCluster(problems, source)
    return cluster, role, index


def tf_config_json(cluster: Cluster, role: str, index: int) -> str:
    return json.dumps(cluster.tf_config(role, index), sort_keys=True)
