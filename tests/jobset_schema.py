"""What the Kubernetes API server would say to a JobSet, offline: JobSet's own CRD schema (tests/crd/,
unknown fields refused where the server would prune them), the creation checks of JobSet's webhook
(pkg/webhooks/jobset_webhook.go at the same release) and of the Job API (batch/v1 validation)
that the schema cannot express, and Kubernetes' `$(VAR)` expansion of a container's env and args."""

import copy
import functools
import gzip
import hashlib
import os
import re

import jsonschema
import yaml

CRD = os.path.join(os.path.dirname(__file__), "crd", "jobset.x-k8s.io_jobsets.v0.12.0.yaml.gz")
CRD_SHA256 = "d022b87624512cf0b6741b31b24a2bea9945b5a838b50713af29332c878bb6fe"
VERSION = "v1alpha2"
# CEL rules of the CRD, besides `self == oldSelf` (updates only): each is about fields od-dist never
# writes, which the tests check; a new rule in a newer CRD fails test_crd_is_the_released_file.
CEL_RULES = {
    "self.templates.all(t, !has(t.metadata.namespace) || size(t.metadata.namespace) == 0)": "volumeClaimPolicies",
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))": "dependsOn",
}
JOB_FAILURE_REASONS = {
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
}
RULE_NAME = re.compile(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?")
DNS_1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


def crd_bytes() -> bytes:
    with gzip.open(CRD) as f:
        return f.read()


@functools.cache
def crd() -> dict:
    return yaml.load(crd_bytes(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def cel_rules(node) -> list[str]:
    out = []
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            out.append(" ".join(rule["rule"].split()))
        for v in node.values():
            out += cel_rules(v)
    elif isinstance(node, list):
        for v in node:
            out += cel_rules(v)
    return out


def closed(schema):
    """The structural schema with unknown fields refused: every object that lists its properties,
    keeps no unknown fields and has no additionalProperties schema gets `additionalProperties:
    false` (what the API server prunes silently becomes an error here)."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


_VALIDATOR = None


def validator():
    global _VALIDATOR
    if _VALIDATOR is None:
        (version,) = [v for v in crd()["spec"]["versions"] if v["name"] == VERSION]
        schema = closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
        _VALIDATOR = jsonschema.Draft7Validator(schema)
    return _VALIDATOR


def schema_errors(doc) -> list[str]:
    return [f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator().iter_errors(doc)]


def create_errors(doc) -> list[str]:
    """The webhook's and the Job API's checks at creation that the schema leaves out."""
    errors = []
    name, spec = doc["metadata"]["name"], doc["spec"]
    rjobs = spec["replicatedJobs"]
    names = [r["name"] for r in rjobs]
    if len(set(names)) != len(names):
        errors.append(f"replicatedJobs: names not unique: {names}")
    subdomain = spec.get("network", {}).get("subdomain")
    if subdomain is not None and not (len(subdomain) <= 63 and DNS_1035.fullmatch(subdomain)):
        errors.append(f"network.subdomain: {subdomain!r}")
    for r in rjobs:
        job = r["template"]["spec"]
        replicas = r.get("replicas", 1)
        job_name = f"{name}-{r['name']}-{replicas - 1}"
        if not (len(job_name) <= 63 and DNS_1035.fullmatch(job_name)):
            errors.append(f"job name {job_name!r}")
        if job.get("completionMode") == "Indexed":
            if "completions" not in job:
                errors.append(f"{r['name']}: an Indexed Job needs completions")
            pod_name = f"{job_name}-{job['completions'] - 1}-abcde"
            if not (len(pod_name) <= 63 and DNS_1035.fullmatch(pod_name)):
                errors.append(f"pod name {pod_name!r}")
        pod = job["template"]["spec"]
        containers = {c["name"] for c in pod["containers"]}
        policy = job.get("podFailurePolicy")
        if policy:
            if pod.get("restartPolicy") != "Never":
                errors.append(f"{r['name']}: podFailurePolicy needs restartPolicy Never")
            for rule in policy["rules"]:
                codes = rule.get("onExitCodes")
                if codes:
                    values = codes["values"]
                    if values != sorted(set(values)):
                        errors.append(f"{r['name']}: onExitCodes values must be unique and ordered")
                    if codes["operator"] == "In" and 0 in values:
                        errors.append(f"{r['name']}: onExitCodes In 0")
                    if "containerName" in codes and codes["containerName"] not in containers:
                        errors.append(f"{r['name']}: no container {codes['containerName']!r}")
        env = [e["name"] for c in pod["containers"] for e in c.get("env", [])]
        if len(set(env)) != len(env):
            errors.append(f"{r['name']}: env names repeated: {env}")
    targets = spec.get("successPolicy", {}).get("targetReplicatedJobs", [])
    errors += [f"successPolicy: no replicated job {t!r}" for t in targets if t not in names]
    rules = spec.get("failurePolicy", {}).get("rules", [])
    for rule in rules:
        if not (1 <= len(rule["name"]) <= 128 and RULE_NAME.fullmatch(rule["name"])):
            errors.append(f"failurePolicy rule name {rule['name']!r}")
        errors += [
            f"failurePolicy: no replicated job {t!r}"
            for t in rule.get("targetReplicatedJobs", [])
            if t not in names
        ]
        errors += [
            f"failurePolicy: reason {x!r}"
            for x in rule.get("onJobFailureReasons", [])
            if x not in JOB_FAILURE_REASONS
        ]
    if len({r["name"] for r in rules}) != len(rules):
        errors.append("failurePolicy: rule names not unique")
    return errors


def expand(text: str, env: dict) -> str:
    """Kubernetes' expansion of `$(VAR)` in a container's env values and args
    (k8s.io/kubernetes third_party/forked/golang/expansion): `$$` is `$`, `$(NAME)` the variable
    when it is defined (else left as written), any other `$` itself."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            if nxt == "(":
                end = text.find(")", i + 2)
                if end != -1:
                    var = text[i + 2 : end]
                    out.append(env.get(var, f"$({var})"))
                    i = end + 1
                    continue
                out.append("$(")
                i += 2
                continue
            out.append("$" + nxt)
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def container_env(container: dict, annotations: dict) -> dict:
    """The container's environment as the kubelet builds it: each variable in order, a value
    expanded with the ones before it, a fieldRef to an annotation read from `annotations`."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        else:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            key = re.fullmatch(r"metadata\.annotations\['([^']+)'\]", path).group(1)
            env[e["name"]] = annotations[key]
    return env


def sha256_ok() -> bool:
    return hashlib.sha256(crd_bytes()).hexdigest() == CRD_SHA256
