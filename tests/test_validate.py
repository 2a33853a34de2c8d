"""Every cluster-file rule with a case it accepts and a case it refuses (each refused case names
the message it expects, so removing the rule fails the test)."""

import textwrap

import pytest

from od_dist.cluster import placement, safe_yaml
from od_dist.cluster import spec as cluster_mod
from od_dist.cluster.spec import InvalidCluster

PS_OK = """
master: 10.0.0.1:2222
worker: [10.0.0.2:2222, 10.0.0.3:2222]
ps: [10.0.0.4:2222]
"""


MWM3 = """
master: 10.0.0.1:2222
worker: [10.0.0.2:2222, 10.0.0.3:2223]
"""
MWM4 = MWM3.replace("2223]", "2223, 10.0.0.4:2222]")


# PS_OK on loopback: one machine, so every task needs its own port.
PS_LOOP = (
    PS_OK.replace("10.0.0.", "127.0.0.")
    .replace("127.0.0.2:2222", "127.0.0.2:2223")
    .replace("127.0.0.3:2222", "127.0.0.3:2224")
    .replace("127.0.0.4:2222", "127.0.0.4:2225")
)


def load_text(text):
    return cluster_mod.from_document(safe_yaml.loads(textwrap.dedent(text)))


def problems_of(text):
    try:
        load_text(text)
    except (InvalidCluster,) as e:
        return e.problems
    except safe_yaml.YamlError as e:
        return [str(e)]
    return []


# (rule, accepted document, refused document, fragments the refusal must contain)
RULES = [
    ("empty file", PS_OK, "", ["empty"]),
    ("top level mapping", PS_OK, "- 10.0.0.1:2222\n", ["top level is not a mapping"]),
    (
        "unknown key with did-you-mean",
        PS_OK,
        PS_OK + "workers: [10.0.0.9:1]\n",
        ["workers", "did you mean 'worker'"],
    ),
    (
        "master and chief both",
        PS_OK.replace("master", "chief"),
        PS_OK + "chief: 10.0.0.9:1\n",
        ["chief", "both are given"],
    ),
    (
        "one master, not a list",
        PS_OK,
        PS_OK.replace("master: 10.0.0.1:2222", "master: [10.0.0.1:2222, 10.0.0.9:1]"),
        ["master", "exactly one master"],
    ),
    (
        "master required for parameter_server",
        PS_OK,
        PS_OK.replace("master: 10.0.0.1:2222\n", ""),
        ["master", "needs exactly one master"],
    ),
    (
        "host:port shape",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "10.0.0.4"),
        ["ps[0]", "'10.0.0.4'", "no port"],
    ),
    ("port is a number", PS_OK, PS_OK.replace("10.0.0.4:2222", "10.0.0.4:http"), ["ps[0]", "not a number"]),
    (
        "port range high",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "10.0.0.4:65536"),
        ["ps[0]", "65536", "out of range"],
    ),
    (
        "port range low",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "10.0.0.4:0"),
        ["ps[0]", "port 0", "out of range"],
    ),
    (
        "IPv6 in brackets",
        PS_OK.replace("10.0.0.4:2222", "'[fd00::4]:2222'"),
        PS_OK.replace("10.0.0.4:2222", "'fd00::4:2222'"),
        ["ps[0]", "must be in brackets", "[fd00::4]:2222"],
    ),
    (
        "brackets hold IPv6 only",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "'[host]:2222'"),
        ["not an IPv6 address"],
    ),
    (
        "valid host name",
        PS_OK.replace("10.0.0.4", "gpu-box-4.lab"),
        PS_OK.replace("10.0.0.4", "gpu_box"),
        ["ps[0]", "'gpu_box' is not a valid host name"],
    ),
    ("valid IPv4", PS_OK, PS_OK.replace("10.0.0.4", "10.0.0.256"), ["not a valid IPv4 address"]),
    (
        "entries are strings",
        PS_OK,
        PS_OK.replace("[10.0.0.4:2222]", "[2222]"),
        ["ps[0]", "an int", "as text"],
    ),
    (
        "worker is a list",
        PS_OK,
        PS_OK.replace("[10.0.0.2:2222, 10.0.0.3:2222]", "{a: 1}"),
        ["worker", "not a list"],
    ),
    (
        "same host:port twice",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "10.0.0.2:2222"),
        ["ps[0]", "same address as worker[0]"],
    ),
    (
        "same IPv6 written two ways",
        PS_OK.replace("10.0.0.4:2222", "'[fd00::4]:2222'"),
        PS_OK.replace("10.0.0.4:2222", "'[fd00::4]:2222'").replace("10.0.0.3:2222", "'[fd00:0::4]:2222'"),
        ["same address as"],
    ),
    (
        "ps present for parameter_server",
        "strategy: parameter_server\n" + PS_OK,
        "strategy: parameter_server\n" + PS_OK.replace("ps: [10.0.0.4:2222]\n", ""),
        ["ps", "needs at least one ps"],
    ),
    (
        "workers present for parameter_server",
        PS_OK,
        PS_OK.replace("worker: [10.0.0.2:2222, 10.0.0.3:2222]\n", ""),
        ["worker", "needs at least one worker"],
    ),
    (
        "ps absent for multi_worker_mirrored",
        "strategy: multi_worker_mirrored\nmaster: 10.0.0.1:1\nworker: [10.0.0.2:1]\n",
        "strategy: multi_worker_mirrored\n" + PS_OK,
        ["ps", "has no ps"],
    ),
    ("a trainer is listed", "worker: [10.0.0.2:1]\n", "num_clones: 1\n", ["no trainer is listed"]),
    (
        "known strategy",
        PS_OK + "strategy: parameter_server\n",
        PS_OK + "strategy: paramserver\n",
        ["strategy", "'paramserver'", "did you mean 'parameter_server'"],
    ),
    ("num_clones positive", PS_OK + "num_clones: 2\n", PS_OK + "num_clones: 0\n", ["num_clones", "positive"]),
    (
        "num_clones not bool",
        PS_OK + "num_clones: 1\n",
        PS_OK + "num_clones: true\n",
        ["num_clones", "positive"],
    ),
    (
        "hosts is a mapping",
        PS_OK + "hosts: {10.0.0.2: {os: linux}}\n",
        PS_OK + "hosts: [10.0.0.2]\n",
        ["hosts", "not a mapping"],
    ),
    (
        "hosts name a task's host",
        PS_OK + "hosts: {10.0.0.2: {os: linux}}\n",
        PS_OK + "hosts: {10.0.0.99: {os: linux}}\n",
        ["hosts.10.0.0.99", "no task"],
    ),
    (
        "host os known",
        PS_OK + "hosts: {10.0.0.2: {os: windows}}\n",
        PS_OK + "hosts: {10.0.0.2: {os: macos}}\n",
        ["hosts.10.0.0.2.os", "'macos'", "linux, windows"],
    ),
    (
        "host keys known",
        PS_OK + "hosts: {10.0.0.2: {venv: /v}}\n",
        PS_OK + "hosts: {10.0.0.2: {vnev: /v}}\n",
        ["hosts.10.0.0.2.vnev", "did you mean 'venv'"],
    ),
    (
        "host user a name its os takes",
        PS_OK + "hosts: {10.0.0.2: {os: linux, user: od}}\n",
        PS_OK + "hosts: {10.0.0.2: {os: linux, user: 'LAB\\od'}}\n",
        ["hosts.10.0.0.2.user", "'LAB\\od'", "not a Linux user name", "such as od or 1000"],
    ),
    (
        "host user of an os not declared: a name of both, or the system account",
        PS_OK + "hosts: {10.0.0.2: {user: SYSTEM}}\n",
        PS_OK + "hosts: {10.0.0.2: {user: 'od@lab.example'}}\n",
        ["hosts.10.0.0.2.user", "the host's os is not declared", "declare its os"],
    ),
    (
        "python or venv, not both",
        PS_OK + "hosts: {10.0.0.2: {python: /p}}\n",
        PS_OK + "hosts: {10.0.0.2: {python: /p, venv: /v}}\n",
        ["both 'python' and 'venv'"],
    ),
    (
        "same num_clones on every parameter_server worker",
        PS_OK + "hosts: {10.0.0.2: {num_clones: 2}, 10.0.0.3: {num_clones: 2}}\n",
        PS_OK + "hosts: {10.0.0.2: {num_clones: 2}}\n",
        ["same num_clones on every worker", "worker:0=2, worker:1=1"],
    ),
    (
        "evaluator is one address",
        PS_OK + "evaluator: 10.0.0.5\n",
        PS_OK + "evaluator: [10.0.0.5, 10.0.0.6]\n",
        ["evaluator", "exactly one evaluator"],
    ),
    (
        "checkpoint_port is a port",
        PS_OK + "checkpoint_port: 2230\n",
        PS_OK + "checkpoint_port: 70000\n",
        ["checkpoint_port: '70000'", "between 1 and 65535"],
    ),
    (
        "checkpoint_port is free on the master's machine",
        PS_LOOP + "checkpoint_port: 2226\n",
        PS_LOOP + "checkpoint_port: 2224\n",
        ["checkpoint_port: '2224'", "worker[1] uses that port on the master's machine"],
    ),
    (
        "min_trainers: more than half of the trainers",
        MWM3 + "min_trainers: 2\nmembership_port: 2226\n",
        MWM4 + "min_trainers: 2\nmembership_port: 2226\n",
        [
            "min_trainers: '2'",
            "2 of 4 trainers would let both sides of a split network train apart",
            "3 or more",
        ],
    ),
    (
        "min_trainers: a number of trainers",
        MWM3 + "min_trainers: 3\nmembership_port: 2226\n",
        MWM3 + "min_trainers: 4\nmembership_port: 2226\n",
        ["min_trainers: '4'", "between 1 and 3"],
    ),
    (
        "min_trainers needs membership_port",
        MWM3 + "min_trainers: 2\nmembership_port: 2226\n",
        MWM3 + "min_trainers: 2\n",
        ["min_trainers: '2'", "needs membership_port", "membership_port: 2226"],
    ),
    (
        "membership_port only with min_trainers",
        MWM3,
        MWM3 + "membership_port: 2226\n",
        ["membership_port: '2226'", "used only with min_trainers"],
    ),
    (
        "min_trainers under parameter_server counts the master and the workers",
        PS_OK + "min_trainers: 2\nmembership_port: 2226\ncheckpoint_port: 2230\n",
        PS_OK + "min_trainers: 1\nmembership_port: 2226\ncheckpoint_port: 2230\n",
        ["min_trainers: '1'", "1 of 3 trainers would let both sides", "2 or more"],
    ),
    (
        "min_trainers under parameter_server needs checkpoint_port",
        PS_OK + "min_trainers: 2\nmembership_port: 2226\ncheckpoint_port: 2230\n",
        PS_OK + "min_trainers: 2\nmembership_port: 2226\n",
        ["min_trainers: '2'", "needs checkpoint_port", "checkpoint_port: 2230"],
    ),
    (
        "membership_port is free on every trainer's machine",
        MWM3 + "min_trainers: 2\nmembership_port: 2226\ncheckpoint_port: 2230\n",
        MWM3 + "min_trainers: 2\nmembership_port: 2222\n",
        ["membership_port: '2222'", "master uses that port on a trainer's machine"],
    ),
    (
        "membership_port is not checkpoint_port",
        MWM3 + "min_trainers: 2\nmembership_port: 2226\ncheckpoint_port: 2230\n",
        MWM3 + "min_trainers: 2\nmembership_port: 2230\ncheckpoint_port: 2230\n",
        ["membership_port: '2230'", "checkpoint_port is the same port"],
    ),
    (
        "checkpoint_port is free on every trainer's machine when the lead may move",
        MWM3 + "checkpoint_port: 2223\n",
        MWM3 + "checkpoint_port: 2223\nmin_trainers: 2\nmembership_port: 2226\n",
        [
            "checkpoint_port: '2223'",
            "worker[1] uses that port on a trainer's machine",
            "any trainer may become the lead",
        ],
    ),
    (
        "sync_every is a number of steps",
        MWM3 + "sync_every: 25\n",
        MWM3 + "sync_every: 0\n",
        ["sync_every: '0'", "not a number of steps", "sync_every: 25"],
    ),
    (
        "sync_every only under multi_worker_mirrored",
        MWM3 + "sync_every: 25\n",
        PS_OK + "sync_every: 25\n",
        ["sync_every: '25'", "parameter_server has no replicas to average", "multi_worker_mirrored"],
    ),
    (
        "the outer step only with sync_every",
        MWM3 + "sync_every: 25\nouter_learning_rate: 1.0\nouter_momentum: 0\n",
        MWM3 + "outer_momentum: 0\n",
        ["outer_momentum: '0'", "used only with sync_every"],
    ),
    (
        "the outer momentum is below 1",
        MWM3 + "sync_every: 25\nouter_momentum: 0.9\n",
        MWM3 + "sync_every: 25\nouter_momentum: 1\n",
        ["outer_momentum: '1'", "from 0 to below 1"],
    ),
    (
        "the outer learning rate is above 0",
        MWM3 + "sync_every: 25\nouter_learning_rate: 0.7\n",
        MWM3 + "sync_every: 25\nouter_learning_rate: 0\n",
        ["outer_learning_rate: '0'", "above 0"],
    ),
    ("YAML syntax with line", PS_OK, PS_OK + "ps: [10.0.0.9:1\n", ["line 6", "invalid YAML"]),
    ("duplicate YAML keys", PS_OK, PS_OK + "ps: [10.0.0.9:1]\n", ["line 5", "duplicate key 'ps'", "line 4"]),
    ("no YAML aliases", PS_OK, "x: &w [10.0.0.2:1]\nworker: *w\n", ["aliases", "*w"]),
]


@pytest.mark.parametrize("rule,good,bad,fragments", RULES, ids=[r[0] for r in RULES])
def test_rule(rule, good, bad, fragments):
    assert problems_of(good) == []
    found = problems_of(bad)
    assert found, f"{rule}: refused case was accepted"
    joined = "\n".join(found)
    for fragment in fragments:
        assert fragment in joined, f"{rule}: {fragment!r} not in {joined!r}"


def test_every_problem_names_key_value_and_fix():
    text = PS_OK.replace("10.0.0.4:2222", "10.0.0.4:0") + "num_clones: -1\nworkerz: 1\n"
    for p in problems_of(text):
        key, value, rest = p.split(": ", 2)
        assert key and value.startswith("'") and ";" in rest, p


def test_strategy_inferred_from_ps():
    assert load_text(PS_OK).strategy == "parameter_server"
    assert load_text("master: 10.0.0.1:1\nworker: [10.0.0.2:1]\n").strategy == "multi_worker_mirrored"


def test_chief_is_master_and_single_string_worker_is_a_list():
    c = load_text("chief: 10.0.0.1:1\nworker: 10.0.0.2:1\n")
    assert str(c.master) == "10.0.0.1:1"
    assert [str(a) for a in c.workers] == ["10.0.0.2:1"]


def test_cluster_is_frozen():
    c = load_text(PS_OK)
    with pytest.raises(AttributeError):
        c.num_clones = 3
    with pytest.raises(TypeError):
        c.hosts["10.0.0.2"] = None


def test_hostile_files_fail_fast(tmp_path):
    import time

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi")
    )
    deep = "a: " + "[" * 10000 + "]" * 10000 + "\n"
    huge = tmp_path / "huge.yaml"
    huge.write_text("a: " + "x" * (safe_yaml.MAX_BYTES + 10) + "\n")
    cases = {"bomb": (bomb, "aliases"), "deep": (deep, "nesting deeper")}
    for name, (text, fragment) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        start = time.monotonic()
        with pytest.raises(InvalidCluster) as e:
            cluster_mod.load(str(path))
        assert fragment in str(e.value)
        assert time.monotonic() - start < 5  # a guard against a hang, not a speed target
    with pytest.raises(InvalidCluster, match="larger than"):
        cluster_mod.load(str(huge))


def test_unreadable_and_binary_files(tmp_path):
    with pytest.raises(InvalidCluster, match="cannot read"):
        cluster_mod.load(str(tmp_path / "missing.yaml"))
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(InvalidCluster, match="not UTF-8"):
        cluster_mod.load(str(path))


# ----- task rules -----------------------------------------------------------------------------


def test_index_in_range():
    c = load_text(PS_OK)
    assert placement.check_task(c, "worker", 1) == []
    assert "indexes 0 to 1" in placement.check_task(c, "worker", 2)[0]
    assert placement.check_task(c, "master", 0) == []
    assert "only one master" in placement.check_task(c, "master", 1)[0]
    assert placement.check_task(c, "chief", 0) == []
    assert "unknown role" in placement.check_task(c, "boss", 0)[0]
    assert "lists no evaluator" in placement.check_task(c, "evaluator", 0)[0]


def test_public_addresses_need_opt_in():
    c = load_text(PS_OK.replace("10.0.0.4", "8.8.8.8"))
    found = placement.check_public(c, allow_public=False)
    assert len(found) == 1 and "ps[0]" in found[0] and "--allow_public_addresses" in found[0]
    assert "no authentication" in found[0]
    assert placement.check_public(c, allow_public=True) == []
    assert placement.check_public(load_text(PS_OK), allow_public=False) == []


class FakeMachine:
    """Stands in for this machine's addresses in the pure ordering rules (the real lookup is
    tested in test_hostinfo.py)."""

    def __init__(self, *hosts):
        self.hosts = set(hosts)

    def is_local(self, host):
        return host in self.hosts


def test_ordering_check_names_the_right_index():
    c = load_text(PS_OK)
    me = FakeMachine("10.0.0.3")
    assert placement.check_this_machine(c, "worker", 1, me.is_local) == []
    found = placement.check_this_machine(c, "worker", 0, me.is_local)
    assert "worker[0]" in found[0] and "this machine is worker index 1, not 0" in found[0]
    assert "no entry" in placement.check_this_machine(c, "worker", 0, FakeMachine().is_local)[0]


def test_role_inference():
    c = load_text(PS_OK)
    task, problems = placement.infer_task(c, FakeMachine("10.0.0.4").is_local)
    assert problems == [] and task.name == "ps:0"
    task, problems = placement.infer_task(c, FakeMachine().is_local)
    assert task is None and "no entry" in problems[0]
    task, problems = placement.infer_task(c, FakeMachine("10.0.0.2", "10.0.0.3").is_local)
    assert task is None and "worker:0, worker:1" in problems[0]


def test_loopback_cluster_skips_host_check():
    c = load_text(PS_LOOP)
    assert c.loopback_only()
    assert placement.check_this_machine(c, "worker", 1, FakeMachine().is_local) == []
    assert not load_text(PS_OK).loopback_only()


MORE_RULES = [
    (
        "loopback only with loopback",
        PS_LOOP,
        PS_OK.replace("10.0.0.4", "127.0.0.1"),
        ["ps[0]", "a loopback address in a cluster that also lists other machines"],
    ),
    (
        "localhost is 127.0.0.1",
        PS_LOOP,
        PS_OK.replace("10.0.0.", "127.0.0.")
        .replace("127.0.0.4", "localhost")
        .replace("127.0.0.3:2222", "127.0.0.1:2222")
        .replace("127.0.0.2", "127.0.0.1")
        .replace("127.0.0.1:2222]", "127.0.0.1:2223]"),
        ["same address as"],
    ),
    (
        "ports are ASCII digits",
        PS_OK,
        PS_OK.replace("10.0.0.4:2222", "10.0.0.4:2\u00b2"),
        ["ps[0]", "not a number"],
    ),
    (
        "IPv6 without port hint",
        PS_OK + "evaluator: '[fe80::1]'\n",
        PS_OK + "evaluator: 'fe80::1'\n",
        ["must be in brackets", "[fe80::1]:PORT"],
    ),
]


LOOP = "master: 127.0.0.1:2229\nworker: ['[::1]:2230', 127.0.0.1:2231]\nps: [127.0.0.1:2232]\n"
EDGES = [
    (
        "hosts: one machine in two spellings",
        PS_OK.replace("10.0.0.2", "box-b").replace("10.0.0.3", "box-c")
        + "hosts: {BOX-B: {os: linux}, box-c: {}}\n",
        PS_OK.replace("10.0.0.2", "box-b") + "hosts: {BOX-B: {os: linux}, box-b: {os: windows}}\n",
        ["hosts.box-b", "the same machine as hosts.BOX-B"],
    ),
    (
        "hosts: one IPv6 address in two spellings",
        PS_OK.replace("10.0.0.2:2222", "'[fd00::2]:2222'") + "hosts: {'[fd00::2]': {os: linux}}\n",
        PS_OK.replace("10.0.0.2:2222", "'[fd00::2]:2222'")
        + "hosts: {'fd00::2': {os: linux}, 'fd00:0:0::2': {}}\n",
        ["hosts.fd00:0:0::2", "the same machine as hosts.fd00::2"],
    ),
    (
        "hosts: a key with a port",
        PS_OK + "hosts: {10.0.0.2: {os: linux}}\n",
        PS_OK + "hosts: {'10.0.0.2:2222': {os: linux}}\n",
        ["hosts.10.0.0.2:2222", "not host:port", "as 10.0.0.2"],
    ),
    (
        "loopback: [::1] and 127.0.0.1 share a port",
        LOOP,
        LOOP.replace("127.0.0.1:2231", "127.0.0.1:2230"),
        ["worker[1]", "same address as worker[0]", "loopback"],
    ),
    (
        "loopback: localhost and 127.0.0.2 share a port",
        LOOP,
        LOOP.replace("127.0.0.1:2231", "localhost:2231").replace("127.0.0.1:2232", "127.0.0.2:2231"),
        ["ps[0]", "same address as worker[1]"],
    ),
    (
        "YAML 1.1 base-60 numbers",
        PS_OK + "num_clones: 80\n",
        PS_OK + "num_clones: 1:20\n",
        ["line 5", "'1:20'", "base-60", "read as 80"],
    ),
]


@pytest.mark.parametrize("rule,good,bad,fragments", EDGES, ids=[r[0] for r in EDGES])
def test_cluster_file_edges(rule, good, bad, fragments):
    test_rule(rule, good, bad, fragments)


def test_host_names_resolved_for_the_public_rule():
    c = load_text(PS_OK.replace("10.0.0.4", "gpu-box.lab"))
    found = placement.check_public(c, False, {"gpu-box.lab": frozenset({"8.8.8.8"})})
    assert len(found) == 1 and "ps[0]" in found[0] and "gpu-box.lab resolves to 8.8.8.8" in found[0]
    assert placement.check_public(c, False, {"gpu-box.lab": frozenset({"10.0.0.4"})}) == []
    assert placement.check_public(c, True, {"gpu-box.lab": frozenset({"8.8.8.8"})}) == []


def test_a_name_that_does_not_resolve_is_unchecked_not_private(tmp_path, capsys):
    """The rule cannot judge a name that resolves to nothing here: it is said to be unchecked (one
    line per name, stderr) instead of passing silently as a private address."""
    import yaml

    from od_dist import cli

    c = load_text(PS_OK.replace("10.0.0.4", "gpu-box.lab"))
    (line,) = placement.unchecked_names(c, {"gpu-box.lab": frozenset()})
    assert line.startswith("gpu-box.lab: does not resolve on this machine") and "not checked" in line
    assert placement.unchecked_names(c, {"gpu-box.lab": frozenset({"10.0.0.4"})}) == []
    path = tmp_path / "c.yaml"  # .invalid never resolves (RFC 6761)
    path.write_text(yaml.safe_dump({"master": "10.0.0.1:2222", "worker": ["no-such-host.invalid:2222"]}))
    scripts = [
        "od-dist",
        "scripts",
        f"--cluster={path}",
        "--pipeline=p",
        "--model_dir=m",
        f"--out={tmp_path / 'o'}",
    ]
    code = cli.main(scripts)
    err = capsys.readouterr().err
    assert code == 0, err
    warnings = [x for x in err.splitlines() if "no-such-host.invalid" in x]
    assert len(warnings) == 1 and "whether it is a public internet address is not checked" in warnings[0], err
    code = cli.main([*scripts, "--allow_public_addresses"])
    assert code == 0 and "not checked" not in capsys.readouterr().err  # nothing is checked then


def test_name_lookups_resolve_what_resolves_and_print_nothing(capfd):
    from od_dist.cluster import hostinfo

    c = load_text(
        PS_OK.replace("10.0.0.4", "no-such-host.invalid").replace("10.0.0.3", "localhost.localdomain")
    )
    found = hostinfo.resolve_names(c)
    assert found["no-such-host.invalid"] == frozenset()
    assert "localhost" not in found and "10.0.0.2" not in found  # IP literals need no lookup
    out, err = capfd.readouterr()
    assert "Traceback" not in err + out


@pytest.mark.parametrize("rule,good,bad,fragments", MORE_RULES, ids=[r[0] for r in MORE_RULES])
def test_more_rules(rule, good, bad, fragments):
    test_rule(rule, good, bad, fragments)


def test_tf_config_shapes_give_clear_errors():
    import json

    base = {
        "cluster": {"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]},
        "task": {"type": "worker", "index": 0},
    }
    for bad, fragment in [
        (dict(base, task="chief"), "no valid task type"),
        (dict(base, task={"type": ["chief"]}), "no valid task type"),
        (dict(base, cluster=dict(base["cluster"], master=["d:1"])), "chief and master are the same"),
    ]:
        with pytest.raises(InvalidCluster, match=fragment):
            cluster_mod.from_tf_config(json.dumps(bad))
    cluster, role, index = cluster_mod.from_tf_config(json.dumps(base))
    assert (role, index, cluster.strategy) == ("worker", 0, "parameter_server")


def test_stop_markers_name_the_job():
    """Two jobs sharing a working directory (an NFS home) must not stop each other's servers: the
    marker names the job (from its cluster), the same in the file and in the TF_CONFIG made from it."""
    import json

    from od_dist.task import server

    a = load_text(PS_OK)
    b = load_text(PS_OK.replace("10.0.0.1:2222", "10.0.0.9:2222"))  # another master, same ps and port
    ps_a, ps_b = a.task("ps", 0), b.task("ps", 0)
    assert ps_a == ps_b  # the same role, index, host and port
    assert server.stop_marker(a, ps_a) != server.stop_marker(b, ps_b)
    assert server.stop_marker(a, ps_a).startswith(".od-dist-stop-")
    from_env = cluster_mod.from_tf_config(json.dumps(a.tf_config("ps", 0)))[0]
    assert server.stop_marker(from_env, ps_a) == server.stop_marker(a, ps_a)
    assert server.stop_marker(load_text(PS_OK + "evaluator: 10.0.0.5\n"), ps_a) == server.stop_marker(a, ps_a)
