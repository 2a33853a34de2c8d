"""`od-dist k8s` (a JobSet by default): every manifest is valid against JobSet's own CRD and the
creation checks of its webhook; each pod's TF_CONFIG and command line, filled in as Kubernetes fills
them in, are its task of the cluster file at the pods' DNS names; success, failure and restart
policies do what host/policy.py says; Kueue's label; resources; bad input refused. Pure
Python, in this process (no TensorFlow)."""

import json
import os

import jobset_schema
import pytest
import yaml
from absl import flags
from loopback import ROOT

from od_dist import cli
from od_dist.cli.data import define_shapes_flags
from od_dist.cli.flags import define_restart_flags, define_train_flags
from od_dist.cluster import spec as cluster_mod
from od_dist.host import config, policy
from od_dist.protocol import exit_codes
from od_dist.render import k8s

LAN = os.path.join(ROOT, "clusters", "lan-example.yaml")
PS_NO_EVALUATOR = (
    "master: 10.1.0.1:2223\nworker: [10.1.0.2:2222, 10.1.0.3:2225]\nps: [10.1.0.4:2224, 10.1.0.5:2224]\n"
)
MWMS = "master: 10.1.0.1:3000\nworker: [10.1.0.2:3001, 10.1.0.3:3001, 10.1.0.4:3002]\nevaluator: 10.1.0.5\n"
MWMS_WORKERS = "strategy: multi_worker_mirrored\nworker: [10.1.0.2:3001, 10.1.0.3:3001]\n"
CLUSTERS = {"lan-example": None, "ps": PS_NO_EVALUATOR, "mwms": MWMS, "mwms-workers": MWMS_WORKERS}
OPTIONS = {
    "plain": [],
    "queue": ["--queue=team-a", "--namespace=ml"],
    "gpus": ["--gpus", "--num_clones=2", "--cpu=2,worker=8", "--memory=8Gi,ps=4Gi"],
    "url": ["--model_dir=gs://bucket/run", "--max_restarts=0", "--grace_period=600"],
}


def cluster_file(tmp_path, which):
    if CLUSTERS[which] is None:
        return LAN
    path = tmp_path / f"{which}.yaml"
    path.write_text(CLUSTERS[which])
    return str(path)


def run(capsys, *args):
    code = cli.main(["od-dist", "k8s", *args])
    out, err = capsys.readouterr()
    return code, out, err


BASE = [
    "--pipeline=pipelines/shapes_retinanet.yaml",
    "--model_dir=runs/lan",
    "--image=registry.example/od-dist:1",
]


def write(capsys, cluster, *extra):
    code, out, err = run(capsys, f"--cluster={cluster}", *BASE, *extra)
    assert code == 0, err
    (doc,) = yaml.safe_load_all(out)
    return out, doc


def rjobs(doc):
    return {r["name"]: r for r in doc["spec"]["replicatedJobs"]}


def container(rjob):
    (c,) = rjob["template"]["spec"]["template"]["spec"]["containers"]
    return c


def pod_view(rjob, index):
    """Pod `index` of a replicated job as it runs: its environment and args with `$(VAR)` filled in."""
    c = container(rjob)
    env = jobset_schema.container_env(c, {"batch.kubernetes.io/job-completion-index": str(index)})
    return env, [jobset_schema.expand(a, env) for a in c["args"]]


def test_crd_is_the_released_file():
    assert jobset_schema.sha256_ok()
    rules = {" ".join(r.split()) for r in jobset_schema.cel_rules(jobset_schema.crd())}
    assert rules - {"self == oldSelf"} == set(jobset_schema.CEL_RULES)


def test_the_checks_refuse_what_the_server_would(capsys):
    """The schema test can fail: an unknown field, a wrong type, a misspelt policy, a bad reason."""
    _, doc = write(capsys, LAN)
    assert jobset_schema.schema_errors(doc) == [] and jobset_schema.create_errors(doc) == []
    for path, value in [
        (("spec", "sucessPolicy"), {"operator": "All"}),
        (("spec", "failurePolicy", "maxRestarts"), "3"),
        (("spec", "successPolicy", "operator"), "Every"),
        (("spec", "network", "enableDNSHostname"), True),
    ]:
        bad = json.loads(json.dumps(doc))
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert jobset_schema.schema_errors(bad), path
    bad = json.loads(json.dumps(doc))
    bad["spec"]["failurePolicy"]["rules"][0]["onJobFailureReasons"] = ["ExitCode2"]
    bad["spec"]["successPolicy"]["targetReplicatedJobs"] = ["chief"]
    assert len(jobset_schema.create_errors(bad)) == 2


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("which", CLUSTERS)
def test_every_manifest_matches_jobsets_crd(which, options, tmp_path, capsys):
    text, doc = write(capsys, cluster_file(tmp_path, which), *OPTIONS[options])
    assert text.startswith("# JobSet for ")  # the default kind
    assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
    assert jobset_schema.schema_errors(doc) == []
    assert jobset_schema.create_errors(doc) == []
    # No field the CEL rules govern.
    assert "volumeClaimPolicies" not in doc["spec"] and "startupPolicy" not in doc["spec"]
    assert not any("dependsOn" in r for r in doc["spec"]["replicatedJobs"])


@pytest.mark.parametrize("which", CLUSTERS)
def test_each_pod_is_its_task_at_its_dns_name(which, tmp_path, capsys, monkeypatch):
    """One replicated job per role of the file; pod i of a role, its env and args filled in by
    Kubernetes from its completion index, is task i: `train --role R --index i`, and a TF_CONFIG
    whose cluster is the file's tasks in the file's order at the pods' DNS names with the file's
    ports, which od-dist's own reader accepts for that very task."""
    path = cluster_file(tmp_path, which)
    original = cluster_mod.load(path)
    _, doc = write(capsys, path)
    name = doc["metadata"]["name"]
    assert doc["spec"]["network"] == {
        "enableDNSHostnames": True,
        "subdomain": name,
        "publishNotReadyAddresses": True,
    }
    jobs = rjobs(doc)
    assert list(jobs) == [r for r in ("ps", "master", "worker", "evaluator") if original.tasks_of(r)]
    for role, rjob in jobs.items():
        tasks = original.tasks_of(role)
        job = rjob["template"]["spec"]
        assert rjob["replicas"] == 1 and job["completionMode"] == "Indexed"
        assert job["completions"] == job["parallelism"] == len(tasks)
        for task in tasks:
            env, args = pod_view(rjob, task.index)
            assert args[:3] == ["train", f"--role={role}", f"--index={task.index}"]
            parsed, tf_role, tf_index = cluster_mod.from_tf_config(env["TF_CONFIG"])
            assert (tf_role, tf_index) == (role, task.index) and parsed.strategy == original.strategy
            for r in ("ps", "master", "worker", "evaluator"):
                seen = [t.address for t in parsed.tasks_of(r)]
                want = [
                    cluster_mod.Address(f"{name}-{r}-0-{t.index}.{name}", t.address.port)
                    for t in original.tasks_of(r)
                ]
                # The evaluator runs no server: only its own pod lists it.
                assert seen == (want if r != "evaluator" or role == "evaluator" else []), (role, r)
            # What `od-dist train` in the pod does with both: the same task, no host check.
            monkeypatch.setenv("TF_CONFIG", env["TF_CONFIG"])
            fv = flags.FlagValues()
            define_train_flags(fv)
            define_restart_flags(fv, 0)
            fv(["od-dist train", *args[1:]])
            selected = config.select(None, fv.role, fv.index, allow_public=True)
            assert (selected.task.role, selected.task.index) == (role, task.index)
            assert selected.source == "TF_CONFIG" and fv.model_dir == "/mnt/od-dist/runs/lan"
        # A pod told another index by its TF_CONFIG than by its args is refused (exit 2).
        env, args = pod_view(rjob, 0)
        monkeypatch.setenv("TF_CONFIG", env["TF_CONFIG"].replace('"index": 0', '"index": 7'))
        with pytest.raises(cluster_mod.InvalidCluster):
            config.select(None, role, 0, allow_public=True)


class Kubernetes:
    """What Kubernetes and the JobSet controller do with the manifest, pod failure after pod
    failure, by their documented rules (not by the renderer's intent):
    - a Job's podFailurePolicy: the first matching rule acts; FailJob fails the Job (reason
      PodFailurePolicy), Ignore replaces the pod without counting it, Count or no match counts it;
    - a Job's backoffLimit is the number of counted failures it tolerates in all, shared by every
      pod and index of the Job (backoffLimitPerIndex would be per index): one more fails the Job
      (reason BackoffLimitExceeded); a counted failure within it replaces that pod alone;
    - a failed Job: the JobSet's failurePolicy, its first rule matching the Job's reason and
      replicated job; with none, RestartJobSet, which past maxRestarts fails the JobSet; a
      restart recreates every Job, their counts of failures from 0."""

    def __init__(self, doc):
        self.doc = doc
        self.jobs = {r["name"]: r["template"]["spec"] for r in doc["spec"]["replicatedJobs"]}
        self.restarts = 0
        self.failed = dict.fromkeys(self.jobs, 0)

    def exits(self, role, code):
        if code == 0:
            return "done"
        job = self.jobs[role]
        action = "Count"
        for rule in job["podFailurePolicy"]["rules"]:
            codes = rule["onExitCodes"]
            if (code in codes["values"]) == (codes["operator"] == "In"):
                action = rule["action"]
                break
        if action == "Ignore":
            return "pod restarts alone"
        if action == "FailJob":
            reason = "PodFailurePolicy"
        else:
            self.failed[role] += 1
            if self.failed[role] <= job["backoffLimit"]:
                return "pod restarts alone"
            reason = "BackoffLimitExceeded"
        policy = self.doc["spec"]["failurePolicy"]
        action = "RestartJobSet"
        for rule in policy.get("rules", []):
            if reason in rule.get("onJobFailureReasons", [reason]) and role in rule.get(
                "targetReplicatedJobs", [role]
            ):
                action = rule["action"]
                break
        if action == "FailJobSet" or (action == "RestartJobSet" and self.restarts >= policy["maxRestarts"]):
            return "fails"
        if action == "RestartJobSet":
            self.restarts += 1
        self.failed = dict.fromkeys(self.jobs, 0)
        return "restarts all"


def outcome(doc, role, code):
    """A first failure: what Kubernetes does when a pod of `role` exits with `code`."""
    return Kubernetes(doc).exits(role, code)


SUPERVISOR = {
    policy.DONE: "done",
    policy.PERMANENT: "fails",
    policy.RESTART_TASK: "pod restarts alone",
    policy.RESTART_ALL: "restarts all",
}


@pytest.mark.parametrize("which", CLUSTERS)
def test_restarts_follow_the_supervisors_rules(which, tmp_path, capsys):
    """Exit 2 (and 1) fails the JobSet at once; 130, 137, 138, 143 restart a parameter_server worker
    alone and anything else every pod (a multi_worker_mirrored trainer: every trainer), exactly as
    host/policy.py decides under launch; the budget is --max_restarts; the evaluator's own
    supervisor restarts it whatever its exit, so a pod of it fails only when lost."""
    path = cluster_file(tmp_path, which)
    cluster = cluster_mod.load(path)
    _, doc = write(capsys, path, "--max_restarts=5")
    failure_policy = doc["spec"]["failurePolicy"]
    assert failure_policy["maxRestarts"] == 5 and failure_policy["restartStrategy"] == "BlockingRecreate"
    for role, rjob in rjobs(doc).items():
        job = rjob["template"]["spec"]
        assert job["template"]["spec"]["restartPolicy"] == "Never"
        for code in (2, 1, 3, 139, *sorted(exit_codes.RETRYABLE)):
            got = outcome(doc, role, code)
            if role == "evaluator":  # a permanent exit of the pod is its supervisor's own bad input
                want = "fails" if code not in exit_codes.RETRYABLE else "pod restarts alone"
            else:
                decided = policy.decide(cluster.strategy, role, code)
                if decided == policy.STOPPED_BY_PERSON:
                    # No one presses Ctrl+C at a pod (a JobSet is stopped by deleting it): a 130
                    # there is a task lost to a signal, restarted as a 143 is.
                    decided = policy.decide(cluster.strategy, role, exit_codes.TERMINATED)
                want = SUPERVISOR[decided]
            assert got == want, (role, code)
        assert job["backoffLimit"] == (5 if outcome(doc, role, 137) == "pod restarts alone" else 0)
    alone = [r for r in rjobs(doc) if outcome(doc, r, exit_codes.LOST_PEER) == "pod restarts alone"]
    assert alone == [
        r for r in ("worker", "evaluator") if (r != "worker" or cluster.ps) and cluster.tasks_of(r)
    ]
    evaluator = rjobs(doc).get("evaluator")
    if evaluator:
        _, args = pod_view(evaluator, 0)
        assert "--max_restarts=5" in args
    for role in set(rjobs(doc)) - {"evaluator"}:
        assert not any(a.startswith("--max_restarts") for a in pod_view(rjobs(doc)[role], 0)[1])
    # No budget: no restart anywhere; the evaluator's pod (`train --role evaluator`) still runs its
    # own supervisor, so it exits 0, 130 or 138 and never fails the JobSet with its own exit 1.
    text, doc = write(capsys, path, "--max_restarts=0")
    assert doc["spec"]["failurePolicy"]["maxRestarts"] == 0
    assert all(rjob["template"]["spec"]["backoffLimit"] == 0 for rjob in rjobs(doc).values())
    for rjob in rjobs(doc).values():
        assert not any(a.startswith("--max_restarts") for a in pod_view(rjob, 0)[1])
    assert ("its own supervisor" in text) == bool(cluster.evaluator)


@pytest.mark.parametrize("which", CLUSTERS)
def test_done_when_the_lead_trainer_and_the_evaluator_are(which, tmp_path, capsys):
    """A finished JobSet deletes the pods still running: the evaluator, which evaluates the final
    checkpoint after the master, is waited for too."""
    path = cluster_file(tmp_path, which)
    cluster = cluster_mod.load(path)
    text, doc = write(capsys, path)
    lead = "master" if cluster.master else "worker"
    want = [lead] + (["evaluator"] if cluster.evaluator else [])
    assert doc["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": want}
    assert f"# - Done when {' and '.join(want)} " in text


def test_queue_label_and_suspend(tmp_path, capsys):
    _, doc = write(capsys, LAN, "--queue=team-a")
    assert doc["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert doc["spec"]["suspend"] is True
    _, doc = write(capsys, LAN)
    assert "kueue.x-k8s.io/queue-name" not in doc["metadata"]["labels"] and "suspend" not in doc["spec"]


def test_queue_without_requests_is_warned(capsys):
    """Kueue charges a workload what its pods request: without --cpu/--memory, nothing."""
    warning = "od-dist k8s: warning: --queue team-a without --cpu and --memory: the pods request none"
    code, _, err = run(capsys, f"--cluster={LAN}", *BASE, "--queue=team-a")
    assert code == 0 and err.count("\n") == 1 and err.startswith(warning), err
    assert "pass --cpu=... and --memory=..." in err
    code, _, err = run(capsys, f"--cluster={LAN}", *BASE, "--queue=team-a", "--cpu=2")
    assert code == 0 and "without --memory: the pods request none" in err and "--cpu" not in err
    for extra in (["--queue=team-a", "--cpu=2", "--memory=4Gi"], ["--cpu=2"], []):
        code, _, err = run(capsys, f"--cluster={LAN}", *BASE, *extra)
        assert code == 0 and err == "", err


def test_resources_per_role(tmp_path, capsys):
    _, doc = write(capsys, LAN, "--cpu=2,worker=8", "--memory=16Gi,ps=4Gi", "--gpus")
    res = {r: container(j).get("resources") for r, j in rjobs(doc).items()}
    assert res["worker"] == {
        "requests": {"cpu": "8", "memory": "16Gi"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": 1},
    }
    assert res["ps"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    # Under parameter_server only the workers hold replicas: the master and evaluator get no GPU.
    assert (
        res["master"]
        == res["evaluator"]
        == {"requests": {"cpu": "2", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}
    )
    (tmp_path / "m.yaml").write_text(MWMS + "num_clones: 2\n")
    _, doc = write(capsys, str(tmp_path / "m.yaml"))
    gpus = {
        r: container(j).get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
        for r, j in rjobs(doc).items()
    }
    assert gpus == {"master": 2, "worker": 2, "evaluator": None}
    _, doc = write(capsys, LAN)  # one clone, GPUs not said: nothing asked for
    assert not any("resources" in container(j) for j in rjobs(doc).values())


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--kind=helm"], "--kind=helm: value should be one of <jobset|tfjob>"),
        (["--queue=Team_A"], "--queue: 'Team_A': not a Kueue LocalQueue name (a DNS label)"),
        (["--queue=" + "q" * 64], "--queue: '" + "q" * 64 + "': not a Kueue LocalQueue name"),
        (["--kind=tfjob", "--queue=team-a"], "--queue: 'team-a': Kueue's TFJob integration is off"),
        (["--name=" + "n" * 44], "the pod name " + "n" * 44 + "-evaluator-0-0-abcde would be 64 characters"),
        (["--cpu=lots"], "--cpu: 'lots': 'lots' is not a Kubernetes quantity"),
        (["--memory=chief=4Gi"], "--memory: 'chief=4Gi': 'chief' is not a role"),
        (["--gpus", "--clone_on_cpu"], "--gpus: 'True': the trainers' replicas are CPU devices"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(extra, fragment, tmp_path, capsys):
    out = tmp_path / "jobset.yaml"
    code, stdout, err = run(
        capsys, f"--cluster={LAN}", "--pipeline=p.yaml", "--model_dir=m", "--image=i", f"--out={out}", *extra
    )
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2 and len(lines) == 1 and fragment in lines[0], err
    assert not out.exists() and stdout == ""
    if extra[0].startswith("--name"):
        assert "over Kubernetes' limit of 63; pass a --name of at most 43 characters" in lines[0]
        code, _, err = run(
            capsys,
            f"--cluster={LAN}",
            "--pipeline=p.yaml",
            "--model_dir=m",
            "--image=i",
            "--name=" + "n" * 43,
        )
        assert code == 0, err


def test_fixed_addresses_become_dns_names_and_say_so(tmp_path, capsys):
    text, _ = write(capsys, LAN)
    (line,) = [x for x in text.splitlines() if x.startswith("# Hosts:")]
    assert "the pods' DNS names above with the ports of" in line and "not its addresses" in line


def test_tfjob_stays_available(capsys):
    text, doc = write(capsys, LAN, "--kind=tfjob", "--max_restarts=7", "--memory=8Gi")
    assert text.startswith("# Kubeflow TFJob") and doc["kind"] == "TFJob"
    assert doc["spec"]["runPolicy"]["backoffLimit"] == 7  # the same flag, the same budget
    pod = doc["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"] == {"memory": "8Gi"}


def test_out_is_replaced_whole(tmp_path, capsys):
    """--out is written beside and renamed over the old file: a reader of the old file keeps
    reading it whole, a symlink is replaced rather than written through, no temporary is left."""
    out = tmp_path / "jobset.yaml"
    out.write_text("old manifest\n" * 1000)
    base = [f"--cluster={LAN}", "--pipeline=p.yaml", "--model_dir=m", "--image=i", f"--out={out}"]
    with open(out) as reader:
        code, stdout, err = run(capsys, *base)
        assert code == 0 and stdout == "" and f"wrote {out}" in err, err
        assert reader.read() == "old manifest\n" * 1000
    assert yaml.safe_load(out.read_text())["kind"] == "JobSet"
    target = tmp_path / "kept.yaml"
    target.write_text("not od-dist's\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    code, _, err = run(capsys, *base[:-1], f"--out={link}")
    assert code == 0, err
    assert target.read_text() == "not od-dist's\n" and not link.is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["jobset.yaml", "kept.yaml", "link.yaml"]
    code, _, err = run(capsys, *base[:-1], f"--out={tmp_path}")
    assert code == 2 and "a directory" in err


def test_train_args_stand_for_every_task_of_a_role():
    from od_dist.cluster import commandline

    cluster = cluster_mod.from_document(
        {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"], "ps": ["10.0.0.3:1"]}
    )
    args = commandline.train_args(
        ["--num_clones=2", "--model_dir=m"], cluster, cluster.task("ps", 0), index="$(I)"
    )
    assert args == ["train", "--role=ps", "--index=$(I)", "--model_dir=m"]  # a ps holds no replicas
    assert (
        k8s.kubernetes_literal("--params_override=a: $(TF_CONFIG) $$")
        == "--params_override=a: $$(TF_CONFIG) $$$$"
    )


# ----- the image and the README's steps around the manifest -----------------------------------------


def dockerfile():
    """The repository's Dockerfile as (instruction, argument) pairs, continuation lines joined."""
    text = open(os.path.join(ROOT, "Dockerfile"), encoding="utf-8").read().replace("\\\n", " ")
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.strip().startswith("#")]
    return [tuple(x.split(None, 1)) for x in lines]


def test_the_dockerfile_installs_od_dist_as_the_readme_set_up_does(tmp_path):
    """docker cannot run here: what can be checked without it is. The image installs with the set-up
    command of README *Set up*, from files it copies that exist, are sent to the build and suffice
    to build the package (built here from those files alone); `od-dist` is on the pods' PATH; the
    demo's data is written where the demo pipeline's relative paths point, under the WORKDIR."""
    import fnmatch
    import shutil
    import subprocess
    import sys
    import zipfile

    steps = dockerfile()
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    block = readme.split("## Set up", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    (install,) = [line for line in block.splitlines() if "pip install" in line]
    assert install == "python3 -m venv .venv && .venv/bin/pip install -e ."
    assert ("RUN", install) in steps
    (workdir,) = [arg for op, arg in steps if op == "WORKDIR"]
    assert [arg for op, arg in steps if op == "ENV" and f"PATH={workdir}/.venv/bin:$PATH" in arg.split()]
    with open(os.path.join(ROOT, ".dockerignore"), encoding="utf-8") as f:
        ignored = [x.strip() for x in f if x.strip() and not x.startswith("#")]
    context = tmp_path / "context"
    before_install = steps[: steps.index(("RUN", install))]
    for op, arg in steps:
        if op != "COPY":
            continue
        *sources, target = arg.split()
        for source in sources:
            assert os.path.exists(os.path.join(ROOT, source)), source
            assert not any(fnmatch.fnmatch(source.rstrip("/"), pattern) for pattern in ignored), source
            if (op, arg) in before_install:  # what the install sees, where the image has it
                src, dest = os.path.join(ROOT, source), context / target
                if os.path.isdir(src):
                    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    dest.mkdir(parents=True, exist_ok=True)  # the Dockerfile's targets are folders
                    shutil.copy(src, dest)
    wheels = tmp_path / "wheels"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(context),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (wheel,) = os.listdir(wheels)
    names = zipfile.ZipFile(wheels / wheel).namelist()
    package = sorted(
        os.path.relpath(os.path.join(root, n), ROOT)
        for root, _, files in os.walk(os.path.join(ROOT, "od_dist"))
        for n in files
        if n.endswith(".py")
    )
    assert sorted(n for n in names if n.startswith("od_dist/") and n.endswith(".py")) == package
    # The demo's data: `od-dist data shapes` (its default --out) where the demo pipeline reads it.
    assert ("RUN", "od-dist data shapes") in steps
    fv = flags.FlagValues()
    define_shapes_flags(fv)
    with open(os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml"), encoding="utf-8") as f:
        pipeline = yaml.safe_load(f)
    for split in ("train_data", "validation_data"):
        path = pipeline["task"][split]["input_path"]
        assert not os.path.isabs(path) and os.path.dirname(path) == fv["out"].default, path
    assert ("COPY", "pipelines/ pipelines/") in steps


def test_the_readme_installs_the_jobset_release_the_tests_check_against(capsys):
    """The controller's install command (docs/kubernetes.md, Running it) is the release of the CRD
    in tests/crd/; the names the steps after `kubectl apply` use are the ones od-dist writes."""
    page = open(os.path.join(ROOT, "docs", "kubernetes.md"), encoding="utf-8").read()
    section = page.split("## Running it", 1)[1].split("\n## ", 1)[0]
    version = os.path.basename(jobset_schema.CRD).split(".v", 1)[1].split(".yaml")[0]
    command = (
        "kubectl apply --server-side -f "
        f"https://github.com/kubernetes-sigs/jobset/releases/download/v{version}/manifests.yaml"
    )
    assert command in section
    _, doc = write(capsys, LAN)
    name = doc["metadata"]["name"]
    assert f"kubectl get jobset {name}" in section
    assert f"job/{name}-master-0" in section and f"job/{name}-evaluator-0" in section
    (claim,) = {
        v["persistentVolumeClaim"]["claimName"]
        for rj in doc["spec"]["replicatedJobs"]
        for v in rj["template"]["spec"]["template"]["spec"]["volumes"]
    }
    assert f'"claimName": "{claim}"' in section and "--model_dir=/mnt/od-dist/runs/lan" in section
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "docker build -t registry.example/od-dist:0.1 ." in readme.split("## On Kubernetes", 1)[1]


@pytest.mark.parametrize("which", ["lan-example", "ps"])
def test_the_budget_of_workers_restarted_alone_is_shared_as_under_launch(which, tmp_path, capsys):
    """--max_restarts 2, parameter_server: lost workers are restarted alone twice in all, as launch
    restarts them. The worker Job's backoffLimit is shared by its pods: the third lost worker,
    whichever its index, fails the JobSet rather than restarting every pod. (Past its budget launch
    lets that worker end alone and trains on; a JobSet's failure policy has no action that lets one
    of its Jobs fail while the others go on.)"""
    path = cluster_file(tmp_path, which)
    _, doc = write(capsys, path, "--max_restarts=2")
    k = Kubernetes(doc)
    assert [k.exits("worker", 137) for _ in range(3)] == ["pod restarts alone"] * 2 + ["fails"]
    k = Kubernetes(doc)  # a ps lost restarts every pod, and their counts start over
    assert k.exits("worker", 137) == "pod restarts alone"
    assert k.exits("ps", 137) == "restarts all"
    assert [k.exits("worker", 143) for _ in range(3)] == ["pod restarts alone"] * 2 + ["fails"]
