"""The `od-dist` command line: flags -> calls. Each command registers itself (registry.py) from the
module of its group, with its own absl FlagValues, so `od-dist train --help` lists only train's
flags; the flags several commands take are defined once (flags.py). Modules that import TensorFlow
are imported inside the commands that train, so validate, tf-config and --help stay fast.

Exit status: protocol/exit_codes.py (`od-dist --help` lists it).
"""

from __future__ import annotations

import atexit
import contextlib
import difflib
import logging
import os
import re
import sys

from absl import flags as absl_flags  # `flags` is this package's flags.py

# The command modules register their commands when imported, in the order `od-dist --help` lists them.
# isort: off
from od_dist.cli import checks, train, launch, data, model, render  # noqa: F401

# isort: on
from od_dist.cli.registry import COMMANDS, Command, UsageError
from od_dist.cluster.messages import SHOWN_MAX, shown
from od_dist.cluster.spec import InvalidCluster
from od_dist.protocol import exit_codes, spare


def _gather(args: list[str], lists: tuple[str, ...]) -> list[str]:
    """`--records a b c` -> `--records a --records=b --records=c`: the bare arguments that follow a
    flag of `lists` (and its value) are more of its values. Others are left for absl, and refused."""
    out, current, value_next = [], None, False
    for arg in args:
        if value_next:
            value_next = False
        elif arg.startswith("-") and arg != "-":
            name, eq, _ = arg.lstrip("-").partition("=")
            current = name if name in lists else None
            value_next = current is not None and not eq
        elif current is not None:
            arg = f"--{current}={arg}"
        out.append(arg)
    return out


def _stray(name: str, args: list[str], arg: str, lists: tuple[str, ...]) -> str:
    """Why `arg` is refused, and how to pass several files."""
    before = [a for a in args[: args.index(arg)] if a.startswith("--")] if arg in args else []
    after = before[-1].lstrip("-").partition("=")[0] if before else ""
    where = f" after --{after}, which takes one value" if after and after not in lists else ""
    several = (
        f"; several files go after {' or '.join('--' + n for n in lists)}: one after another, as a glob, "
        "or comma-separated"
        if lists
        else "; quote a path that holds spaces"
    )
    return (
        f"od-dist {name}: unexpected argument '{shown(arg)}'{where}; flags are written --name=value{several}"
    )


def _overview() -> str:
    width = max(len(n) for n in COMMANDS)
    rows = "\n".join(f"  {c.name:<{width}}  {c.summary}" for c in COMMANDS.values())
    return f"""od-dist: one cluster file -> a distributed TensorFlow object-detection training job.

Usage: od-dist COMMAND [--flag=value ...]    (od-dist COMMAND --help for its flags)

Commands:
{rows}

Example (the whole cluster on this machine):
  od-dist data shapes
  od-dist launch --cluster clusters/local.yaml --pipeline pipelines/shapes_retinanet.yaml --model_dir runs/demo

Exit status: {exit_codes.summary()}"""


def _help(cmd: Command, fv: absl_flags.FlagValues) -> str:
    for name in cmd.refused:
        delattr(fv, name)
    # The command's flags come from several modules (its own, flags.py): listed as one, under this
    # package's name, as absl lists the key flags of a module.
    for name in fv:
        absl_flags.declare_key_flag(name, flag_values=fv)
    flag_help = (
        "\n".join("  " + line for line in fv.module_help(__name__).splitlines()[1:]) if list(fv) else ""
    )
    return f"od-dist {cmd.name}: {cmd.summary}\n\n{cmd.usage}\n\nFlags:\n{flag_help}"


def main(argv: list[str]) -> int:
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_overview())
        return exit_codes.OK if args else exit_codes.INVALID
    for n, arg in enumerate(args, start=1):
        if "\x00" in arg:  # no operating system passes one; a caller in Python might
            print(f"od-dist: argument {n}: '{shown(arg)}' holds a NUL byte; remove it", file=sys.stderr)
            return exit_codes.INVALID
    name, rest = args[0], args[1:]
    if rest and f"{name} {rest[0]}" in COMMANDS:  # e.g. `od-dist data shapes`
        name, rest = f"{name} {rest[0]}", rest[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "run 'od-dist --help' for the list"
        print(f"od-dist: unknown command '{shown(name)}'; {hint}", file=sys.stderr)
        return exit_codes.INVALID
    fv = absl_flags.FlagValues()
    cmd.define(fv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in rest):
        print(_help(cmd, fv))
        return exit_codes.OK
    try:
        extra = fv([f"od-dist {name}"] + _gather(rest, cmd.lists))[1:]
    except absl_flags.Error as e:
        text = re.sub(rf"\S{{{SHOWN_MAX},}}", lambda m: shown(m.group()), str(e))  # a long value, cut
        print(f"od-dist {name}: {shown(text, 1000)}; see 'od-dist {name} --help'", file=sys.stderr)
        return exit_codes.INVALID
    if extra and cmd.rest:  # `predict --model m --out o a.jpg b.jpg`: the images
        fv[cmd.rest].value = [*(fv[cmd.rest].value or []), *extra]
        extra = []
    if extra:
        print(_stray(name, rest, extra[0], cmd.lists), file=sys.stderr)
        return exit_codes.INVALID
    try:
        return cmd.run(fv)
    except InvalidCluster as e:
        where = f" ({e.source})" if e.source else ""
        print(f"od-dist {name}: invalid input{where}:", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return exit_codes.INVALID
    except UsageError as e:
        print(f"od-dist {name}: {e}", file=sys.stderr)
        return exit_codes.INVALID
    except OSError as e:  # e.g. an --out or --model_dir that cannot be written
        where = f" '{e.filename}'" if e.filename else ""
        print(f"od-dist {name}: cannot use{where}: {e.strerror or e}", file=sys.stderr)
        return exit_codes.FAILED
    except KeyboardInterrupt:
        print(f"od-dist {name}: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as e:  # an install that missed a step, e.g. Windows' second one
        from od_dist.host.doctor_here import model_garden_install

        fix = model_garden_install() if (e.name or "").split(".")[0] == "official" else "reinstall od-dist"
        print(f"od-dist {name}: {e} in this Python ({sys.executable}); {fix}", file=sys.stderr)
        return exit_codes.FAILED


def _exit_without_teardown(returned: list) -> None:
    """The last exit handler: once main() returned, the process ends here, after the other
    handlers (TensorFlow's own among them) and its streams flushed, without the interpreter's
    teardown of TensorFlow's objects: about 1 s of CPU and of wall clock at every TensorFlow
    process's end (a 10-step train: its last handler 1.1 s before its exit, 2026-12-02), which a
    restart or a test's next start waited for. Checkpoints and summaries are written and flushed
    by then (orbit flushes its writers after every loop). An exception or a signal leaves
    `returned` empty, and a process without TensorFlow has no such teardown: Python's usual end,
    which also runs the exit handlers registered before this one (a sitecustomize's; a
    TensorFlow process skips those, and runs logging's here)."""
    if not returned or "tensorflow" not in sys.modules:
        return
    logging.shutdown()  # registered before this handler, so it would run after it
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(returned[0])


def run() -> None:
    returned: list[int] = []
    atexit.register(_exit_without_teardown, returned)  # first registered, so run last
    # TensorFlow's C++ INFO/WARNING lines (CUDA probing, oneDNN notes) drown the progress lines;
    # set before any command imports TensorFlow. A user's own setting wins.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Model Garden builds its models with tf_keras (Keras 2), never `tf.keras`; without this,
    # `import tensorflow` also loads Keras 3 (and scikit-learn and matplotlib with it): about
    # 1.5 s of CPU at every TensorFlow process start, for nothing od-dist uses.
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    if os.environ.pop(spare.SPARE_ENV, None):  # a warm spare (host/spare.py): run when a start takes it
        from od_dist.task import spare as parked

        parked.park()
    code = main(sys.argv)
    if isinstance(code, int):
        returned.append(code)
    sys.exit(code)
