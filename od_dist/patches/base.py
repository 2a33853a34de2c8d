"""What every patch module shares: a patch's entry, the versions the patches were written against,
and the one line and exit that end a task when a patch's attribute is missing."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from dataclasses import dataclass

from od_dist.protocol import exit_codes

# The distributions whose versions the patches were written against (pip show).
TENSORFLOW = ("tensorflow", "2.20.0")
MODEL_GARDEN = ("tf-models-official", "2.20.0")  # Model Garden (official.*), and Orbit with it
TF_KERAS = ("tf_keras", "2.20.1")

_BY_NAME: dict[str, Patch] = {}  # every entry made, by name (held's message)
_ABSENT = object()


@dataclass(frozen=True)
class Patch:
    name: str
    library: tuple[str, str]  # (distribution, the version it was written against)
    needs: tuple[str, ...]  # "module:attribute.attribute": what must exist
    touches: str
    why: str
    held: tuple[str, ...] = ()  # "module:Class.attribute" set on instances: its class checked by check()

    def __post_init__(self):
        _BY_NAME[self.name] = self


def is_missing(need: str) -> bool:
    """Whether `need` ("module:attribute.attribute") is missing here."""
    module_name, _, path = need.partition(":")
    try:
        value = importlib.import_module(module_name)
    except ImportError:
        return True
    for part in path.split("."):
        if not hasattr(value, part):
            return True
        value = getattr(value, part)
    return False


def installed(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def missing_line(patch: Patch, need: str) -> str:
    """The line that ends a task whose `patch` misses `need`: the patch, the versions, the fix."""
    distribution, written_for = patch.library
    return (
        f"od-dist: patch '{patch.name}' needs {need.replace(':', '.')}, missing in "
        f"{distribution} {installed(distribution)} (written against {written_for}); install "
        f"{distribution}=={written_for}, or update od_dist/patches/; exit {exit_codes.INVALID}"
    )


def end_task(line: str):
    """Ends this task with `line` on stderr and exit 2 (INVALID: nothing was started)."""
    sys.stdout.flush()
    print(line, file=sys.stderr, flush=True)
    raise SystemExit(exit_codes.INVALID)


def held(patch_name: str, instance, attribute: str):
    """`instance.attribute`, which patch `patch_name` declares `held`: a missing one ends the task
    with check()'s line and exit 2, here, rather than fail or change what the patch does."""
    value = getattr(instance, attribute, _ABSENT)
    if value is _ABSENT:
        patch = _BY_NAME[patch_name]
        end_task(missing_line(patch, next(h for h in patch.held if h.endswith(f".{attribute}"))))
    return value
