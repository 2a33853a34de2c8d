"""`od-dist doctor` on loopback (any user; the simulated machines in test_multihost.py cover
peers on other machines, names and firewalls)."""

import os
import socket
import subprocess
import sys
import time

import pytest
from loopback import ROOT, free_ports, od_dist

from od_dist.cluster import spec as cluster_mod
from od_dist.host import doctor, doctor_here
from od_dist.protocol import lineage


def loopback_cluster(tmp_path, ports, extra=""):
    path = tmp_path / "c.yaml"
    path.write_text(
        f"master: 127.0.0.1:{ports[0]}\nworker: [127.0.0.1:{ports[1]}]\nps: [127.0.0.1:{ports[2]}]\n" + extra
    )
    return str(path)


def test_loopback_cluster_all_ok_fast_and_without_tensorflow(tmp_path):
    ports = free_ports(3)
    cluster = loopback_cluster(tmp_path, ports)
    start = time.monotonic()
    r = od_dist("doctor", f"--cluster={cluster}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert time.monotonic() - start < 20
    lines = [line.strip() for line in r.stdout.splitlines()]
    assert lines[0] == f"od-dist doctor: {cluster}: valid, strategy parameter_server, 3 tasks, num_clones 1"
    assert (
        "ok    this machine: a loopback-only cluster: every task runs here (od-dist launch starts them all)"
        in lines
    )
    for port, name in zip(ports, ("master:0", "worker:0", "ps:0")):
        assert f"ok    port {port} here: free for {name}" in lines
    # This box has no public address (a CI container); the server listens on all of its interfaces.
    shown = ", ".join(map(str, sorted(ports)))
    assert f"ok    listening: port(s) {shown} will listen on every interface of this machine" in "\n".join(
        lines
    )
    assert lines[-1].startswith("od-dist doctor: nothing to fix")
    code = (
        "import sys; from od_dist import cli; rc = cli.main(['od-dist', 'doctor', '--cluster', sys.argv[1]]); "
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'official', 'keras', 'tf_keras')]; "
        "print('HEAVY', heavy); sys.exit(rc or bool(heavy))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, cluster], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert r.returncode == 0 and "HEAVY []" in r.stdout, r.stdout + r.stderr


def test_a_port_in_use_here_is_a_fix(tmp_path):
    ports = free_ports(3)
    cluster = loopback_cluster(tmp_path, ports)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1]))
        taken.listen()
        r = od_dist("doctor", f"--cluster={cluster}")
    assert r.returncode == 1, r.stdout + r.stderr
    assert any(
        line.strip().startswith(f"FIX   port {ports[1]} here: in use")
        and "worker:0 cannot start: stop that program, or give worker[0] another port" in line
        for line in r.stdout.splitlines()
    ), r.stdout
    assert r.stdout.splitlines()[-1] == "od-dist doctor: 1 to fix (the FIX lines above)"


def test_listening_on_every_interface_is_said_and_a_public_one_warned():
    """TensorFlow's server listens on every interface whatever address the file gives it: doctor
    says so for this machine's ports, and warns when one of its interfaces is public."""
    from od_dist.cluster import hostinfo

    c = cluster_mod.from_document(
        {
            "master": "10.0.0.1:2222",
            "worker": ["10.0.0.1:2223"],
            "ps": ["10.0.0.2:2224"],
            "evaluator": "10.0.0.1",
        }
    )
    mine = c.tasks_on(lambda host: host == "10.0.0.1")
    private = hostinfo.ThisMachine(frozenset({"box"}), frozenset({"127.0.0.1", "10.0.0.1", "fe80::1"}))
    (check,) = doctor.check_listening(mine, private)
    assert check.status == doctor.OK and "port(s) 2222, 2223 will listen on every interface" in check.detail
    public = hostinfo.ThisMachine(
        frozenset({"box"}), frozenset({"127.0.0.1", "10.0.0.1", "203.0.113.9", "8.8.8.8"})
    )
    (check,) = doctor.check_listening(mine, public)
    assert (
        check.status == doctor.WARN and "public address(es) 8.8.8.8 included" in check.detail
    )  # 203.0.113/24: TEST-NET
    assert "firewall" in check.detail
    evaluator_only = [t for t in mine if t.role == "evaluator"]
    assert doctor.check_listening(evaluator_only, public) == []  # it runs no server


def test_a_name_the_public_address_rule_could_not_check_is_a_warning(tmp_path):
    from od_dist.cluster import hostinfo

    (port,) = free_ports(1)
    path = tmp_path / "c.yaml"  # .invalid never resolves (RFC 6761)
    path.write_text(f"master: 10.0.0.1:{port}\nworker: [no-such-host.invalid:{port}]\n")
    here = hostinfo.ThisMachine(frozenset({"box"}), frozenset({"127.0.0.1", "10.0.0.1"}))
    checks, _ = doctor.run(str(path), None, None, False, connect_timeout=0.5, machine=here)
    (check,) = [c for c in checks if c.what == "public-address rule"]
    assert check.status == doctor.WARN and check.detail.startswith("no-such-host.invalid: does not resolve")


def test_invalid_input_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("master: 127.0.0.1:1\nworkers: [127.0.0.1:2]\n")
    r = od_dist("doctor", f"--cluster={bad}")
    assert r.returncode == 2 and "workers: 'workers': unknown key; did you mean 'worker'?" in r.stderr
    r = od_dist("doctor")
    assert r.returncode == 2 and "--cluster: '': required" in r.stderr
    cluster = loopback_cluster(tmp_path, free_ports(3))
    r = od_dist("doctor", f"--cluster={cluster}", "--role=worker", "--index=3")
    assert r.returncode == 2 and "--index: '3': worker has indexes 0 to 0" in r.stderr


def test_probe_tells_listening_from_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        # A connect shows that something accepts, not that it is the task (a proxy accepts too).
        assert doctor.probe("127.0.0.1", server.getsockname()[1], 2) == (
            doctor.OK,
            "accepts connections (its task's server, or whatever else holds the port)",
        )
    port = free_ports(1)[0]
    status, detail = doctor.probe("127.0.0.1", port, 2)
    assert status == doctor.WARN and detail.startswith("connection refused")


def test_gpus_against_num_clones():
    ps = cluster_mod.from_document(
        {
            "master": "10.0.0.1:1",
            "worker": ["10.0.0.2:1"],
            "ps": ["10.0.0.3:1"],
            "hosts": {"10.0.0.2": {"num_clones": 2}},
        }
    )
    mw = cluster_mod.from_document({"master": "10.0.0.1:1", "worker": ["10.0.0.2:1"], "num_clones": 2})

    def status(cluster, role, counted, tf_counted=None):
        tf_counted = tf_counted or (counted[0], "TensorFlow 2.20.0, tf.config.list_physical_devices")
        return doctor.check_gpus(cluster, [cluster.task(role)], counted, tf_counted)[0]

    assert status(ps, "worker", (1, "nvidia-smi -L")).status == doctor.FIX
    assert (
        "num_clones 2 for worker:0 needs 2 GPUs, found 1: 1 from the driver (nvidia-smi -L), 1 in "
        "TensorFlow (TensorFlow 2.20.0, tf.config.list_physical_devices); lower num_clones"
    ) in status(ps, "worker", (1, "nvidia-smi -L")).detail
    assert status(ps, "worker", (2, "nvidia-smi -L")).status == doctor.OK
    # What TensorFlow sees counts: the driver shows 2, TensorFlow 1.
    assert "needs 2 GPUs, found 1:" in status(ps, "worker", (2, "nvidia-smi -L"), (1, "tf")).detail
    # The driver shows GPUs and TensorFlow none: installed without CUDA's libraries, the install named.
    fix = status(ps, "worker", (2, "nvidia-smi -L"), (0, "tf"))
    assert fix.status == doctor.FIX and fix.detail == (
        "2 from the driver (nvidia-smi -L), 0 in TensorFlow (tf): TensorFlow was installed without CUDA's "
        'libraries and worker:0 would train on the CPU; on Linux and WSL2 install od-dist with pip install -e ".[gpu]" '
        "(README: GPU machines)"
    )
    # TensorFlow could not be asked: a warning beside the driver's count.
    checks = doctor.check_gpus(ps, [ps.task("worker")], (2, "nvidia-smi -L"), (None, "did not answer"))
    assert [c.status for c in checks] == [doctor.WARN, doctor.OK], checks
    # Under parameter_server the ps and the master (coordinator) hold no replicas.
    assert (
        "none needed" in status(ps, "master", (0, "x")).detail
        and status(ps, "ps", (0, "x")).status == doctor.OK
    )
    # Under multi_worker_mirrored the master trains too.
    assert status(mw, "master", (0, "no NVIDIA driver")).status == doctor.FIX
    one = cluster_mod.from_document({"master": "10.0.0.1:1", "worker": ["10.0.0.2:1"]})
    assert "will train on the CPU" in status(one, "worker", (0, "no NVIDIA driver")).detail


def test_count_gpus_says_how():
    gpus, how = doctor_here.count_gpus()
    assert gpus >= 0 and how


def test_peers_to_reach_follow_the_traffic():
    c = cluster_mod.from_document(
        {
            "master": "10.0.0.1:1",
            "worker": ["10.0.0.2:1", "10.0.0.3:1"],
            "ps": ["10.0.0.4:1"],
            "evaluator": "10.0.0.5",
        }
    )
    names = lambda role, i=0: sorted(t.name for t in doctor.peers_to_reach(c, (c.task(role, i),)))  # noqa: E731
    assert names("master") == ["ps:0", "worker:0", "worker:1"]
    assert names("worker", 1) == ["master:0", "ps:0"]  # never the other worker
    assert names("ps") == ["master:0"]
    assert names("evaluator") == ["master:0"]
    assert len(doctor.peers_to_reach(c, ())) == 4  # a machine in no entry: every server


def test_entry_of_a_machine_with_several_tasks_or_none():
    from od_dist.cluster.hostinfo import ThisMachine

    c = cluster_mod.from_document(
        {"master": "10.0.0.1:1", "worker": ["10.0.0.1:2", "10.0.0.2:1"], "ps": ["10.0.0.3:1"]}
    )
    here = ThisMachine(frozenset({"box"}), frozenset({"10.0.0.1"}))
    checks, mine = doctor.check_entry(c, None, None, here)
    assert [str(x) for x in checks] == [
        "ok    this machine: runs worker:0, master:0: `od-dist train` without --role starts them all "
        "(or each with --role/--index)"
    ]
    assert [t.name for t in mine] == ["worker:0", "master:0"]
    checks, mine = doctor.check_entry(c, "worker", 0, here)
    assert checks[0].status == doctor.OK and [t.name for t in mine] == ["worker:0"]
    elsewhere = ThisMachine(frozenset({"box"}), frozenset({"10.0.0.9"}))
    checks, mine = doctor.check_entry(c, None, None, elsewhere)
    assert checks[0].status == doctor.FIX and not mine


# ----- WSL2: a faked kernel string and interface list -----------------------------------------------

WSL_KERNEL = "5.15.167.4-microsoft-standard-WSL2"
WSL_LAN = "master: 192.0.2.10:2222\nworker: [192.0.2.11:2222]\nps: [192.0.2.11:2223]\n"  # TEST-NET-1


def wsl_doctor(tmp_path, ips, kernel=WSL_KERNEL, role=None, index=None, text=WSL_LAN):
    from od_dist.cluster import hostinfo

    path = tmp_path / "c.yaml"
    path.write_text(text)
    here = hostinfo.ThisMachine(frozenset({"box", "localhost"}), frozenset({"127.0.0.1", *ips}))
    checks, _ = doctor.run(str(path), role, index, False, connect_timeout=0.2, machine=here, kernel=kernel)
    return [c for c in checks if c.what == "WSL2"]


def test_kernel_string_is_read_from_the_kernels_files(tmp_path):
    release, version = tmp_path / "osrelease", tmp_path / "version"
    release.write_text(WSL_KERNEL + "\n")
    version.write_text("Linux version " + WSL_KERNEL + " (root@build) #1 SMP\n")
    assert doctor.kernel_string((str(release), str(version))).startswith(WSL_KERNEL + " Linux version")
    assert doctor.kernel_string((str(tmp_path / "missing"), str(version))).startswith("Linux version 5.15")
    assert doctor.kernel_string((str(tmp_path / "missing"),)) == ""
    assert doctor.kernel_string()  # this machine's own, from /proc


def test_wsl_with_nat_networking_is_a_fix_with_the_wslconfig_lines(tmp_path):
    """Inside WSL2 under NAT the interface holds a 172.x address, not the machine's LAN address."""
    (check,) = wsl_doctor(tmp_path, {"172.28.113.5"})
    assert str(check) == (
        f"FIX   WSL2: this is WSL ({WSL_KERNEL}) with NAT networking: no address of the cluster file is on "
        "its interfaces (172.28.113.5), and other machines cannot reach a port opened here; on Windows 11 "
        "22H2 or later put the lines `[wsl2]` and `networkingMode=mirrored` in %UserProfile%\\.wslconfig on "
        "Windows, run `wsl --shutdown`, start WSL again and allow the ports with New-NetFirewallHyperVRule "
        "(before 22H2: netsh interface portproxy; README: Windows machines, GPU: WSL2)"
    )
    # With --role: that entry's address is named.
    (check,) = wsl_doctor(tmp_path, {"172.28.113.5"}, role="worker", index=0)
    assert check.status == doctor.FIX
    assert "NAT networking: worker:0's address 192.0.2.11 is on none of its interfaces (172.28.113.5)" in (
        check.detail
    )


def test_wsl_with_mirrored_networking_or_no_wsl_is_not_a_fix(tmp_path):
    (check,) = wsl_doctor(tmp_path, {"192.0.2.10", "fe80::1"})  # mirrored: the LAN address is here
    assert check.status == doctor.OK and "New-NetFirewallHyperVRule" in check.detail
    assert wsl_doctor(tmp_path, {"172.28.113.5"}, kernel="6.1.0-18-amd64 Linux version 6.1.0") == []
    local = "master: 127.0.0.1:2222\nworker: [127.0.0.1:2223]\n"  # every task here: nothing to reach
    assert wsl_doctor(tmp_path, {"172.28.113.5"}, text=local) == []


# ----- GPUs TensorFlow sees, beside the driver's ------------------------------------------------------

MWM = "strategy: multi_worker_mirrored\nmaster: 127.0.0.1:{0}\nworker: [127.0.0.1:{1}]\n"


def doctor_with_path(tmp_path, cluster, bin_dir):
    """doctor with PATH holding only `bin_dir` and the system's folders (no real nvidia-smi)."""
    from loopback import clean_env

    env = clean_env(PATH=os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"]))
    return subprocess.run(
        [sys.executable, "-m", "od_dist", "doctor", f"--cluster={cluster}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=240,
    )


def test_doctor_without_a_gpu_does_not_import_tensorflow_to_say_so(tmp_path):
    if os.path.isdir("/proc/driver/nvidia/gpus"):
        pytest.skip("this machine has an NVIDIA driver")
    path = tmp_path / "c.yaml"
    path.write_text(MWM.format(*free_ports(2)))
    (tmp_path / "bin").mkdir()
    r = doctor_with_path(tmp_path, path, tmp_path / "bin")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (
        "  ok    GPUs: 0 from the driver (no NVIDIA driver found: no nvidia-smi, no /proc/driver/nvidia), "
        "0 in TensorFlow (TensorFlow not asked); worker:0, master:0 will train on the CPU (num_clones 1)"
    ) in r.stdout.splitlines(), r.stdout


def test_doctor_says_fix_when_the_driver_shows_gpus_and_tensorflow_none(tmp_path):
    """An nvidia-smi stand-in reports two GPUs; this machine's TensorFlow (asked in a child process)
    sees none, as a GPU machine's does when installed without CUDA's libraries."""
    path = tmp_path / "c.yaml"
    path.write_text(MWM.format(*free_ports(2)))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'GPU 0: NVIDIA Stand-in (UUID: GPU-0)'\necho 'GPU 1: NVIDIA Stand-in (UUID: GPU-1)'\n"
    )
    smi.chmod(0o755)
    r = doctor_with_path(tmp_path, path, bin_dir)
    assert r.returncode == 1, r.stdout + r.stderr
    version = doctor_here._version("tensorflow")
    assert (
        f"  FIX   GPUs: 2 from the driver (nvidia-smi -L), 0 in TensorFlow (TensorFlow {version}, "
        "tf.config.list_physical_devices): TensorFlow was installed without CUDA's libraries and "
        'worker:0, master:0 would train on the CPU; on Linux and WSL2 install od-dist with pip install -e ".[gpu]" '
        "(README: GPU machines)"
    ) in r.stdout.splitlines(), r.stdout
    assert r.stdout.splitlines()[-1] == "od-dist doctor: 1 to fix (the FIX lines above)"


# ----- model_dir: shared or not, and where the newest checkpoint is -------------------------------


def write_checkpoint(folder, step):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"ckpt-{step}.data-00000-of-00001").write_bytes(b"x" * 10)
    (folder / f"ckpt-{step}.index").write_bytes(b"i" + bytes(48) + lineage.TABLE_MAGIC)  # a table's footer
    (folder / "checkpoint").write_text(f'model_checkpoint_path: "ckpt-{step}"\n')


def test_doctor_says_model_dir_need_not_be_shared_and_where_the_newest_checkpoint_is(tmp_path):
    from od_dist.protocol import checkpoint_feed

    ports = free_ports(3)
    path = tmp_path / "c.yaml"
    path.write_text(MWM.format(*ports) + f"checkpoint_port: {ports[2]}\n")
    here = tmp_path / "here"
    write_checkpoint(here, 4)

    def lines(role):
        checks, _ = doctor.run(str(path), role, 0, False, 1.0, model_dir=str(here))
        return {c.what: f"{c.status} {c.detail}" for c in checks}

    found = lines("worker")
    assert found["model_dir shared?"].startswith(
        "ok --model_dir need not be a shared folder: Every trainer keeps the checkpoints in its own --model_dir"
    ), found
    assert found["newest checkpoint"].startswith(
        f"ok here: step 4; master:0's checkpoint feed at 127.0.0.1:{ports[2]} does not answer"
    ), found
    assert lines("master")["newest checkpoint"] == "ok here: step 4"  # the lead is this machine
    lead = tmp_path / "lead"
    write_checkpoint(lead, 9)
    job = cluster_mod.from_document(
        {
            "strategy": "multi_worker_mirrored",
            "master": f"127.0.0.1:{ports[0]}",
            "worker": [f"127.0.0.1:{ports[1]}"],
        }
    ).job_id()
    with checkpoint_feed.Feed(str(lead), "127.0.0.1", ports[2], job):
        assert lines("worker")["newest checkpoint"] == (
            f"ok step 9 on master:0's machine (127.0.0.1, its checkpoint feed at 127.0.0.1:{ports[2]}); here: step 4"
        )


@pytest.mark.parametrize("platform, quoted", [("win32", '"{}"'), ("linux", "'{}'")])
def test_version_fix_lines_are_quoted_for_the_machines_shell(monkeypatch, platform, quoted):
    """cmd.exe passes single quotes on to pip (`'numpy<2.4'` is no requirement there, and `<` a
    redirection outside quotes): on Windows the fix lines use double quotes, which PowerShell takes
    too."""
    found = {"tensorflow": "2.19.0", "numpy": "2.4.0", "tf-models-official": "2.20.0"}
    monkeypatch.setattr(
        doctor_here, "_version", lambda *names: next((found[n] for n in names if n in found), None)
    )
    monkeypatch.setattr(sys, "platform", platform)
    lines = {c.what: c.detail for c in doctor.check_versions()}
    assert lines["TensorFlow"].endswith(
        f"pip install {quoted.format('tensorflow~=2.20.0')} (or reinstall od-dist)"
    )
    assert lines["numpy"].endswith(f"pip install {quoted.format('numpy<2.4')}")
    if platform == "win32":
        assert "install '" not in lines["TensorFlow"] + lines["numpy"]
