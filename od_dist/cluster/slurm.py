"""A Slurm step's layout and the cluster it gives: which task each srun rank is, and on which node.
No TensorFlow, no `scontrol`: a task reads only the variables srun sets in it.

The cluster file groups its entries on machines: entries with the same host (every loopback entry
is this one machine) are one machine. Machines are taken in the order of their first task in
Cluster.tasks() (ps, worker, master, evaluator, each role in list order), and within a machine
its tasks in that same order. Ranks follow that order: the first machine's tasks are ranks
0..k1-1, and so on. Machine i runs on the i-th node of the step: in a job whose machines ask the
same, the i-th of the step's node list (SLURM_STEP_NODELIST, in Slurm's order, never sorted; block
distribution); in a heterogeneous job (machines that ask different resources), the node of
component i (SLURM_JOB_NODELIST_HET_GROUP_i), whose tasks are the ranks that follow component
i-1's. The generated script fixes that layout (render/slurm.py); a task that finds itself on
another node refuses to start.

GPUs: Slurm gives a node's GPUs to the step on that node (the job asks, per node, what the
machine's trainers use: render/slurm.py); each task then keeps its share (task_gpus): a trainer
the next `num_clones` of them in its machine's order, any other task none.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from od_dist.cluster import hostport, messages, safe_yaml, validate
from od_dist.cluster import spec as cluster_mod
from od_dist.cluster.spec import Cluster, InvalidCluster, Task

NODELIST = "SLURM_STEP_NODELIST"
TASKS_PER_NODE = "SLURM_STEP_TASKS_PER_NODE"
NUM_TASKS = "SLURM_STEP_NUM_TASKS"
RANK = "SLURM_PROCID"
NODENAME = "SLURMD_NODENAME"
HET_SIZE = "SLURM_HET_SIZE"  # set in a heterogeneous job; its components' variables end in _HET_GROUP_<i>
GPUS = "CUDA_VISIBLE_DEVICES"
# The GPUs Slurm gave the step on this node, kept when a task narrows CUDA_VISIBLE_DEVICES to its
# own, so that a supervised task's child (which selects itself again) slices the same list.
STEP_GPUS = "OD_DIST_SLURM_GPUS"
LOOPBACK = "this machine (loopback)"  # the machine of every loopback entry
# What a refusal tells the user to do instead.
RUN_IT = "run the task through the batch script `od-dist slurm` writes (sbatch job.sbatch)"


class HostlistError(ValueError):
    """A hostlist or task count Slurm would not write; the message names it."""


def _split_top(text: str) -> list[str]:
    """`a[1-2],b,c[3,5]` -> ['a[1-2]', 'b', 'c[3,5]']: the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise HostlistError(f"'{text}': unbalanced or nested brackets")
    if depth:
        raise HostlistError(f"'{text}': a '[' without its ']'")
    parts.append(text[start:])
    return parts


def _range(body: str, whole: str) -> list[str]:
    """`01-03,10` -> ['01', '02', '03', '10']: a bracket's numbers, zero-padded as written."""
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise HostlistError(f"'{whole}': '[{body}]' holds '{item}', not a number or a range N-M")
        low, high = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(high) < int(low):
            raise HostlistError(f"'{whole}': the range {item} runs backwards")
        width = len(low) if low.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded in its own order: `n[1-2]`, `gpu[01-03,10]`,
    `rack[1-2]-n[01-02]` (every bracket group: rack1-n01, rack1-n02, rack2-n01, ...), and comma
    lists of those (`n1,gpu[2-3]`)."""
    if not text or not text.strip():
        raise HostlistError("'': empty")
    hosts = []
    for part in _split_top(text.strip()):
        if not part:
            raise HostlistError(f"'{text}': an empty name between commas")
        names = [""]
        for piece in re.split(r"(\[[^\]]*\])", part):
            if piece.startswith("["):
                names = [n + s for n in names for s in _range(piece[1:-1], text)]
            elif piece:
                if "]" in piece or not re.fullmatch(r"[A-Za-z0-9._-]+", piece):
                    raise HostlistError(f"'{text}': '{piece}' is not part of a host name")
                names = [n + piece for n in names]
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """`2(x3),1` -> [2, 2, 2, 1]: Slurm's per-node task counts."""
    out = []
    for item in (text or "").split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise HostlistError(f"'{text}': '{item}' is not a count N or N(xM)")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def machine_of(host: str) -> str:
    return LOOPBACK if hostport.is_loopback(host) else host


def machines(cluster: Cluster) -> list[tuple[str, tuple[Task, ...]]]:
    """The file's machines in order (module doc) with their tasks: what runs on each node."""
    grouped: dict[str, list[Task]] = {}
    for task in cluster.tasks():
        grouped.setdefault(machine_of(task.address.host), []).append(task)
    return [(m, tuple(tasks)) for m, tasks in grouped.items()]


def ranks(cluster: Cluster) -> list[tuple[Task, int]]:
    """(task, node number from 0) for rank 0, 1, ...: block distribution over machines()."""
    return [(t, node) for node, (_, tasks) in enumerate(machines(cluster)) for t in tasks]


def tasks_per_node(cluster: Cluster) -> list[int]:
    return [len(tasks) for _, tasks in machines(cluster)]


# The batch script's choices for its tasks (render/slurm.py writes them; each task reads them):
# the address each node is reached at, and the first port of the job's ports (unset: the file's).
ADDRESS_ENV = "OD_DIST_SLURM_ADDRESS"
PORT_BASE_ENV = "OD_DIST_SLURM_PORT_BASE"
JOB_ID = "SLURM_JOB_ID"
NODE = "{node}"
LAST_PORT = 65535


def address_problem(address: str) -> str | None:
    """What is wrong with an address format (`{node}` and what surrounds it), or None."""
    if address.count(NODE) != 1:
        return f"holds {NODE} {address.count(NODE)} times, not once"
    rest = address.replace(NODE, "")
    if rest and not re.fullmatch(r"[A-Za-z0-9.-]+", rest):
        return "may add only letters, digits, '-' and '.' to the node's name"
    return None


def port_count(cluster: Cluster) -> int:
    """The ports a job of `cluster` listens on: a port per entry with one, and checkpoint_port."""
    return sum(1 for t in cluster.tasks() if t.address.port) + (1 if cluster.checkpoint_port else 0)


def port_base_problem(base: int, cluster: Cluster) -> str | None:
    if not 1024 <= base <= LAST_PORT + 1 - port_count(cluster):
        return f"leaves no room for the job's {port_count(cluster)} port(s) between 1024 and {LAST_PORT}"
    return None


def job_ports(cluster: Cluster, job_id: int, base: int) -> tuple[dict[str, int], int | None]:
    """(port of each task by name, checkpoint_port) of job `job_id`: a block of port_count() ports
    from `base`, the block's place given by the job id, so that jobs with nearby ids (any two
    running at once, in practice) never share a port on a node; the tasks in rank order, then the
    checkpoint port. Every task computes the same, with no word between them."""
    width = port_count(cluster)
    first = base + (job_id % ((LAST_PORT + 1 - base) // width)) * width
    ported = [t for t, _ in ranks(cluster) if t.address.port]
    ports = {t.name: first + i for i, t in enumerate(ported)}
    return ports, (first + len(ported) if cluster.checkpoint_port else None)


def step_document(
    doc: dict,
    cluster: Cluster,
    nodes: list[str],
    address: str = NODE,
    ports: tuple[dict[str, int], int | None] | None = None,
) -> dict:
    """The cluster document with each machine's host replaced by its node's address (`address`
    with the node's name for {node}), its ports by `ports` (job_ports) or kept, and hosts:
    settings moved to their machine's node."""
    node_of = {m: address.replace(NODE, nodes[i]) for i, (m, _) in enumerate(machines(cluster))}

    def moved(value: str, need_port: bool, name: str) -> str:
        host, port = hostport.parse_address(value.strip(), need_port=need_port)
        if ports is not None and port is not None:
            port = ports[0][name]
        return hostport.format_address(node_of[machine_of(host)], port)

    out = {k: list(v) if isinstance(v, list) else v for k, v in doc.items()}
    for role, key, value in validate.address_entries(doc):
        name, _, index = key.partition("[")
        task = f"{role}:{index[:-1] if index else 0}"
        if index and isinstance(out[name], list):
            out[name][int(index[:-1])] = moved(value, True, task)
        else:
            out[name] = moved(value, role != "evaluator", task)
    if ports is not None and ports[1] is not None:
        out["checkpoint_port"] = ports[1]
    hosts = {}
    for key, settings in (doc.get("hosts") or {}).items():
        node = node_of.get(machine_of(hostport.host_key(key)))
        if node is not None and node not in hosts:  # a machine not in the cluster has no node
            hosts[node] = settings
    if "hosts" in doc:
        out["hosts"] = hosts
    return out


@dataclasses.dataclass(frozen=True)
class Step:
    """What srun told this task."""

    nodes: tuple[str, ...]
    counts: tuple[int, ...]
    rank: int
    nodename: str
    num_tasks: int


def _problem(var: str, value, what: str, fix: str = RUN_IT) -> InvalidCluster:
    return InvalidCluster([messages.problem(var, value, what, fix)], "Slurm step")


def _het_layout(env: Mapping[str, str]) -> tuple[list[str], list[int]]:
    """A heterogeneous job's nodes and task counts, component by component (one node each)."""
    size = env[HET_SIZE]
    if not size.isdigit():
        raise _problem(HET_SIZE, size, "not a number")
    nodes, counts = [], []
    for i in range(int(size)):
        node_var, tasks_var = f"SLURM_JOB_NODELIST_HET_GROUP_{i}", f"SLURM_NTASKS_HET_GROUP_{i}"
        value = env.get(node_var, "")
        try:
            hosts = expand_hostlist(value)
        except HostlistError as e:
            raise _problem(node_var, value, f"not a Slurm host list ({e})") from None
        if len(hosts) != 1:
            raise _problem(node_var, value, "a component of more than one node (each is one machine)")
        if not env.get(tasks_var, "").isdigit():
            raise _problem(tasks_var, env.get(tasks_var, ""), "not a number")
        nodes.append(hosts[0])
        counts.append(int(env[tasks_var]))
    return nodes, counts


def read_step(env: Mapping[str, str]) -> Step:
    """The step's layout from srun's variables; InvalidCluster (one line) outside a step."""
    if not env.get(NODELIST):
        raise _problem("--slurm", "", f"{NODELIST} is not set: this process is not a task of an srun step")
    values = {}
    for var in (NODELIST, TASKS_PER_NODE, NUM_TASKS, RANK, NODENAME):
        if not env.get(var):
            raise _problem(var, "", "not set, though this is an srun step (an old Slurm?)")
        values[var] = env[var]
    try:
        nodes = expand_hostlist(values[NODELIST])
    except HostlistError as e:
        raise _problem(NODELIST, values[NODELIST], f"not a Slurm host list ({e})") from None
    try:
        counts = expand_tasks_per_node(values[TASKS_PER_NODE])
    except HostlistError as e:
        raise _problem(TASKS_PER_NODE, values[TASKS_PER_NODE], f"not Slurm's task counts ({e})") from None
    for var in (NUM_TASKS, RANK):
        if not values[var].isdigit():
            raise _problem(var, values[var], "not a number")
    if env.get(HET_SIZE):  # the step's node list is sorted there: the components say which is which
        nodes, counts = _het_layout(env)
    if len(counts) != len(nodes):
        raise _problem(TASKS_PER_NODE, values[TASKS_PER_NODE], f"{len(counts)} counts for {len(nodes)} nodes")
    return Step(tuple(nodes), tuple(counts), int(values[RANK]), values[NODENAME], int(values[NUM_TASKS]))


def step_cluster(path: str, step: Step, env: Mapping[str, str] | None = None) -> Cluster:
    """The cluster file's cluster on the step's nodes, built from the rewritten document by
    from_document (the file's validations: worker order, ps presence, ports); the nodes' address
    and the job's ports as the batch script set them in `env` (ADDRESS_ENV, PORT_BASE_ENV)."""
    try:
        doc = safe_yaml.load_file(path)
    except safe_yaml.YamlError as e:
        raise InvalidCluster([f"cluster file: {e}"], path) from None
    filed = cluster_mod.from_document(doc, path)
    want = tasks_per_node(filed)
    shown_want = ",".join(map(str, want))
    if list(step.counts) != want or step.num_tasks != sum(want):
        raise _problem(
            TASKS_PER_NODE,
            ",".join(map(str, step.counts)),
            f"{path} puts {shown_want} tasks on its {len(want)} machine(s) (one srun task per entry)",
        )
    env = env or {}
    address = env.get(ADDRESS_ENV) or NODE
    why = address_problem(address)
    if why:
        raise _problem(
            ADDRESS_ENV, address, why, "write it like {node} or {node}-ib (od-dist slurm --address)"
        )
    ports = None
    if env.get(PORT_BASE_ENV):
        base, job_id = env[PORT_BASE_ENV], env.get(JOB_ID, "")
        why = "not a number" if not base.isdigit() else port_base_problem(int(base), filed)
        if why:
            raise _problem(PORT_BASE_ENV, base, why, "give od-dist slurm another --port_base")
        if not job_id.isdigit():
            raise _problem(JOB_ID, job_id, "not a job id", RUN_IT)
        ports = job_ports(filed, int(job_id), int(base))
    return cluster_mod.from_document(step_document(doc, filed, list(step.nodes), address, ports), path)


def step_task(cluster: Cluster, step: Step) -> Task:
    """This rank's task; refused when srun put it on another node than block distribution says
    (`-m cyclic`, a hand-written srun line): its address would be another node's."""
    task, node = ranks(cluster)[step.rank]
    if step.nodename != step.nodes[node]:
        raise _problem(
            NODENAME,
            step.nodename,
            f"rank {step.rank} ({task.name}) runs here, but the job's layout puts it on "
            f"{step.nodes[node]} (block distribution; was the step started with -m cyclic?)",
            f"{RUN_IT}: its srun line sets the distribution",
        )
    return task


def select(path: str | None, env: Mapping[str, str]) -> tuple[Cluster, Task, Step]:
    """(cluster on the step's nodes, this rank's task, the step)."""
    if not path:
        raise InvalidCluster(
            [
                messages.problem(
                    "--cluster", "", "required with --slurm", "pass --cluster FILE (the job's file)"
                )
            ]
        )
    step = read_step(env)
    cluster = step_cluster(path, step, env)
    return cluster, step_task(cluster, step), step


def task_gpus(cluster: Cluster, task: Task, given: str) -> str:
    """This task's share of the GPUs Slurm gave its node's tasks (`given`, CUDA_VISIBLE_DEVICES'
    form): a trainer (duties: runs replicas) the next equal part in its machine's task order,
    any other task none ("")."""
    gpus = [g for g in given.split(",") if g.strip()]
    _, here = next((m, tasks) for m, tasks in machines(cluster) if task in tasks)
    trainers = [t for t in here if cluster.runs_replicas(t.role)]
    if task not in trainers or not gpus:
        return ""
    share = len(gpus) // len(trainers)
    at = trainers.index(task) * share
    return ",".join(gpus[at : at + share])


def _spans(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            out.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(out)


def given_line(task: Task, cpus: list[int], gpus: str | None) -> str:
    """What Slurm gave this task, said on its console: the cores it may run on and its GPUs."""
    cores = f"{len(cpus)} core{'s' * (len(cpus) != 1)} (CPU {_spans(sorted(cpus))})"
    shown = "no GPU" if not gpus else f"GPU{'s' * (',' in gpus)} {gpus}"
    env = f"{GPUS} not set" if gpus is None else f"{GPUS}='{gpus}'"
    return f"{task.name}: given {cores} and {shown} ({env})"
