"""`od-dist scripts --at_boot`: whom each machine's start-at-boot units run as. Its hosts `user`,
else --at_boot_user, else refused before anything is written; the system account (root, SYSTEM)
only when named. The files are rendered through the CLI and read back: the systemd unit's User=,
the README's schtasks line (split as cmd and schtasks split it), the task XML's principal."""

import os
import xml.etree.ElementTree as ET

import mslex
import pytest
import yaml
from loopback import od_dist, run_cli
from test_hostile import HOSTILE, one_line_refusal
from test_scripts import cmd_batch_line

from od_dist.cluster import messages
from od_dist.render import boot, quote

WINDOWS, LINUX, BOTH = "10.0.0.1", "10.0.0.2", "10.0.0.3"
TASK_NS = {"t": "http://schemas.microsoft.com/windows/2004/02/mit/task"}


def cluster_file(tmp_path, users, share=False):
    """master on a Windows machine, worker on a Linux one, ps on one of undeclared os; `users`: the
    hosts `user` of each machine that has one."""
    hosts = {
        WINDOWS: {"os": "windows", "workdir": "\\\\fs\\od" if share else "C:\\od"},
        LINUX: {"os": "linux", "workdir": "/srv/od"},
        BOTH: {"workdir": "//fs/od"},
    }
    for host, user in users.items():
        hosts[host]["user"] = user
    doc = {"master": f"{WINDOWS}:2222", "worker": [f"{LINUX}:2222"], "ps": [f"{BOTH}:2222"], "hosts": hosts}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return os.path.relpath(path)  # relative: the master runs Windows


def scripts(capsys, tmp_path, users, *flags, share=False):
    out = tmp_path / "out"
    code, _, err = run_cli(
        capsys,
        "scripts",
        f"--cluster={cluster_file(tmp_path, users, share)}",
        "--pipeline=p.yaml",
        "--model_dir=m",
        f"--out={out}",
        "--at_boot",
        *flags,
    )
    return code, err, out


def unit_users(out):
    """Each systemd unit's User= lines, by unit file."""
    return {
        f: [x[len("User=") :] for x in (out / f).read_text().splitlines() if x.startswith("User=")]
        for f in sorted(os.listdir(out))
        if f.endswith(".service")
    }


def schtasks_create(out, task):
    """The README's `schtasks /Create` line of `task` as schtasks receives it, from /RU on."""
    (line,) = [
        x
        for x in (out / "README.md").read_text().splitlines()
        if x.startswith(f"schtasks /Create /TN {task} ")
    ]
    argv = mslex.split(cmd_batch_line(line), like_cmd=False)  # as cmd, then schtasks, reads it
    return argv[argv.index("/RU") : -1]  # without the final /F


def principal(out, task):
    task = ET.fromstring((out / f"{task}.xml").read_bytes())
    return [(e.tag.split("}")[1], e.text) for e in task.find("t:Principals/t:Principal", TASK_NS)]


def test_at_boot_without_a_user_is_refused_naming_every_machine_and_the_fix(tmp_path, capsys):
    code, err, out = scripts(capsys, tmp_path, {LINUX: "od"})
    assert code == 2 and not out.exists(), err  # nothing written
    assert (
        f"--at_boot: {BOTH} (ps 0), {WINDOWS} (master 0) have no user for their units to run as; add "
        "'user: <account>' under each one's entry of the cluster file's hosts: (hosts.<host>.user), or "
        "pass --at_boot_user=<account> for every machine; root or SYSTEM for the system account"
    ) in err
    code, err, out = scripts(capsys, tmp_path, {LINUX: "od", BOTH: "od"})
    assert code == 2 and not out.exists(), err
    assert f"{WINDOWS} (master 0) has no user for its units to run as" in err
    assert f"under its entry of the cluster file's hosts: (hosts.{WINDOWS}.user)" in err
    # The real exit, as a person sees it: one line and status 2.
    r = od_dist(
        "scripts",
        f"--cluster={cluster_file(tmp_path, {})}",
        "--pipeline=p.yaml",
        "--model_dir=m",
        f"--out={tmp_path / 'cli'}",
        "--at_boot",
        cwd=os.getcwd(),
    )
    assert r.returncode == 2 and "have no user for their units to run as" in r.stderr, r.stderr
    assert not (tmp_path / "cli").exists()


def test_each_machine_runs_as_its_hosts_user(tmp_path, capsys):
    code, err, out = scripts(capsys, tmp_path, {WINDOWS: "LAB\\od dist", LINUX: "od", BOTH: "od"})
    assert code == 0, err
    assert unit_users(out) == {"od-dist-ps-0.service": ["od"], "od-dist-worker-0.service": ["od"]}
    # A named user: schtasks asks for the password, and the task logs on with it.
    assert schtasks_create(out, "od-dist-master-0") == ["/RU", "LAB\\od dist", "/RP", "*"]
    assert principal(out, "od-dist-master-0") == [("UserId", "LAB\\od dist"), ("LogonType", "Password")]
    assert schtasks_create(out, "od-dist-ps-0") == ["/RU", "od", "/RP", "*"]  # os not declared: both
    readme = (out / "README.md").read_text()
    assert (
        "`/srv/od/worker-0.sh` as `od`;" in readme and "`C:\\od\\master-0.cmd` as `LAB\\od dist`;" in readme
    )


def test_at_boot_user_names_the_user_of_machines_without_one(tmp_path, capsys):
    code, err, out = scripts(capsys, tmp_path, {LINUX: "od"}, "--at_boot_user=lab")
    assert code == 0, err
    assert unit_users(out) == {"od-dist-ps-0.service": ["lab"], "od-dist-worker-0.service": ["od"]}
    assert schtasks_create(out, "od-dist-master-0") == ["/RU", "lab", "/RP", "*"]
    assert principal(out, "od-dist-master-0") == [("UserId", "lab"), ("LogonType", "Password")]
    assert "--at_boot --at_boot_user=lab --out=" in (out / "README.md").read_text()  # how to regenerate
    # A flag's value no machine's system takes is refused, naming the machine.
    (tmp_path / "b").mkdir()
    code, err, out = scripts(capsys, tmp_path / "b", {BOTH: "od"}, "--at_boot_user=LAB\\od")
    assert code == 2 and not out.exists(), err
    assert (
        f"--at_boot_user: 'LAB\\od': not a Linux user name (for {LINUX} (worker 0)); give one such as od or "
        "1000; root or SYSTEM for the system account"
    ) in err


@pytest.mark.parametrize("name", ["SYSTEM", "system", "root", "NT AUTHORITY\\SYSTEM"])
def test_the_system_account_only_when_named(name, tmp_path, capsys):
    """Any of its names is the system account on both systems: SYSTEM on Windows (no password, its
    SID as the task's user), root on Linux (User=root, written)."""
    code, err, out = scripts(capsys, tmp_path, {BOTH: "od"}, f"--at_boot_user={name}")
    assert code == 0, err
    assert unit_users(out) == {"od-dist-ps-0.service": ["od"], "od-dist-worker-0.service": ["root"]}
    assert schtasks_create(out, "od-dist-master-0") == ["/RU", "SYSTEM"]
    assert principal(out, "od-dist-master-0") == [
        ("UserId", boot.SYSTEM_SID),
        ("RunLevel", "HighestAvailable"),
    ]
    readme = (out / "README.md").read_text()
    assert "`/srv/od/worker-0.sh` as `root`;" in readme and "`C:\\od\\master-0.cmd` as `SYSTEM`;" in readme


def test_system_is_refused_for_a_network_share(tmp_path, capsys):
    code, err, out = scripts(capsys, tmp_path, {WINDOWS: "SYSTEM", LINUX: "od", BOTH: "od"}, share=True)
    assert code == 2 and not out.exists(), err
    assert (
        f"hosts.{WINDOWS}.user: 'SYSTEM': {WINDOWS}'s task would run as SYSTEM, which cannot reach its "
        f"working directory \\\\fs\\od (a network share); name the user whose share it is in "
        f"hosts.{WINDOWS}.user, e.g. LAB\\od"
    ) in err
    # A machine of undeclared os gets a Windows task too: //fs/od is a share there.
    code, err, out = scripts(capsys, tmp_path, {WINDOWS: "od", LINUX: "od", BOTH: "root"})
    assert code == 2 and f"hosts.{BOTH}.user: 'root': {BOTH}'s task would run as SYSTEM" in err, err


@pytest.mark.parametrize(
    "host,user,fragment",
    [
        (LINUX, "LAB\\od", "not a Linux user name; give one such as od or 1000"),
        (LINUX, "-od", "not a Linux user name"),
        (LINUX, "od dist", "not a Linux user name"),
        (WINDOWS, "100%", "not a Windows user name; give one such as od, LAB\\od or od@lab.example"),
        (WINDOWS, "a:b", "not a Windows user name"),
        (WINDOWS, " od", "not a Windows user name"),
        (
            BOTH,
            "LAB\\od",
            "not a Linux user name, and the host's os is not declared: it gets Linux and Windows units; "
            "declare its os, or give one such as od or 1000",
        ),
        (LINUX, 1000, "not a user name"),
        (LINUX, "", "not a user name"),
        (LINUX, ["od"], "not a user name"),
    ],
)
def test_a_user_no_system_takes_is_refused_naming_its_key(host, user, fragment, tmp_path, capsys):
    """Refused with the cluster file's other checks, by every command that reads it."""
    users = {WINDOWS: "od", LINUX: "od", BOTH: "od", host: user}
    path = cluster_file(tmp_path, users)
    for command in (["validate"], ["scripts", "--pipeline=p", "--model_dir=m", f"--out={tmp_path / 'o'}"]):
        code, _, err = run_cli(capsys, *command, f"--cluster={path}")
        assert code == 2 and f"hosts.{host}.user: '" in err and fragment in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("host", [LINUX, WINDOWS])
def test_hostile_users_are_refused_in_one_line_or_arrive_intact(host, tmp_path, capsys):
    """Each hostile string as a machine's user: refused naming its key, nothing written, or the
    unit's User=, the schtasks line's /RU (as cmd and schtasks split it) and the task's UserId hold
    exactly it."""
    for n, text in enumerate(HOSTILE):
        folder = tmp_path / str(n)
        folder.mkdir()
        code, err, out = scripts(capsys, folder, {WINDOWS: "od", LINUX: "od", BOTH: "od", host: text})
        if code != 0:
            *_, line = one_line_refusal(code, err)  # under "invalid input (<file>):"
            assert line.startswith(f"  hosts.{host}.user: '") and not out.exists(), (text, err)
            continue
        assert not messages.unsafe_char(text), text
        if host == LINUX:
            assert unit_users(out)["od-dist-worker-0.service"] == [text]
        else:
            assert schtasks_create(out, "od-dist-master-0") == ["/RU", text, "/RP", "*"], text
            assert principal(out, "od-dist-master-0")[0] == ("UserId", text)
        assert quote.md(text) in (out / "README.md").read_text()
