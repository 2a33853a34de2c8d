"""The README, the pages of docs/, BENCHMARKS.md and scripts/README.md: every relative link resolves (its file, and its #anchor to a
heading of that file), and the README stays a ten-minute read."""

import glob
import os
import re
import subprocess
import sys

from tests.loopback import ROOT

README_MAX_LINES = 350
PAGES = [
    os.path.join(ROOT, name) for name in ("README.md", "BENCHMARKS.md", os.path.join("scripts", "README.md"))
]
PAGES += sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: str) -> str:
    """The file without its code blocks and code spans, where a `](x)` is no link."""
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`]*`", "", text)


def anchors(path: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file: lower case, punctuation but hyphens
    dropped, spaces as hyphens."""
    headings = re.findall(r"^#{1,6} (.+)$", prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(prose(page)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), name)) if name else page
            where = f"{os.path.relpath(page, ROOT)}: ({target})"
            if not os.path.exists(path):
                broken.append(f"{where}: no {os.path.relpath(path, ROOT)}")
            elif anchor and path.endswith(".md") and anchor not in anchors(path):
                broken.append(f"{where}: no heading #{anchor} in {os.path.relpath(path, ROOT)}")
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_ten_minute_read():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES}"
    assert any(line.startswith("## Contents") for line in lines)


COMMANDS_MD = os.path.join(ROOT, "docs", "commands.md")


def section(text: str, heading: str) -> str:
    return re.search(rf"^## {heading}\n(.*?)(?=^## |\Z)", text, re.S | re.M).group(1)


def bullets(text: str) -> list[str]:
    return [b.replace("\n  ", " ") for b in re.findall(r"^- (.*?)(?=^- |^\S|\Z)", text, re.S | re.M)]


def named_flags(text: str) -> set[str]:
    return set(re.findall(r"--(?:\[no\])?([a-z][a-z_]*)", " ".join(re.findall(r"`([^`]*)`", text))))


def help_flags(command: str) -> set[str]:
    r = subprocess.run(
        [sys.executable, "-m", "od_dist", *command.split(), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return set(re.findall(r"^    --(?:\[no\])?([a-z][a-z_]*):", r.stdout, re.M))


def test_every_synopsis_of_docs_commands_md_names_its_commands_flags():
    """Each command's synopsis names every flag its --help lists, and none it does not;
    `[train flags]` stands for those of the Train flags and Supervisor flags sections."""
    with open(COMMANDS_MD, encoding="utf-8") as f:
        text = f.read()
    assert text.count("\n## Commands\n") == 1
    shared = set()
    for heading in ("Train flags", "Supervisor flags"):
        shared |= {f for b in bullets(section(text, heading)) for f in named_flags(b.split(": ")[0])}
    wrong, seen = [], []
    for bullet in bullets(section(text, "Commands")):
        command = re.match(r"`od-dist ([a-z0-9-]+(?: [a-z]+)?)", bullet)
        if not command:
            continue
        name = command.group(1)
        if name.split()[0] in ("data", "pipeline") and len(name.split()) == 1:
            continue
        seen.append(name)
        given, listed = named_flags(bullet), help_flags(name)
        allowed = listed - shared if "[train flags]" in bullet else listed
        if allowed - given:
            wrong.append(f"{name}: --help lists {sorted(allowed - given)}, its synopsis does not")
        if given - listed:
            wrong.append(f"{name}: its synopsis names {sorted(given - listed)}, which --help does not list")
    assert not wrong, "\n".join(wrong)
    r = subprocess.run(
        [sys.executable, "-m", "od_dist", "--help"], capture_output=True, text=True, timeout=60
    )
    every = re.findall(r"^  ([a-z0-9-]+(?: [a-z]+)?)  ", r.stdout, re.M)
    assert sorted(seen) == sorted(every)


def test_every_coco_figure_eval_writes_is_explained_in_the_commands_page():
    from od_dist.model import metrics

    page = open(os.path.join(ROOT, "docs", "commands.md"), encoding="utf-8").read()
    table = page[page.index("## COCO figures") :]
    rows = re.findall(r"^\| `([^`]+)` \|", table, flags=re.M)
    assert rows == [*metrics.MEANINGS, *(f"{k}/<class>" for k in metrics.PER_CLASS)]


def test_the_one_machine_train_and_evaluate_file_ships_and_is_documented():
    """clusters/local-evaluator.yaml: a loopback master and an evaluator (training and continuous
    evaluation side by side, as model_main_tf2.py in two shells), shown in docs/."""
    from od_dist.cluster import spec

    path = os.path.join(ROOT, "clusters", "local-evaluator.yaml")
    cluster = spec.load(path)
    assert sorted(t.role for t in cluster.tasks()) == ["evaluator", "master"]
    assert cluster.loopback_only() and cluster.strategy == "multi_worker_mirrored"
    assert (
        "od-dist launch --cluster clusters/local-evaluator.yaml"
        in open(os.path.join(ROOT, "docs", "odapi.md"), encoding="utf-8").read()
    )


def test_the_pipelines_point_at_pages_that_exist():
    """A shipped pipeline's comments name the page that explains its format: that page exists (and
    no README section that is not there)."""
    readme_headings = anchors(os.path.join(ROOT, "README.md"))
    for path in sorted(glob.glob(os.path.join(ROOT, "pipelines", "*.yaml"))):
        text = open(path, encoding="utf-8").read()
        for page in re.findall(r"\b(docs/[\w-]+\.md)", text):
            assert os.path.isfile(os.path.join(ROOT, page)), (path, page)
        for section in re.findall(r'README, "([^"]+)"', text):
            assert section.lower().replace(" ", "-") in readme_headings, (path, section)
