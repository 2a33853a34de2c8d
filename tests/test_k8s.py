"""`od-dist k8s --kind tfjob`: the TFJob manifest parses, has the replica types, counts, ports, container,
restart policies and volume it should, and the TF_CONFIG the training operator renders for each
pod from it goes through od-dist's own TF_CONFIG reader to the same roles, indexes and counts as
the cluster file."""

import json
import os

import pytest
import yaml
from loopback import ROOT, od_dist

from od_dist.cli.flags import LAUNCH_MAX_RESTARTS
from od_dist.cluster import spec as cluster_mod
from od_dist.render import k8s

LAN = os.path.join(ROOT, "clusters", "lan-example.yaml")
ROLE_OF = {"PS": "ps", "Chief": "master", "Worker": "worker", "Evaluator": "evaluator"}

MWMS = """\
master: 10.1.0.1:3000
worker: [10.1.0.2:3001, 10.1.0.3:3001, 10.1.0.4:3001]
evaluator: 10.1.0.5
"""


def render(path, *extra):
    r = od_dist(
        "k8s",
        f"--cluster={path}",
        "--pipeline=pipelines/shapes_retinanet.yaml",
        "--model_dir=runs/lan",
        "--image=registry.example/od-dist:1",
        "--kind=tfjob",
        *extra,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def operator_tf_configs(job, namespace="default"):
    """What the Kubeflow training operator (pkg/controller.v1/tensorflow/tensorflow.go, genClusterSpec)
    sets as TF_CONFIG in each pod: every replica type in lower case, each replica as the headless
    service <job>-<type>-<i>.<namespace>.svc with the container's tfjob-port."""
    name, specs = job["metadata"]["name"], job["spec"]["tfReplicaSpecs"]

    def port(spec):
        container = next(c for c in spec["template"]["spec"]["containers"] if c["name"] == "tensorflow")
        return next(p["containerPort"] for p in container["ports"] if p["name"] == "tfjob-port")

    cluster = {
        rt.lower(): [f"{name}-{rt.lower()}-{i}.{namespace}.svc:{port(s)}" for i in range(s["replicas"])]
        for rt, s in specs.items()
    }
    for rt, spec in specs.items():
        for i in range(spec["replicas"]):
            yield (
                rt,
                i,
                json.dumps(
                    {"cluster": cluster, "task": {"type": rt.lower(), "index": i}, "environment": "cloud"}
                ),
            )


@pytest.mark.parametrize("text", [None, MWMS], ids=["lan-example", "multi_worker_mirrored"])
def test_operator_tf_config_resolves_to_the_cluster_files_tasks(tmp_path, text):
    path = LAN
    if text:
        path = str(tmp_path / "mwms.yaml")
        (tmp_path / "mwms.yaml").write_text(text)
    original = cluster_mod.load(path)
    job = yaml.safe_load(render(path))
    seen = []
    for rt, i, tf_config in operator_tf_configs(job):
        parsed, role, index = cluster_mod.from_tf_config(tf_config)
        assert (role, index) == (ROLE_OF[rt], i)
        assert parsed.strategy == original.strategy
        for r in ("ps", "master", "worker", "evaluator"):
            assert len(parsed.tasks_of(r)) == len(original.tasks_of(r)), r
        # Servers see the same TensorFlow cluster shape (the evaluator stays out of it).
        assert {j: len(v) for j, v in parsed.cluster_spec().items()} == {
            j: len(v) for j, v in original.cluster_spec().items()
        }
        seen.append((role, index))
    assert sorted(seen) == sorted((t.role, t.index) for t in original.tasks())


def test_manifest_structure():
    text = render(LAN, "--wait_timeout=600", "--num_clones=2")
    assert text.startswith("# Kubeflow TFJob")  # the reasoning header is YAML comments
    job = yaml.safe_load(text)
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    assert job["metadata"]["name"] == "od-dist-lan-example"
    # The evaluator outlives the chief (the final checkpoint): no pod is deleted when the job ends.
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "None", "backoffLimit": LAUNCH_MAX_RESTARTS}
    specs = job["spec"]["tfReplicaSpecs"]
    assert list(specs) == ["PS", "Chief", "Worker", "Evaluator"]
    assert {rt: s["replicas"] for rt, s in specs.items()} == {
        "PS": 1,
        "Chief": 1,
        "Worker": 2,
        "Evaluator": 1,
    }
    ports = {rt: s["template"]["spec"]["containers"][0]["ports"] for rt, s in specs.items()}
    assert ports == {
        "PS": [{"name": "tfjob-port", "containerPort": 2224}],
        "Chief": [{"name": "tfjob-port", "containerPort": 2223}],
        "Worker": [{"name": "tfjob-port", "containerPort": 2222}],
        "Evaluator": [{"name": "tfjob-port", "containerPort": 2222}],
    }
    for rt, spec in specs.items():
        assert spec["restartPolicy"] == "ExitCode"  # Kubeflow retries exactly exit_codes.RETRYABLE
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "tensorflow" and container["image"] == "registry.example/od-dist:1"
        assert container["command"] == ["od-dist"]
        # --num_clones reaches the workers, the only replicas under parameter_server; the ps, the
        # coordinator and the evaluator run none and do not get it.
        clones = ["--num_clones=2"] if rt == "Worker" else []
        assert container["args"] == [
            "train",
            "--pipeline=pipelines/shapes_retinanet.yaml",
            "--model_dir=/mnt/od-dist/runs/lan",
            "--wait_timeout=600",
            *clones,
        ]
        assert ("resources" in container) == (rt == "Worker")
        # SIGTERM to SIGKILL: the trainer's loop plus a save, not Kubernetes' 30 s.
        assert pod["terminationGracePeriodSeconds"] == k8s.DEFAULT_GRACE_PERIOD
        assert not any(a.startswith(("--cluster", "--role", "--index")) for a in container["args"])
        assert container["volumeMounts"] == [{"name": "model-dir", "mountPath": "/mnt/od-dist"}]
        assert pod["volumes"] == [
            {"name": "model-dir", "persistentVolumeClaim": {"claimName": "od-dist-lan-example-model-dir"}}
        ]


def test_multi_worker_mirrored_has_no_ps(tmp_path):
    (tmp_path / "m.yaml").write_text(MWMS)
    job = yaml.safe_load(render(str(tmp_path / "m.yaml")))
    specs = job["spec"]["tfReplicaSpecs"]
    assert job["spec"]["runPolicy"]["cleanPodPolicy"] == "None"  # an evaluator
    (tmp_path / "n.yaml").write_text(MWMS.replace("evaluator: 10.1.0.5\n", ""))
    assert (
        yaml.safe_load(render(str(tmp_path / "n.yaml")))["spec"]["runPolicy"]["cleanPodPolicy"] == "Running"
    )
    assert {rt: s["replicas"] for rt, s in specs.items()} == {"Chief": 1, "Worker": 3, "Evaluator": 1}
    assert specs["Worker"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 3001


def test_grace_period_reaches_every_pod():
    job = yaml.safe_load(render(LAN, "--grace_period=900"))
    specs = job["spec"]["tfReplicaSpecs"]
    assert {rt: s["template"]["spec"]["terminationGracePeriodSeconds"] for rt, s in specs.items()} == {
        "PS": 900,
        "Chief": 900,
        "Worker": 900,
        "Evaluator": 900,
    }
    r = od_dist(
        "k8s",
        f"--cluster={LAN}",
        "--pipeline=p.yaml",
        "--model_dir=runs/x",
        "--image=img",
        "--grace_period=0",
        "--kind=tfjob",
    )
    assert r.returncode == 2 and "grace_period" in r.stderr, r.stderr


def test_out_file_name_namespace_pvc(tmp_path):
    out = tmp_path / "job.yaml"
    r = od_dist(
        "k8s",
        f"--cluster={LAN}",
        "--pipeline=p.yaml",
        "--model_dir=/data/runs/x",
        "--image=img",
        f"--out={out}",
        "--name=lan-job",
        "--namespace=ml",
        "--pvc=runs-claim",
        "--mount_path=/data",
        "--kind=tfjob",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # the manifest went to the file
    job = yaml.safe_load(out.read_text())
    assert job["metadata"]["name"] == "lan-job" and job["metadata"]["namespace"] == "ml"
    pod = job["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs-claim"
    assert pod["containers"][0]["volumeMounts"][0]["mountPath"] == "/data"
    assert "--model_dir=/data/runs/x" in pod["containers"][0]["args"]
    # The TF_CONFIG service names carry the namespace and still resolve.
    for rt, i, tf_config in operator_tf_configs(job, namespace="ml"):
        assert cluster_mod.from_tf_config(tf_config)[1:] == (ROLE_OF[rt], i)


def test_model_dir_placement():
    assert k8s.volume_model_dir("runs/lan", "/mnt/od-dist") == ("/mnt/od-dist/runs/lan", True)
    assert k8s.volume_model_dir("/mnt/od-dist/x", "/mnt/od-dist/") == ("/mnt/od-dist/x", True)
    assert k8s.volume_model_dir("gs://bucket/runs", "/mnt/od-dist") == ("gs://bucket/runs", False)
    for bad in ("/elsewhere/x", "/mnt/od-distx", r"C:\runs"):
        with pytest.raises(k8s.K8sError):
            k8s.volume_model_dir(bad, "/mnt/od-dist")


def test_url_model_dir_needs_no_volume():
    job = yaml.safe_load(
        k8s.render(
            cluster_mod.load(LAN),
            "clusters/lan-example.yaml",
            "img",
            ["--model_dir=gs://b/runs"],
            RESTARTS,
            "tfjob",
        )
    )
    pod = job["spec"]["tfReplicaSpecs"]["Chief"]["template"]["spec"]
    assert "volumes" not in pod and "volumeMounts" not in pod["containers"][0]


RESTARTS = k8s.Restarts(3, (130, 137, 138, 143))


def test_job_names():
    assert k8s.job_name("clusters/lan-example.yaml") == "od-dist-lan-example"
    assert k8s.job_name(r"C:\x\My_Cluster.YAML") == "od-dist-my-cluster"
    assert len(k8s.job_name("c/" + "x" * 80 + ".yaml")) <= 40
    with pytest.raises(k8s.K8sError):
        k8s.check_job_name("Bad_Name")


def test_errors_exit_2():
    r = od_dist("k8s", f"--cluster={LAN}", "--pipeline=p", "--model_dir=m")
    assert r.returncode == 2 and "--image" in r.stderr
    r = od_dist("k8s", f"--cluster={LAN}", "--pipeline=p", "--model_dir=m", "--image=i", "--role=ps")
    assert r.returncode == 2 and "--role" in r.stderr
    r = od_dist("k8s", f"--cluster={LAN}", "--pipeline=p", "--model_dir=/x", "--image=i")
    assert r.returncode == 2 and "not on the volume" in r.stderr


def pod_args(job):
    return {
        rt: s["template"]["spec"]["containers"][0]["args"] for rt, s in job["spec"]["tfReplicaSpecs"].items()
    }


def test_file_num_clones_reaches_every_trainer_pod(tmp_path):
    """The pods read TF_CONFIG, not the cluster file: its num_clones must be in their args."""
    (tmp_path / "ps.yaml").write_text(open(LAN).read().replace("num_clones: 1", "num_clones: 2"))
    job = yaml.safe_load(render(str(tmp_path / "ps.yaml")))
    args = pod_args(job)
    assert "--num_clones=2" in args["Worker"]
    for rt in ("PS", "Chief", "Evaluator"):  # no replicas there
        assert not any(a.startswith("--num_clones") for a in args[rt]), rt
    worker = job["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"] == {"limits": {"nvidia.com/gpu": 2}}
    # multi_worker_mirrored: the chief trains too; per-host num_clones count.
    (tmp_path / "m.yaml").write_text(MWMS + "num_clones: 2\nhosts: {10.1.0.1: {num_clones: 4}}\n")
    # 10 replicas in sync: a global batch they share (the demo's 8 is refused before rendering).
    batch = "--params_override=task.train_data.global_batch_size=20"
    args = pod_args(yaml.safe_load(render(str(tmp_path / "m.yaml"), batch)))
    assert "--num_clones=4" in args["Chief"] and "--num_clones=2" in args["Worker"]
    assert not any(a.startswith("--num_clones") for a in args["Evaluator"])
    # Worker pods share one template: workers with different num_clones cannot be rendered.
    (tmp_path / "d.yaml").write_text(MWMS + "hosts: {10.1.0.2: {num_clones: 2}}\n")
    r = od_dist("k8s", f"--cluster={tmp_path / 'd.yaml'}", "--pipeline=p", "--model_dir=m", "--image=i")
    assert r.returncode == 2 and "same num_clones" in r.stderr and "worker:0=2, worker:1=1" in r.stderr


def test_header_values_are_checked():
    """A newline in --pvc used to end the header comment and add a second Kubernetes document."""
    base = [
        f"--cluster={LAN}",
        "--pipeline=p",
        "--model_dir=m",
        "--image=registry.example/od-dist:1",
        "--kind=tfjob",
    ]
    for extra, fragment in [
        (["--pvc=claim\nkind: Secret"], "--pvc: 'claim\\nkind: Secret': contains a control character"),
        (["--pvc=Claim_1"], "--pvc: 'Claim_1': not a PersistentVolumeClaim name"),
        (["--namespace=ml\n---"], "--namespace: 'ml\\n---': contains a control character"),
        (["--namespace=ML.team"], "--namespace: 'ML.team': not a Kubernetes namespace"),
        (["--mount_path=mnt/od-dist"], "--mount_path: 'mnt/od-dist': not an absolute path"),
        (["--mount_path=/mnt\n# x"], "--mount_path: '/mnt\\n# x': contains a control character"),
        (
            ["--params_override=a: 1\nb: 2"],
            "--params_override: '--params_override=a: 1\\nb: 2': contains a control",
        ),
    ]:
        r = od_dist("k8s", *base, *extra)
        assert r.returncode == 2 and fragment in r.stderr, (extra, r.stderr)
    r = od_dist("k8s", *base[:3], "--image=registry.example/od dist")
    assert r.returncode == 2 and "--image" in r.stderr
    r = od_dist("k8s", *base, "--pvc=runs.claim-1", "--namespace=ml-team", "--mount_path=/data")
    assert r.returncode == 0, r.stderr
    assert len(list(yaml.safe_load_all(r.stdout))) == 1
