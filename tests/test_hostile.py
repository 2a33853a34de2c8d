"""Hostile input: every writer (launch scripts, their README, the Kubernetes manifests, records, predictions,
exports, reports) either carries a hostile value exactly or refuses it with one line and exit 2;
no command injects a line, reads a file from outside its input, overwrites a user's file or prints a
Python traceback. Fast: validation and writer tests, no training."""

import hashlib
import os
import re
import shutil
import subprocess
import sys

import jobset_schema
import mslex
import powershell
import pytest
import yaml
from loopback import ROOT, run_cli

from od_dist.cluster import hostport, messages
from od_dist.cluster import spec as cluster_mod
from od_dist.data import writing
from od_dist.render import quote, scripts

# Strings that end a line, start a command or a key, or change meaning in at least one target.
HOSTILE = [
    "x\ntouch PWNED\n#",
    "x\rtouch PWNED",
    "x\r\ntouch PWNED",
    "x\u2028kind: Secret",
    "x\u2029y",
    "x\u0085y",
    "x\x00y",
    "x\ty",
    "x\x1b[2Jy",
    "x\u202eexe.txt",
    "it's",
    'say "hi"',
    "$(touch PWNED)",
    "`touch PWNED`",
    "${IFS}",
    "%PATH%",
    "%~dp0",
    "^&|<>!",
    "a & del /q *",
    "!PATH!",
    "-rf",
    "--model_dir=/etc",
    "../../etc/cron.d",
    "..",
    "' ; touch PWNED ; '",
    "\u2018q\u2019",
    "a|b",
    "``a``",
    "# c",
    "key: value",
    "---",
    "{a: 1}",
    "&anchor *alias",
    "!!python/object:os.system",
    "日本語",
]
UNSAFE = [s for s in HOSTILE if messages.unsafe_char(s)]
SAFE = [s for s in HOSTILE if not messages.unsafe_char(s)]


def test_hostile_list_covers_both_kinds():
    assert len(UNSAFE) == 10 and len(SAFE) == len(HOSTILE) - 10


def one_line_refusal(code, err):
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 2, err
    assert "Traceback" not in err
    return lines


# ----- 1: addresses, and every value through every script writer ---------------------------------


@pytest.mark.parametrize("text", HOSTILE)
def test_zone_id_and_host_take_no_hostile_text(text, tmp_path, capsys):
    """A zone id or host name holding anything but a plain name is refused by validate, so it never
    reaches a script (the zone id used to carry a newline and a command into master-0.sh)."""
    embedded = f"h{text}.lan:2230"
    try:
        host, _ = hostport.parse_address(embedded)
        assert re.fullmatch(r"[a-z0-9.-]+", host), host  # e.g. h-rf.lan: a plain name
    except hostport.AddressError:
        pass
    for address in (f"[fe80::1%{text}]:2230", f"{text}:2230"):
        with pytest.raises(hostport.AddressError):
            hostport.parse_address(address)
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"master": address, "worker": ["[fe80::2%eth0]:2231"]}))
        code, _, err = run_cli(capsys, "validate", f"--cluster={path}")
        lines = one_line_refusal(code, err)
        assert len(lines) == 2 and lines[1].startswith("  master: '"), err


def test_plain_zone_ids_still_work():
    assert hostport.parse_address("[fe80::1%eth0]:2230") == ("fe80::1%eth0", 2230)
    assert hostport.parse_address("[fe80::1%12]:2230") == ("fe80::1%12", 2230)
    assert hostport.parse_address("[fe80::1%br-lan.10]:2230")[0] == "fe80::1%br-lan.10"
    with pytest.raises(hostport.AddressError, match="zone id"):
        hostport.parse_address("[fe80::1%-x]:2230")
    assert hostport.host_key("fe80::1%eth0") == "fe80::1"
    with pytest.raises(hostport.AddressError):
        hostport.host_key("fe80::1%$(id)")


def bash_words(word):
    r = subprocess.run(["bash", "-c", "printf '%s\\0' " + word], capture_output=True, timeout=10)
    assert r.returncode == 0, r.stderr
    return r.stdout.decode().split("\0")[:-1]


def cmd_line_args(line):
    """What a program gets from a line of a .cmd file (delayed expansion off), as `cmd_escape` writes
    it: phase 1 turns `%%` into `%`; no `%NAME%` may be left; phase 2 removes each `^` escape and
    must find no unescaped `& | < > ( )`; the C runtime then splits the rest (mslex)."""
    assert not re.search(r"(?<!%)%(?!%)", line.replace("%%", "")), line
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c == "^":
            out.append(line[i + 1])
            i += 2
            continue
        assert c not in "&|<>()", line
        out.append(c)
        i += 1
    return mslex.split("".join(out).replace("%%", "%"), like_cmd=False)


@pytest.mark.parametrize("char", powershell.SINGLE_QUOTES + powershell.DOUBLE_QUOTES + powershell.BACKTICK)
def test_powershell_literals_carry_every_quote_character_of_its_specification(char):
    """Read back by the specification's rules (tests/powershell.py), not by the list the code uses."""
    for text in (char, f"a{char}b", f"{char}{char}", f"x{char}; Start-Process calc; {char}"):
        assert powershell.literal(quote.ps(text)) == text


@pytest.mark.parametrize("text", HOSTILE)
def test_quoting_functions_carry_or_refuse(text):
    """One function per target: the value comes back exactly, or QuoteError (one line)."""
    if text in UNSAFE:
        for fn in (quote.sh, quote.cmd, quote.ps, quote.md, quote.cmd_in_quotes, quote.windows_arg):
            with pytest.raises(quote.QuoteError) as e:
                fn(text)
            assert "\n" not in str(e.value) and "control character" in str(e.value)
        with pytest.raises(quote.QuoteError):
            quote.yaml_dump({"args": [text]})
        if "\n" not in text:  # a comment's own lines are split at "\n"; nothing else ends one
            with pytest.raises(quote.QuoteError):
                quote.yaml_dump({"a": 1}, comment=f"for {text}")
        return
    assert bash_words(quote.sh(text)) == [text]
    assert bash_words(quote.sh(text) + " " + quote.sh(text)) == [text, text]
    assert cmd_line_args("prog " + quote.cmd(text)) == ["prog", text]
    assert powershell.literal(quote.ps(text)) == text
    assert yaml.safe_load(quote.yaml_dump({"args": [text], text: text})) == {"args": [text], text: text}
    code = quote.md(text)
    fence = re.match("`+", code).group()
    assert code.endswith(fence) and fence not in code[len(fence) : -len(fence)]


STAND_IN = """#!/usr/bin/env bash
printf '%s\\0' "$@" > "$OD_DIST_RECORD"
"""


def write_scripts(capsys, tmp_path, value, where):
    """`od-dist scripts` with `value` as the pipeline, model_dir, params_override, cluster file name
    or a hosts setting; returns (exit code, stderr, out folder, cluster path, flags)."""
    hosts = {"10.0.0.1": {"os": "linux"}, "10.0.0.2": {"os": "windows"}}
    if where in ("venv", "python", "workdir"):
        hosts["10.0.0.1"][where] = hosts["10.0.0.2"][where] = value
    folder = tmp_path / f"c{len(os.listdir(tmp_path))}"
    folder.mkdir()
    usable_name = "/" not in value and "\x00" not in value and value not in (".", "..")
    path = folder / (value if where == "cluster" and usable_name else "c.yaml")
    doc = {"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"], "ps": ["10.0.0.1:2223"], "hosts": hosts}
    path.write_text(yaml.safe_dump(doc))
    flags = {"pipeline": "p.yaml", "model_dir": "runs/m", "params_override": "a: 1"}
    if where in flags:
        flags[where] = value
    out = folder / "out"
    path = os.path.relpath(path)  # relative: 10.0.0.2 runs Windows, which cannot read an absolute Linux path
    code, _, err = run_cli(
        capsys, "scripts", f"--cluster={path}", *(f"--{k}={v}" for k, v in flags.items()), f"--out={out}"
    )
    return code, err, out, path, flags


def read_all(folder):
    return {f: (folder / f).read_text(encoding="utf-8-sig").splitlines() for f in os.listdir(folder)}


@pytest.mark.parametrize(
    "where", ["model_dir", "pipeline", "params_override", "cluster", "venv", "python", "workdir"]
)
def test_every_script_writer_carries_or_refuses_hostile_values(where, tmp_path, capsys):
    """Each hostile value as each input: refused with one line, or every script has exactly the
    lines of a plain run and the value reaches od-dist's argv intact (bash run for real; the cmd and
    PowerShell lines parsed by their shells' rules); the README gains no line either."""
    code, err, plain_out, _, _ = write_scripts(capsys, tmp_path, "plain", where)
    assert code == 0, err
    plain = read_all(plain_out)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "od-dist").write_text(STAND_IN)
    (bin_dir / "od-dist").chmod(0o755)
    for text in HOSTILE:
        if where == "cluster" and ("/" in text or "\x00" in text or text == ".."):
            continue  # no file can have this name
        code, err, out, cluster_path, flags = write_scripts(capsys, tmp_path, text, where)
        if code != 0:
            lines = one_line_refusal(code, err)
            assert all(x.startswith("  ") for x in lines[1:]) and len(lines) <= 3, (where, text, err)
            assert not out.exists()
            continue
        assert text in SAFE, (where, text)
        files = read_all(out)
        like = plain
        if where == "python" and re.search(r"[\\/:]", text):  # a path, not a name looked up on PATH
            like = read_all(write_scripts(capsys, tmp_path, "bin/python", where)[2])
        assert sorted(files) == sorted(like)
        for f, lines in files.items():
            assert len(lines) == len(like[f]), (where, text, f)
        for f in files:
            if f.endswith(".sh"):
                r = subprocess.run(["bash", "-n", str(out / f)], capture_output=True, timeout=10)
                assert r.returncode == 0, r.stderr
        flag_args = [f"--{k}={v}" for k, v in flags.items()] + ["--max_restarts=3"]
        master = ["train", f"--cluster={cluster_path}", *flag_args]  # with ps 0: no --role, both run
        worker = ["train", f"--cluster={cluster_path}", "--role=worker", "--index=0", *flag_args]
        if where == "python":
            worker = ["-m", "od_dist", *worker]
        (run,) = [x for x in files["worker-0.cmd"] if " train " in x and not x.startswith("rem")]
        program, args = re.fullmatch(r'("[^"]*"|\S+) (.*)', run).groups()  # a program is in real quotes
        assert "%" not in program.replace("%%", "")
        assert cmd_line_args(args) == worker
        (arguments,) = [x for x in files["worker-0.ps1"] if x.startswith("$arguments = ")]
        assert mslex.split(powershell.literal(arguments[len("$arguments = ") :]), like_cmd=False) == worker
        if where == "workdir":
            (cd,) = [x for x in files["ps-0_master-0.sh"] if x.startswith("cd -- ")]
            assert bash_words(cd[len("cd -- ") :]) == [text]
            continue
        if where in ("venv", "python"):
            if where == "venv":
                (line,) = [x for x in files["worker-0.ps1"] if x.startswith("$env:VIRTUAL_ENV = ")]
                assert powershell.literal(line[len("$env:VIRTUAL_ENV = ") :]) == text
            else:
                assert quote.ps(text) in "\n".join(files["worker-0.ps1"])
            continue
        record = tmp_path / "record"
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", OD_DIST_RECORD=str(record))
        r = subprocess.run(["bash", str(out / "ps-0_master-0.sh")], env=env, capture_output=True, timeout=30)
        assert r.returncode == 0, r.stderr
        assert record.read_bytes().decode().split("\0")[:-1] == master


# ----- 2: the Kubernetes manifests (JobSet, TFJob) -----------------------------------------------


def k8s(capsys, tmp_path, **given):
    flags = {"pipeline": "p.yaml", "model_dir": "runs/m", "image": "registry.example/od-dist:1"} | given
    cluster = tmp_path / flags.pop("cluster_name", "c.yaml")
    cluster.write_text("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nps: [10.0.0.3:2223]\n")
    return (*run_cli(capsys, "k8s", f"--cluster={cluster}", *(f"--{k}={v}" for k, v in flags.items())), flags)


def pods(doc):
    """Each role's pod spec, whatever the kind."""
    if doc["kind"] == "TFJob":
        return {t: s["template"]["spec"] for t, s in doc["spec"]["tfReplicaSpecs"].items()}
    return {r["name"]: r["template"]["spec"]["template"]["spec"] for r in doc["spec"]["replicatedJobs"]}


def pod_args(text):
    """Each role's `train` arguments as its container gets them, Kubernetes' `$(VAR)` filled in
    (pod 0), without a JobSet pod's --role/--index."""
    (doc,) = yaml.safe_load_all(text)
    out = {}
    for role, pod in pods(doc).items():
        (container,) = pod["containers"]
        env = jobset_schema.container_env(container, {"batch.kubernetes.io/job-completion-index": "0"})
        args = [jobset_schema.expand(a, env) for a in container["args"]]
        out[role] = [a for a in args if not a.startswith(("--role=", "--index="))]
    return out


@pytest.mark.parametrize("kind", ["jobset", "tfjob"])
@pytest.mark.parametrize(
    "flag", ["model_dir", "mount_path", "cluster_name", "image", "params_override", "pipeline"]
)
def test_manifest_carries_or_refuses_hostile_values(flag, kind, tmp_path, capsys):
    """Each hostile value as each input: one line and exit 2, or one YAML document whose pods get
    exactly the values given, model_dir on the volume, Kubernetes' own `$(VAR)` expansion in the
    pod included (a value naming TF_CONFIG arrives as written)."""
    for text in HOSTILE + ["$(TF_CONFIG)", "$(OD_DIST_INDEX)$", "$$(x)"]:
        value = text
        if flag == "mount_path":
            value = f"/mnt/{text}"
        if flag == "cluster_name":
            if "/" in text or "\x00" in text or text in ("..",):
                continue
            value = text + ".yaml"
        code, out, err, flags = k8s(capsys, tmp_path, **{flag: value}, kind=kind)
        if code:
            lines = one_line_refusal(code, err)
            assert len(lines) == 1, (flag, text, err)
            continue
        assert not messages.unsafe_char(text), (flag, text)
        (doc,) = yaml.safe_load_all(out)
        assert doc["kind"] == {"jobset": "JobSet", "tfjob": "TFJob"}[kind]
        mount = next(iter(pods(doc).values()))["containers"][0]["volumeMounts"][0]
        model_dir = f"--model_dir={os.path.normpath(os.path.join(mount['mountPath'], flags['model_dir']))}"
        assert model_dir.startswith("--model_dir=" + mount["mountPath"].rstrip("/") + "/")
        want = ["train", f"--pipeline={flags['pipeline']}", model_dir]
        if "params_override" in flags:
            want.append(f"--params_override={flags['params_override']}")
        for replica, args in pod_args(out).items():
            assert args[: len(want)] == want, (replica, args)
        for pod in pods(doc).values():
            assert pod["containers"][0]["image"] == flags["image"]


@pytest.mark.parametrize(
    "model_dir", ["../../../etc/cron.d", "..", "a/../../x", "/etc/cron.d", "./..//../etc", "x/../../../"]
)
def test_model_dir_stays_on_the_volume(model_dir, tmp_path, capsys):
    code, _, err, _ = k8s(capsys, tmp_path, model_dir=model_dir)
    assert one_line_refusal(code, err) and "not on the volume" in err


def test_mount_path_is_normalised_and_not_the_root(tmp_path, capsys):
    code, out, err, _ = k8s(capsys, tmp_path, mount_path="/mnt/x/../od", model_dir="a/../b")
    assert code == 0, err
    assert all("--model_dir=/mnt/od/b" in a for a in pod_args(out).values())
    code, _, err, _ = k8s(capsys, tmp_path, mount_path="/mnt/..")
    assert one_line_refusal(code, err) and "--mount_path" in err
    code, out, err, _ = k8s(capsys, tmp_path, model_dir="gs://bucket/run")
    assert code == 0 and all("--model_dir=gs://bucket/run" in a for a in pod_args(out).values())
    code, out, err, _ = k8s(capsys, tmp_path, model_dir="../x://y")
    assert one_line_refusal(code, err)


# ----- 3: scripts --out ------------------------------------------------------------------------


def scripts_into(capsys, cluster, out):
    return run_cli(capsys, "scripts", f"--cluster={cluster}", "--pipeline=p", "--model_dir=m", f"--out={out}")


def test_scripts_out_replaces_its_own_files_only(tmp_path, capsys):
    """What an earlier run wrote (its manifest says) is replaced: a README.md or script it wrote
    and someone then replaced with a symlink is replaced, not written through; the scripts of a
    bigger cluster written there before are gone; the user's own files stay."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep")
    big = tmp_path / "big.yaml"
    big.write_text(
        yaml.safe_dump({"master": "10.0.0.1:2222", "worker": [f"10.0.0.{i}:2222" for i in range(2, 9)]})
    )
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"]}))
    code, _, err = scripts_into(capsys, big, out)
    assert code == 0, err
    for name in ("README.md", "worker-0.sh"):
        (out / name).unlink()
        (out / name).symlink_to(victim)
    for cluster in (big, small):
        code, _, err = scripts_into(capsys, cluster, out)
        assert code == 0, err
    assert victim.read_text() == "mine"
    assert not (out / "README.md").is_symlink() and "small.yaml" in (out / "README.md").read_text()
    written = ["README.md"] + [f"{t}-0.{s}" for t in ("master", "worker") for s in ("sh", "cmd", "ps1")]
    assert sorted(os.listdir(out)) == sorted([*written, "notes.txt", scripts.MANIFEST])
    listed = writing.written_before(str(out))
    assert sorted(listed) == sorted(written)
    for name in written:  # each with the digest of what is there: `sha256sum -c` passes
        assert listed[name] == {hashlib.sha256((out / name).read_bytes()).hexdigest()}
    assert os.access(out / "master-0.sh", os.X_OK) and not os.access(out / "master-0.cmd", os.X_OK)
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))  # no staging folder left
    assert not any("partial" in name for name in os.listdir(out))  # no temporary file left
    code, _, err = scripts_into(capsys, small, victim)
    assert one_line_refusal(code, err) and "not a directory" in err


def test_scripts_out_never_deletes_or_replaces_a_changed_file(tmp_path, capsys):
    """A script of an earlier run that someone edited is the user's now: where this run writes the
    same name it is refused (nothing written); where this run writes none it is kept, said in one
    line. Unchanged ones of the earlier run go."""
    out = tmp_path / "out"
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump({"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222", "10.0.0.3:2222"]}))
    small = tmp_path / "small.yaml"
    small.write_text(yaml.safe_dump({"master": "10.0.0.1:2222", "worker": ["10.0.0.2:2222"]}))
    assert scripts_into(capsys, big, out)[0] == 0
    (out / "master-0.sh").write_text((out / "master-0.sh").read_text() + "# my change\n")
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    code, _, err = scripts_into(capsys, small, out)
    assert len(one_line_refusal(code, err)) == 1 and "master-0.sh" in err and "changed since" in err, err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    (out / "master-0.sh").write_bytes(before["master-0.sh"].replace(b"# my change\n", b""))
    (out / "worker-1.cmd").write_bytes(b"@echo my own\r\n")
    code, _, err = scripts_into(capsys, small, out)
    assert code == 0, err
    assert "kept worker-1.cmd in" in err and len(err.strip().splitlines()) == 1, err
    assert (out / "worker-1.cmd").read_bytes() == b"@echo my own\r\n"
    assert not (out / "worker-1.sh").exists() and not (out / "worker-1.ps1").exists()
    assert "worker-1.cmd" not in writing.written_before(str(out))  # the user's from now on
    assert scripts_into(capsys, small, out)[0] == 0 and (out / "worker-1.cmd").exists()


def writes_meanwhile(monkeypatch, out):
    """Another program (a trainer's checkpoint) writes into --out while od-dist replaces its output
    there: at od-dist's first rename in the folder."""
    done = []

    def around(real):
        def move(src, dst, *a, **k):
            if str(out) in (os.path.dirname(os.path.abspath(dst)), os.path.abspath(src)) and not done:
                done.append(True)
                (out / "ckpt-7.index").write_text("a checkpoint written meanwhile")
            return real(src, dst, *a, **k)

        return move

    monkeypatch.setattr(os, "rename", around(os.rename))
    monkeypatch.setattr(os, "replace", around(os.replace))


# In this process (`data voc` would pay TensorFlow's import in a process of its own each time):
# what is tested is the files --out holds after, not the console.
@pytest.mark.parametrize(
    "command,earlier",
    [
        ("scripts", "only od-dist's output"),
        ("scripts", "the user's files too"),
        ("data voc", "only od-dist's output"),
    ],
)
def test_out_keeps_what_is_written_into_it_meanwhile(command, earlier, tmp_path, capsys, monkeypatch):
    """A file another program writes into --out while od-dist replaces its output there stays:
    whether od-dist swaps a folder of its own output whole or renames each file in."""
    out = tmp_path / "out"
    monkeypatch.chdir(ROOT)
    if command == "scripts":  # relative: the file's master runs Windows
        args = ["scripts", "--cluster=clusters/lan-example.yaml", "--pipeline=p", "--model_dir=m"]
    else:
        images, ann, _ = voc_folder(tmp_path)
        args = ["data", "voc", f"--images={images}", f"--annotations={ann}", "--val_fraction=0"]
    code, _, err = run_cli(capsys, *args, f"--out={out}")
    assert code == 0, err
    if earlier != "only od-dist's output":
        (out / "notes.txt").write_text("mine")
    writes_meanwhile(monkeypatch, out)
    code, _, err = run_cli(capsys, *args, f"--out={out}")
    assert code == 0, err
    assert (out / "ckpt-7.index").read_text() == "a checkpoint written meanwhile"
    assert earlier == "only od-dist's output" or (out / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # nothing left beside it


@pytest.mark.parametrize("command", ["scripts", "data voc"])
def test_out_dot_writes_into_the_working_directory_and_keeps_the_rest(command, tmp_path, capsys, monkeypatch):
    """`--out .`: the working directory is never moved or copied; its other files stay."""
    work = tmp_path / "work"
    (work / "runs" / "a").mkdir(parents=True)
    (work / "runs" / "a" / "ckpt-5.index").write_text("a checkpoint")
    (work / "notes.txt").write_text("mine")
    if command == "scripts":  # relative: the file's master runs Windows
        (work / "clusters").mkdir()
        shutil.copy(os.path.join(ROOT, "clusters", "lan-example.yaml"), work / "clusters")
        args = ["scripts", "--cluster=clusters/lan-example.yaml", "--pipeline=p", "--model_dir=m"]
        wrote = "master-0.cmd"
    else:
        images, ann, _ = voc_folder(tmp_path)
        args = ["data", "voc", f"--images={images}", f"--annotations={ann}", "--val_fraction=0"]
        wrote = "label_map.pbtxt"
    monkeypatch.chdir(work)
    for _ in range(2):  # a new output, then one replacing it
        code, _, err = run_cli(capsys, *args, "--out=.")
        assert code == 0, err
        assert (work / wrote).is_file()
        assert (work / "runs" / "a" / "ckpt-5.index").read_text() == "a checkpoint"
        assert (work / "notes.txt").read_text() == "mine"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # nothing moved or staged beside it


def test_scripts_out_refuses_a_folder_with_files_it_did_not_write(tmp_path, capsys):
    """`--out scripts` in the repository: its README.md (the guide) and the generic node scripts
    are the user's, not od-dist's; neither a name od-dist writes nor a manifest makes them its own."""
    out = tmp_path / "scripts"
    out.mkdir()
    guide = out / "README.md"
    guide.write_bytes(open(os.path.join(ROOT, "scripts", "README.md"), "rb").read())
    before = guide.read_bytes()
    (out / "od-dist-node.sh").write_text("#!/bin/sh\n")
    # Relative: its master runs Windows, which cannot read an absolute Linux path.
    lan = os.path.relpath(os.path.join(ROOT, "clusters", "lan-example.yaml"))
    code, _, err = scripts_into(capsys, lan, out)
    assert len(one_line_refusal(code, err)) == 1 and "README.md" in err and "not written by od-dist" in err, (
        err
    )
    assert guide.read_bytes() == before and sorted(os.listdir(out)) == ["README.md", "od-dist-node.sh"]
    # A manifest that lists a file no run writes does not make it od-dist's either.
    (out / scripts.MANIFEST).write_text("README.md\nod-dist-node.sh\n")
    (out / "README.md").unlink()
    code, _, err = scripts_into(capsys, lan, out)
    assert code == 0, err
    assert (out / "od-dist-node.sh").read_text() == "#!/bin/sh\n"


def test_a_mount_point_in_out_is_left_as_it_is(tmp_path, capsys):
    """A mount point in --out, or --out itself one: the output is written into it file by file,
    never by moving or copying the folder; what is on the other file system stays."""
    out = tmp_path / "out"
    (out / "mnt").mkdir(parents=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out / "mnt")], capture_output=True
    )
    if r.returncode:
        pytest.skip(f"needs root to mount a tmpfs ({r.stderr.decode().strip()})")
    try:
        (out / "mnt" / "data.bin").write_text("on another file system")
        images, ann, _ = voc_folder(tmp_path)
        for where in (out, out / "mnt"):
            for _ in range(2):  # a new output, then one replacing it
                code, _, err = scripts_into(
                    capsys, os.path.relpath(os.path.join(ROOT, "clusters", "lan-example.yaml")), where
                )
                assert code == 0, err
                code, _, err = data_voc(capsys, images, ann, where)
                assert code == 0, err
            assert (where / "master-0.cmd").is_file() and (where / "label_map.pbtxt").is_file()
            assert (out / "mnt" / "data.bin").read_text() == "on another file system"
            assert os.path.ismount(out / "mnt")
    finally:  # wherever it is now: a replacing --out that moved it
        with open("/proc/mounts") as f:
            for point in [line.split()[1] for line in f if line.split()[1].startswith(str(tmp_path))]:
                subprocess.run(["umount", point], capture_output=True)


# ----- 4, 5: data voc / coco ---------------------------------------------------------------------


def xml_escape(text):
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def voc_folder(tmp_path, filename="a.jpg", box=("1", "1", "4", "4"), xml_name="a.xml"):
    from PIL import Image

    images, ann, outside = tmp_path / "images", tmp_path / "ann", tmp_path / "outside"
    for d in (images, ann, outside):
        d.mkdir(exist_ok=True)
    for path in (images / "a.jpg", outside / "secret.jpg"):
        Image.new("RGB", (8, 8)).save(path)
    xmin, ymin, xmax, ymax = box
    (ann / xml_name).write_text(
        f"<annotation><filename>{xml_escape(filename)}</filename><size><width>8</width><height>8</height>"
        f"</size><object><name>cat</name><bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin><xmax>{xmax}</xmax>"
        f"<ymax>{ymax}</ymax></bndbox></object></annotation>",
        encoding="utf-8",
    )
    return images, ann, outside


def data_voc(capsys, images, ann, out):
    return run_cli(capsys, "data", "voc", f"--images={images}", f"--annotations={ann}", f"--out={out}")


def test_voc_images_stay_under_images(tmp_path, capsys):
    """A <filename> with '..', an absolute path or a symlink to a file elsewhere is refused: the
    records would embed that file's bytes."""
    from od_dist.data import voc

    images, ann, outside = voc_folder(tmp_path)
    (images / "link.jpg").symlink_to(outside / "secret.jpg")
    (images / "sub").mkdir()
    for name in (
        "../outside/secret.jpg",
        str(outside / "secret.jpg"),
        "link.jpg",
        "sub/../../outside/secret.jpg",
    ):
        voc_folder(tmp_path, filename=name, xml_name="x.xml")
        with pytest.raises(voc.BadAnnotation, match="outside --images"):
            voc.parse(str(ann / "x.xml"), str(images))
        code, out, err = data_voc(capsys, images, ann, tmp_path / "records")
        assert code == 2 and "outside --images" in err and "Traceback" not in err
        assert not (tmp_path / "records").exists()
    assert voc.parse(str(ann / "a.xml"), str(images)).image_path == str(images / "a.jpg")


@pytest.mark.parametrize("text", HOSTILE)
def test_voc_hostile_file_names(text, tmp_path, capsys):
    """Each hostile <filename>: a bad annotation (one line), or an image inside --images."""
    from od_dist.data import voc

    images, ann, _ = voc_folder(tmp_path, filename=text, xml_name="x.xml")
    try:
        image = voc.parse(str(ann / "x.xml"), str(images))
    except voc.BadAnnotation as e:
        assert "\n" not in str(e).strip()
    else:
        assert os.path.realpath(image.image_path).startswith(str(images.resolve()) + os.sep)


def test_annotation_symlink_loop_is_not_followed(tmp_path):
    from od_dist.data import records

    _, ann, _ = voc_folder(tmp_path)
    (ann / "sub").mkdir()
    (ann / "sub" / "loop").symlink_to(ann / "sub")
    (ann / "up").symlink_to(ann)
    assert list(records.matching_files(str(ann), ".xml")) == [str(ann / "a.xml")]


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_voc_non_finite_numbers_are_refused(value, tmp_path, capsys):
    from od_dist.data import voc

    images, ann, _ = voc_folder(tmp_path, box=(value, "1", "4", "4"))
    with pytest.raises(voc.BadAnnotation, match="not a finite number"):
        voc.parse(str(ann / "a.xml"), str(images))
    code, _, err = data_voc(capsys, images, ann, tmp_path / "records")
    assert code == 2 and "not a finite number" in err and not (tmp_path / "records").exists()


def coco_doc(**changes):
    image = {"id": 1, "file_name": "a.jpg", "width": 8, "height": 8}
    ann = {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 4, 4], "iscrowd": 0}
    image.update(changes.pop("image", {}))
    ann.update(changes.pop("ann", {}))
    return {"images": [image], "annotations": [ann], "categories": [{"id": 1, "name": "cat"}], **changes}


def data_coco(capsys, tmp_path, doc, raw=None):
    images, _, _ = voc_folder(tmp_path)
    path = tmp_path / "coco.json"
    path.write_text(raw if raw is not None else __import__("json").dumps(doc))
    return run_cli(
        capsys, "data", "coco", f"--images={images}", f"--annotations={path}", f"--out={tmp_path / 'records'}"
    )


@pytest.mark.parametrize(
    "bad", [{"bbox": [1, 1, float("nan"), 4]}, {"bbox": [float("inf"), 1, 4, 4]}, {"area": float("nan")}]
)
def test_coco_non_finite_numbers_are_refused(bad, tmp_path, capsys):
    code, _, err = data_coco(capsys, tmp_path, coco_doc(ann=bad))
    assert code == 2 and "Traceback" not in err and not (tmp_path / "records").exists(), err


def test_data_check_flags_non_finite_boxes():
    """One record with a NaN box, as an older od-dist or another tool wrote it."""
    import tensorflow as tf

    from od_dist.data import check

    image = tf.io.encode_png(tf.zeros([8, 8, 3], tf.uint8)).numpy()

    def floats(v):
        return tf.train.Feature(float_list=tf.train.FloatList(value=v))

    feature = {
        "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
        "image/source_id": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"1"])),
        "image/object/bbox/ymin": floats([0.1]),
        "image/object/bbox/xmin": floats([float("nan")]),
        "image/object/bbox/ymax": floats([0.5]),
        "image/object/bbox/xmax": floats([0.5]),
        "image/object/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
    }
    data = tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()
    _, problems = check.check_record(data, 2, tf)
    assert any("not finite" in p for p in problems), problems


# ----- 6, 7, 8: predict, export, report outputs ------------------------------------------------------


def fake_model(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "saved_model.pb").write_bytes(b"")
    return model


def test_predict_out_that_is_or_holds_an_input_is_refused(tmp_path, capsys):
    """Checked before the model loads: the drawn PNGs would replace the user's photos."""
    from PIL import Image

    model = fake_model(tmp_path)
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.new("RGB", (8, 8)).save(photos / "a.png")
    before = (photos / "a.png").read_bytes()
    for images, out in [
        (photos, photos),
        (photos / "a.png", photos),
        (photos, tmp_path / "photos" / "."),
        (photos / "a.png", tmp_path),
    ]:
        code, _, err = run_cli(capsys, "predict", f"--model={model}", f"--images={images}", f"--out={out}")
        assert code == 2 and "is or holds the input" in err and "Traceback" not in err, err
    assert (photos / "a.png").read_bytes() == before


def test_predict_replaces_only_its_own_outputs(tmp_path, capsys):
    from PIL import Image

    from od_dist.model import predict

    model = fake_model(tmp_path)
    photos, out = tmp_path / "photos", tmp_path / "out"
    photos.mkdir()
    out.mkdir()
    Image.new("RGB", (8, 8)).save(photos / "a.jpg")
    (out / "a.png").write_bytes(b"the user's own picture")
    code, _, err = run_cli(capsys, "predict", f"--model={model}", f"--images={photos}", f"--out={out}")
    assert code == 2 and "not an earlier od-dist predict output" in err
    assert (out / "a.png").read_bytes() == b"the user's own picture"
    # An earlier run's own files may be replaced.
    (out / "detections.json").write_text(
        '[{"image": "x/a.jpg", "output": "elsewhere/a.png", "width": 8, "height": 8, "detections": []}]'
    )
    assert predict._check_out(str(out), [str(photos)], [str(photos / "a.jpg")]) == [str(out / "a.png")]
    (out / "detections.json").write_text("my notes")
    with pytest.raises(predict.PredictError, match="detections.json"):
        predict._check_out(str(out), [str(photos)], [str(photos / "b.jpg")])


DEMO = os.path.join(ROOT, "pipelines", "shapes_retinanet.yaml")


def tiny_checkpoint(model_dir):
    import tensorflow as tf

    tf.train.Checkpoint(v=tf.Variable(1.0)).save(os.path.join(model_dir, "ckpt"))


def test_export_replaces_only_what_export_wrote(tmp_path, monkeypatch):
    """An earlier export in --out is replaced; the user's own files there stay. Model Garden's
    exporter is stood in for (a real one needs a trained model); the rest is export's own code."""
    from official.vision.serving import export_saved_model_lib

    from od_dist.model import export
    from od_dist.model.pipeline import load_pipeline

    def fake_export(export_dir, **_):
        os.makedirs(os.path.join(export_dir, "variables"))
        for name in ("saved_model.pb", "fingerprint.pb", "variables/variables.index"):
            with open(os.path.join(export_dir, name), "w") as f:
                f.write("new")

    monkeypatch.setattr(export_saved_model_lib, "export_inference_graph", fake_export)
    tiny_checkpoint(str(tmp_path / "run"))
    out = tmp_path / "exported"
    (out / "variables").mkdir(parents=True)
    (out / "variables" / "variables.data-00000-of-00001").write_text("old")
    (out / "saved_model.pb").write_text("old")
    (out / "label_map.pbtxt").write_text("old")
    (out / "README.txt").write_text("the user's notes")
    (out / "samples").mkdir()
    params = load_pipeline(DEMO, "task.train_data.input_path=/nonexistent/x-*.tfrecord")
    export.export(params, str(tmp_path / "run"), str(out))
    assert sorted(os.listdir(out)) == [
        "README.txt",
        "assets.extra",  # the score the model was exported with, for predict
        "fingerprint.pb",
        "samples",
        "saved_model.pb",
        "variables",
    ]
    assert os.listdir(out / "variables") == ["variables.index"]
    assert (out / "README.txt").read_text() == "the user's notes"
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_export_keeps_what_is_written_into_its_out_meanwhile(tmp_path, monkeypatch):
    """An earlier export alone in --out is swapped whole; a file another program writes into the
    folder as it is moved aside is moved back, never deleted with the old export."""
    from official.vision.serving import export_saved_model_lib

    from od_dist.model import export
    from od_dist.model.pipeline import load_pipeline

    def fake_export(export_dir, **_):
        with open(os.path.join(export_dir, "saved_model.pb"), "w") as f:
            f.write("new")

    monkeypatch.setattr(export_saved_model_lib, "export_inference_graph", fake_export)
    tiny_checkpoint(str(tmp_path / "run"))
    out = tmp_path / "exported"
    out.mkdir()
    (out / "saved_model.pb").write_text("old")
    real_rename = os.rename

    def rename(src, dst):
        if src == str(out) and not (out / "notes.txt").exists():
            (out / "notes.txt").write_text("written meanwhile")
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    params = load_pipeline(DEMO, "task.train_data.input_path=/nonexistent/x-*.tfrecord")
    export.export(params, str(tmp_path / "run"), str(out))
    assert (out / "notes.txt").read_text() == "written meanwhile"
    assert (out / "saved_model.pb").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["exported", "run"]


def test_report_out_folder_is_refused_and_leaves_nothing(tmp_path, capsys):
    import tensorflow as tf

    run = tmp_path / "run"
    with tf.summary.create_file_writer(str(run / "train")).as_default():
        for step in (1, 2):
            tf.summary.scalar("total_loss", 1.0 / step, step=step)
    photos = tmp_path / "photos"
    photos.mkdir()
    code, _, err = run_cli(capsys, "report", f"--model_dir={run}", f"--out={photos}")
    assert code == 2 and "is a folder" in err and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["photos", "run"] and os.listdir(photos) == []
    code, _, err = run_cli(capsys, "report", f"--model_dir={run}", f"--out={photos / 'r.png'}")
    assert code == 0, err
    assert os.listdir(photos) == ["r.png"]


# ----- 9-13: one line, exit 2, never a traceback ---------------------------------------------------

HUGE = "1" * 5000


@pytest.mark.parametrize(
    "text",
    [
        f"master: 10.0.0.1:{HUGE}\nworker: [10.0.0.2:2222]\n",
        f"master: 10.0.0.1:2222\nworker: ['[fe80::2]:{HUGE}']\n",
        f"master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nnum_clones: {HUGE}\n",
        f"master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nnum_clones: {10**26}\n",
        f"master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nhosts: {{10.0.0.2: {{num_clones: {HUGE}}}}}\n",
        "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nhosts: {10.0.0.2: {num_clones: 257}}\n",
    ],
)
def test_huge_numbers_in_the_cluster_file(text, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    for command in ("validate", "doctor"):
        code, _, err = run_cli(capsys, command, f"--cluster={path}", "--role=master")
        lines = one_line_refusal(code, err)
        assert len(lines) == 2 and len(lines[1]) < 400, err


def test_num_clones_flag_is_capped(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n")
    for value in (HUGE, str(10**26), "257"):
        code, out, err = run_cli(
            capsys,
            "k8s",
            f"--cluster={path}",
            "--pipeline=p",
            "--model_dir=m",
            "--image=i",
            f"--num_clones={value}",
        )
        assert one_line_refusal(code, err) and len(err) < 600 and not out, err
    code, out, err = run_cli(
        capsys, "k8s", f"--cluster={path}", "--pipeline=p", "--model_dir=m", "--image=i", "--num_clones=256"
    )
    assert code == 0 and "nvidia.com/gpu: 256" in out


def png_header(width, height):
    """A PNG whose header claims width x height (no pixel data follows)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 16)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_decompression_bomb_is_a_bad_image(tmp_path, capsys):
    """A header claiming 30000x30000 is a bad image like any other, with or without --skip_bad."""
    from od_dist.data import errors, voc

    images, ann, _ = voc_folder(tmp_path)
    (images / "b.png").write_bytes(png_header(30000, 30000))
    (ann / "b.xml").write_text(
        "<annotation><filename>b.png</filename><object><name>cat</name><bndbox><xmin>1</xmin>"
        "<ymin>1</ymin><xmax>4</xmax><ymax>4</ymax></bndbox></object></annotation>"
    )
    with pytest.raises(errors.BadAnnotation, match="pixels"):
        voc.parse(str(ann / "b.xml"), str(images))
    code, _, err = data_voc(capsys, images, ann, tmp_path / "records")
    assert code == 2 and "pixels" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "doc",
    [
        coco_doc(ann={"iscrowd": "abc"}),
        coco_doc(ann={"iscrowd": float("inf")}),
        coco_doc(ann={"iscrowd": [1]}),
        coco_doc(ann={"image_id": [1]}),
        coco_doc(ann={"image_id": {"a": 1}}),
        coco_doc(ann={"category_id": [1]}),
        coco_doc(image={"file_name": 5}),
        coco_doc(image={"file_name": ["a.jpg"]}),
        coco_doc(image={"id": "1" * 5000}),
        None,
    ],
)
def test_coco_hostile_values_are_one_line(doc, tmp_path, capsys):
    raw = "[" * 100_000 + "]" * 100_000 if doc is None else None
    code, _, err = data_coco(capsys, tmp_path, doc, raw)
    lines = one_line_refusal(code, err)
    assert all(len(x) < 600 for x in lines), err
    assert not (tmp_path / "records").exists()


def test_export_of_empty_checkpoint_files_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint").write_text('model_checkpoint_path: "ckpt-1"\nall_model_checkpoint_paths: "ckpt-1"\n')
    for name in ("ckpt-1.index", "ckpt-1.data-00000-of-00001"):
        (run / name).write_bytes(b"")
    code, _, err = run_cli(
        capsys, "export", f"--pipeline={DEMO}", f"--model_dir={run}", f"--out={tmp_path / 'exported'}"
    )
    assert one_line_refusal(code, err) == [x for x in err.splitlines() if x.strip()][-1:], err
    assert "cannot be read" in err and not (tmp_path / "exported").exists()


@pytest.mark.parametrize(
    "text",
    [
        "master: " + "a" * 1_000_000 + "\nworker: [10.0.0.2:2222]\n",
        "master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n" + "k" * 1_000_000 + ": 1\n",
        'master: "10.0.0.1\\0:2222"\nworker: [10.0.0.2:2222]\n',
        'master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\n"bad\\0key\\nsecond line": 1\n',
        'master: 10.0.0.1:2222\nworker: [10.0.0.2:2222]\nhosts: {10.0.0.2: {os: "' + "w" * 100_000 + '"}}\n',
    ],
)
def test_cluster_file_values_are_echoed_short_and_on_one_line(text, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    code, _, err = run_cli(capsys, "validate", f"--cluster={path}")
    lines = one_line_refusal(code, err)
    assert len(lines) == 2 and len(lines[1]) < 400 and "\x00" not in err, err


# ----- 14: scripts for thousands of workers -------------------------------------------------------


def test_scripts_time_grows_linearly_with_the_task_count(tmp_path):
    """8 times the workers take about 8 times the CPU time (they took 64 times: every task's
    firewall rule rebuilt every role's task list). CPU time of this process, so other load does not
    count."""
    import time

    def seconds(n):
        doc = {
            "master": "10.200.0.1:2222",
            "ps": ["10.200.0.2:2222"],
            "worker": [f"10.{1 + i // 62500}.{(i // 250) % 250}.{i % 250 + 1}:2222" for i in range(n)],
        }
        cluster = cluster_mod.from_document(doc)
        start = time.process_time()
        scripts.write_scripts(cluster, "c.yaml", ["--pipeline=p"], str(tmp_path / f"out{n}"), "od-dist", 300)
        return time.process_time() - start

    seconds(50)  # warm up
    small, big = seconds(250), seconds(2000)
    assert big < 20 * small, (small, big)


# ----- no traceback, whatever the input ------------------------------------------------------------


@pytest.mark.parametrize("command", ["validate", "tf-config", "doctor", "train", "launch", "scripts", "k8s"])
def test_cluster_commands_on_hostile_input(command, tmp_path, capsys):
    """Every command that reads a cluster file, on each hostile string as an address and as the
    file's name: one problem per line, exit 2, never a traceback."""
    flags = ["--pipeline=p.yaml", "--model_dir=m", "--image=i"] if command in ("scripts", "k8s") else []
    flags += [f"--out={tmp_path / 'out'}"] if command == "scripts" else []
    for text in HOSTILE:
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({"master": f"[fe80::1%{text}]:2230", "worker": ["10.0.0.2:2222"]}))
        for cluster in (str(path), str(tmp_path / f"{text}.yaml")):
            code, out, err = run_cli(capsys, command, f"--cluster={cluster}", *flags)
            lines = one_line_refusal(code, err)
            assert all(len(x) < 400 for x in lines) and not (tmp_path / "out").exists(), (command, text, err)


@pytest.mark.parametrize(
    "args",
    [
        ["data", "voc", "--images={}", "--annotations={}", "--out=o"],
        ["data", "coco", "--images={}", "--annotations={}", "--out=o"],
        ["data", "check", "--records={}"],
        ["predict", "--model={}", "--images={}", "--out=o"],
        ["report", "--model_dir={}"],
        ["eval", "--pipeline={}", "--model_dir=m"],
    ],
)
def test_file_commands_on_hostile_input(args, tmp_path, capsys, monkeypatch):
    work = tmp_path / "w" / "x"  # '..' is an empty folder too, not other tests' files
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for text in HOSTILE:
        code, out, err = run_cli(capsys, *(a.format(text) for a in args))
        assert code in (1, 2) and "Traceback" not in err, (args, text, err)
        assert len([x for x in err.splitlines() if x.strip()]) <= 3, err
    assert not (work / "o").exists()


def test_the_installed_command_refuses_an_injected_zone_id(tmp_path):
    """The reported case, through the real entry point: nothing written, one line, exit 2."""
    path = tmp_path / "c.yaml"
    path.write_text('master: "[fe80::1%x\\ntouch PWNED\\n#]:2230"\nworker: ["[fe80::2]:2231"]\n')
    for args in (["validate"], ["scripts", "--pipeline=p", "--model_dir=m", f"--out={tmp_path / 'out'}"]):
        r = subprocess.run(
            [sys.executable, "-m", "od_dist", args[0], f"--cluster={path}", *args[1:]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr and "control character" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 2
    assert not (tmp_path / "out").exists() and not (tmp_path / "PWNED").exists()
