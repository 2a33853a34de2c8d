"""The README's path for three machines, run as the README writes it.

The path is every block of README.md between `<!-- lan-path:start -->` and `<!-- lan-path:end -->`,
in order (Set up's clone and install, then the LAN section's lines). Each of three simulated
machines (tests/netns.py: a network namespace and a folder of its own, its "disk") runs those lines
in one bash, as a user types them, with only what a test must put in a user's place:

- `$URL` is this repository (a local clone, which is quick);
- the install line (`pip install -e .`, which the fresh-clone CI runs as Set up) is stood in for by
  a `.venv/bin/od-dist` that runs this test's interpreter on the clone's code;
- after the `cp` of the three-machine file, its example addresses become the machines' own (the
  user's "write your three addresses into it");
- the train line's `--params_override` gets a tiny run written before the README's own keys (which
  come last, so they win): 5 steps (one loop) of a small model on 64x64 inputs, 4 validation images.

The job must end as the README's **Success** item says: its lines (2000 read as the tiny run's
steps, `...` as anything) on the lead's and the evaluator's machines, and every machine's exit 0.
An edit of the README's block that breaks the path fails here.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import netns
import pytest
import yaml
from loopback import ROOT, SMALL

README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"<!-- lan-path:start -->\n```bash\n(.*?)```\n<!-- lan-path:end -->", re.S)
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -e ."
# OD_DIST_LAN_FULL=1: the README's run as it is, no tiny run (the time the README gives; not in CI).
FULL = bool(os.environ.get("OD_DIST_LAN_FULL"))
STEPS = 2000 if FULL else 5  # one loop, one checkpoint, one evaluation
TINY_RUN = (
    f"trainer.train_steps={STEPS},trainer.steps_per_loop=5,trainer.summary_interval=5,"
    f"trainer.checkpoint_interval=5,trainer.validation_steps=2,{SMALL}"
)
TIMEOUT_S = 3600 if FULL else 420
# The install's stand-in: the venv's od-dist, running this interpreter (its packages) on the clone's code.
STAND_IN = (
    "mkdir -p .venv/bin && "
    f"printf '#!/bin/sh\\nexec {sys.executable} -m od_dist \"$@\"\\n' > .venv/bin/od-dist && "
    "chmod +x .venv/bin/od-dist"
)


def readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def path_lines() -> list[str]:
    """The README's path: the lines of its marked blocks, in order, blank lines left out."""
    return [line for block in BLOCK.findall(readme()) for line in block.splitlines() if line.strip()]


def success_patterns() -> list[tuple[str, re.Pattern]]:
    """(the README's line, its pattern) for each line its **Success** item shows."""
    item = re.search(r"^- \*\*Success\*\*:(.*?)(?=^- \*\*)", readme(), re.S | re.M).group(1)
    shown = re.findall(r"`([^`]*od-dist[^`]*)`", item.replace("\n  ", " "))
    return [
        (line, re.compile(re.escape(line).replace("2000", str(STEPS)).replace(re.escape("..."), ".*")))
        for line in shown
    ]


def machine_script(lines: list[str], addresses: dict[str, str]) -> str:
    """What one machine runs: the path, with what a test puts in a user's place (module doc)."""
    out = ["set -e"]
    for line in lines:
        if line == INSTALL:
            out.append(STAND_IN)
            continue
        if " train " in line and not FULL:
            line = line.replace("--params_override ", f"--params_override {TINY_RUN},", 1)
        out.append(line)
        if line.startswith("cp clusters/"):
            target = line.split()[2]
            out += [f"sed -i 's/{re.escape(old)}/{new}/g' {target}" for old, new in addresses.items()]
    return "\n".join(out) + "\n"


def example_hosts() -> list[str]:
    """The three-machine file's machines, in the file's order (master, workers)."""
    (cp,) = [line for line in path_lines() if line.startswith("cp clusters/")]
    with open(os.path.join(ROOT, cp.split()[1]), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [a.rsplit(":", 1)[0] for a in [doc["master"], *doc["worker"]]]


def test_the_path_is_the_one_command_on_every_machine():
    """Without root: the block's shape the simulated run relies on, and the shipped file with the
    README's batch is valid (its batch splits over every group min_trainers allows)."""
    lines = path_lines()
    assert lines[0].startswith('git clone "$URL" od-dist && cd od-dist'), lines
    assert INSTALL in lines  # stood in for below; Set up's install, which fresh-clone CI runs
    train = [line for line in lines if " train " in line]
    assert len(train) == 1 and train[0] == lines[-1], lines
    assert "--role" not in train[0] and "--max_restarts 3" in train[0], train
    assert "--params_override " in train[0]
    assert len(example_hosts()) == 3
    assert [p for _, p in success_patterns()], "the README's Success item shows no line"
    words = shlex.split(train[0])
    given = dict(zip(words[2::2], words[3::2]))  # --flag value pairs after `.venv/bin/od-dist train`
    args = ["validate", "--cluster=" + os.path.join("clusters", "three-machines.yaml")]
    args += [f"{k}={given[k]}" for k in ("--pipeline", "--params_override")]
    r = subprocess.run(
        [sys.executable, "-m", "od_dist", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    assert (
        "global batch 12 over every group min_trainers allows: 2 replicas 6 each, 3 replicas 4 each"
        in r.stdout
    )


@pytest.mark.slow
def test_the_readme_lan_path_on_three_machines(tmp_path, machines):
    if (
        not shutil.which("git")
        or not os.path.isdir(os.path.join(ROOT, ".git"))
        and not os.path.isfile(os.path.join(ROOT, ".git"))
    ):
        pytest.skip("the path clones this repository: needs git and a git checkout")
    net = machines(3)
    addresses = dict(zip(example_hosts(), (m.ip for m in net)))
    script = machine_script(path_lines(), addresses)
    procs, logs = {}, {}
    start = time.monotonic()
    for m in net:
        home = tmp_path / m.hostname
        home.mkdir()
        (home / "path.sh").write_text(script)
        logs[m.hostname] = home / "console.log"
        env = dict(netns.machine_env(), URL=ROOT)
        with open(logs[m.hostname], "w") as log:
            procs[m.hostname] = m.popen(
                ["bash", str(home / "path.sh")], cwd=str(home), env=env, stdout=log, stderr=subprocess.STDOUT
            )
    try:
        codes = {}
        for name, proc in procs.items():
            try:
                codes[name] = proc.wait(timeout=max(1, TIMEOUT_S - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                codes[name] = None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    took = time.monotonic() - start
    out = {name: log.read_text(errors="replace") for name, log in logs.items()}
    everything = "\n".join(f"----- {n}\n{text[-4000:]}" for n, text in out.items())
    assert codes == dict.fromkeys(procs, 0), everything
    lead, evaluator = out[net[0].hostname], out[net[2].hostname]
    for line, pattern in success_patterns():
        where = evaluator if "eval |" in line else lead
        assert pattern.search(where), f"the README's success line {line!r} is not in:\n{everything}"
    assert (tmp_path / net[1].hostname / "od-dist" / "runs" / "lan" / "checkpoint").exists()  # its own disk
    print(f"the README's LAN path on three simulated machines: {took:.0f} s")
    for name, text in out.items():
        print(f"----- {name}, its last lines:\n" + "\n".join(text.splitlines()[-6:]))
