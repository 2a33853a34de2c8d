"""What the tests that run real jobs on simulated machines share (tests/netns.py's machines): a
cluster file whose hosts each have a working directory of their own (a machine's disk), the scripts
`od-dist scripts` writes for it, and the job those scripts start, one log per task."""

import re
import subprocess
import sys
import time

from loopback import PIPELINE, ROOT, TINY

PORT = 2222  # every machine has its own address, so every task can use the same port, as on a LAN


def write_cluster(tmp_path, text, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def job_cluster(tmp_path, net, roles, **extra):
    """A cluster file for `roles` ({machine index: 'master' | 'worker' | 'ps'}), whose hosts run
    this test's interpreter from a working directory of their own (the namespaces share the file
    system, as machines with the same install would)."""
    by_role = {
        r: [f"{net[i].ip}:{PORT}" for i, role in sorted(roles.items()) if role == r]
        for r in ("master", "worker", "ps")
    }
    lines = [f"master: {by_role['master'][0]}", f"worker: [{', '.join(by_role['worker'])}]"]
    if by_role["ps"]:
        lines.append(f"ps: [{', '.join(by_role['ps'])}]")
    evaluators = [i for i, role in roles.items() if role == "evaluator"]
    if evaluators:
        lines.append(f"evaluator: {net[evaluators[0]].ip}")
    lines += [f"{k}: {v}" for k, v in extra.items()]
    lines.append("hosts:")
    for i in sorted(roles):
        workdir = tmp_path / net[i].hostname
        workdir.mkdir()
        lines.append(f"  {net[i].ip}: {{python: '{sys.executable}', workdir: '{workdir}'}}")
    return write_cluster(tmp_path, "\n".join(lines) + "\n")


def write_scripts(tmp_path, cluster, data_dir, steps, wait_timeout, override=None, flags=(), model_dir=None):
    """`od-dist scripts` for `cluster`: a tiny run of `steps` steps, or `override` (--params_override).
    `model_dir`: default one folder that every machine shares; a relative one is each machine's own
    (under its workdir), as on a LAN of separate disks."""
    out = tmp_path / "scripts"
    model_dir = model_dir or tmp_path / "model"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "od_dist",
            "scripts",
            f"--cluster={cluster}",
            f"--pipeline={PIPELINE}",
            f"--model_dir={model_dir}",
            "--params_override=" + (override or TINY.format(steps=steps, data=data_dir)),
            f"--wait_timeout={wait_timeout}",
            f"--out={out}",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return out, model_dir


class Job:
    """Tasks started inside their machines ({name: (machine, argv)}); output to one log per task."""

    def __init__(self, tmp_path, commands, cwd=None):
        """`cwd`: one working directory for all, or {name: its own} (a machine's own disk)."""
        self.procs, self.logs = {}, {}
        for name, (machine, argv) in commands.items():
            self.logs[name] = tmp_path / f"{name.replace(':', '-')}.log"
            here = cwd.get(name) if isinstance(cwd, dict) else cwd
            with open(self.logs[name], "w") as log:
                self.procs[name] = machine.popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=here)

    @classmethod
    def from_scripts(cls, tmp_path, net, roles, scripts):
        """Each machine runs the .sh that `od-dist scripts` wrote for its task."""
        commands, counters = {}, {}
        for i, role in sorted(
            roles.items(), key=lambda kv: kv[1] == "master"
        ):  # servers first: any order works
            index = counters.get(role, 0)
            counters[role] = index + 1
            commands[f"{role}:{index}"] = (net[i], ["bash", str(scripts / f"{role}-{index}.sh")])
        return cls(tmp_path, commands)

    def output(self, name):
        return self.logs[name].read_text(errors="replace")

    def all_output(self):
        return "\n".join(f"----- {n}\n{self.output(n)[-3000:]}" for n in self.procs)

    def wait(self, names, timeout):
        """Waits for the named tasks to end, at most `timeout` seconds; returns {name: rc or None}."""
        deadline = time.monotonic() + timeout
        for name in names:
            try:
                self.procs[name].wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {n: self.procs[n].poll() for n in names}

    def wait_for_line(self, name, pattern, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.output(name)):
                return True
            if self.procs[name].poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def kill(self):
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
