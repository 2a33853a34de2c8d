"""The `od-dist` command line: flags -> calls. Subcommands live in a registry; each has its own absl
FlagValues, so `od-dist train --help` lists only train's flags. Modules that import TensorFlow are
imported inside the commands that train, so validate, tf-config and --help stay fast.

Exit status: 0 ok, 2 invalid input (nothing started), 1 runtime failure.
"""

from __future__ import annotations

import difflib
import sys
from dataclasses import dataclass
from typing import Callable

from absl import flags

from od_dist.cluster import InvalidCluster

EXIT_OK, EXIT_FAILURE, EXIT_INVALID = 0, 1, 2


class UsageError(Exception):
    """Bad flags or input found by a command; printed as is, exit 2."""


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    usage: str  # description and example, shown by --help
    define: Callable[[flags.FlagValues], None]
    run: Callable[[flags.FlagValues], int]


COMMANDS: dict[str, Command] = {}


def command(name: str, summary: str, usage: str, define: Callable[[flags.FlagValues], None]):
    def register(fn):
        COMMANDS[name] = Command(name, summary, usage.strip("\n"), define, fn)
        return fn

    return register


# ----- shared flags ---------------------------------------------------------------------------


def define_task_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("cluster", None, "The cluster YAML file (same on every machine). Without it, "
                        "TF_CONFIG from the environment is used (as Kubernetes TFJob sets it).", flag_values=fv)
    flags.DEFINE_string("role", None, "This task's role: ps, master (alias chief), worker or evaluator. "
                        "Omitted: inferred from the one cluster entry that is this machine.", flag_values=fv)
    flags.DEFINE_integer("index", None, "This task's index within its role (list order in the file; "
                         "0 for master). Default 0.", lower_bound=0, flag_values=fv)
    flags.DEFINE_boolean("allow_public_addresses", False,
                         "Accept cluster addresses on the public internet. Off by default because the "
                         "TensorFlow server has no authentication and executes whatever graph it is sent: "
                         "anyone who reaches its port can run code on the machine.", flag_values=fv)


def define_train_flags(fv: flags.FlagValues) -> None:
    """The flags of `od-dist train`; launch, scripts and k8s take the same ones and pass them on."""
    define_task_flags(fv)
    flags.DEFINE_string("pipeline", None, "The pipeline: a Model Garden experiment YAML (see pipelines/).",
                        flag_values=fv)
    flags.DEFINE_string("model_dir", None, "Where checkpoints, summaries and logs go; a run resumes from "
                        "the latest checkpoint found here.", flag_values=fv)
    flags.DEFINE_integer("num_clones", None, "Replicas per trainer process: the first N GPUs (or N logical "
                         "CPU devices with --clone_on_cpu). Default: the cluster file's num_clones, else 1.",
                         lower_bound=1, flag_values=fv)
    flags.DEFINE_boolean("clone_on_cpu", False, "Make the --num_clones replicas logical CPU devices "
                         "instead of GPUs.", flag_values=fv)
    flags.DEFINE_string("params_override", None, "A YAML string or file overriding pipeline keys, e.g. "
                        "'trainer.train_steps=2000' or 'trainer: {train_steps: 2000}'.", flag_values=fv)
    flags.DEFINE_integer("wait_timeout", 300, "Seconds to wait for every peer (and for servers: for the "
                         "master) before giving up with the names of the missing tasks.", lower_bound=1,
                         flag_values=fv)


# The train flags that `launch`, `scripts` and `k8s` pass on to every task (role/index are per task).
PASS_ON_FLAGS = ("pipeline", "model_dir", "num_clones", "clone_on_cpu", "params_override", "wait_timeout",
                 "allow_public_addresses")


def passed_on_args(fv: flags.FlagValues) -> list[str]:
    """The train flags the user set, as `--name=value` arguments, to hand to each task's `train`."""
    args = []
    for name in PASS_ON_FLAGS:
        flag = fv[name]
        if flag.present:
            if isinstance(flag.value, bool):
                args.append(f"--{'' if flag.value else 'no'}{name}")
            else:
                args.append(f"--{name}={flag.value}")
    return args


def select_task(fv: flags.FlagValues, require_task: bool = True, allow_none: bool = False):
    from od_dist import config

    return config.select(fv.cluster, fv.role, fv.index, fv.allow_public_addresses,
                         require_task=require_task, allow_none=allow_none)


# ----- validate / tf-config -------------------------------------------------------------------


def _summary(selected) -> str:
    c = selected.cluster
    lines = [f"{selected.source}: valid, strategy {c.strategy}, num_clones {c.num_clones}"]
    for t in c.tasks():
        mark = "  <- this machine" if selected.task == t else ""
        extra = " (runs no server)" if t.role == "evaluator" else ""
        lines.append(f"  {t.name:<12} {str(t.address):<28}{extra}{mark}")
    lines.append(f"this machine: {selected.task.name + ', ' if selected.task else ''}{selected.machine_note}")
    return "\n".join(lines)


@command("validate", "Check a cluster file (and this machine's place in it) without starting anything.", """
Checks the cluster file: YAML, keys, addresses and ports, duplicates, ps/strategy rules, and that
the entry at --role/--index is an address of this machine. Prints a summary, or every problem with
its fix (exit 2).

Example:
  od-dist validate --cluster clusters/lan-example.yaml --role worker --index 1
""", define_task_flags)
def cmd_validate(fv) -> int:
    print(_summary(select_task(fv, require_task=False)))
    return EXIT_OK


@command("tf-config", "Print the TF_CONFIG JSON for one task of a cluster file.", """
Prints the TF_CONFIG that TensorFlow's TFConfigClusterResolver reads, for the task at
--role/--index (inferred from this machine when omitted). `master` becomes TensorFlow's `chief`;
the evaluator is left out of every other task's cluster (it runs no server).

Example:
  export TF_CONFIG=$(od-dist tf-config --cluster clusters/local.yaml --role worker --index 1)
""", define_task_flags)
def cmd_tf_config(fv) -> int:
    from od_dist.cluster import tf_config_json

    selected = select_task(fv)
    print(tf_config_json(selected.cluster, selected.task.role, selected.task.index))
    return EXIT_OK


# ----- entry point ----------------------------------------------------------------------------


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

Exit status: 0 ok, 2 invalid input (nothing was started), 1 runtime failure."""


def _help(cmd: Command, fv: flags.FlagValues) -> str:
    flag_help = "\n".join(
        "  " + line for line in fv.module_help(fv.find_module_defining_flag(next(iter(fv)))).splitlines()[1:]
    ) if list(fv) else ""
    return f"od-dist {cmd.name}: {cmd.summary}\n\n{cmd.usage}\n\nFlags:\n{flag_help}"


def main(argv: list[str]) -> int:
    args = argv[1:]
    if not args or args[0] in ("-h", "--help", "help"):
        print(_overview())
        return EXIT_OK if args else EXIT_INVALID
    name, rest = args[0], args[1:]
    cmd = COMMANDS.get(name)
    if cmd is None:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "run 'od-dist --help' for the list"
        print(f"od-dist: unknown command '{name}'; {hint}", file=sys.stderr)
        return EXIT_INVALID
    fv = flags.FlagValues()
    cmd.define(fv)
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in rest):
        print(_help(cmd, fv))
        return EXIT_OK
    try:
        extra = fv([f"od-dist {name}"] + rest)[1:]
    except flags.Error as e:
        print(f"od-dist {name}: {e}; see 'od-dist {name} --help'", file=sys.stderr)
        return EXIT_INVALID
    if extra:
        print(f"od-dist {name}: unexpected argument '{extra[0]}'; flags are written --name=value",
              file=sys.stderr)
        return EXIT_INVALID
    try:
        return cmd.run(fv)
    except InvalidCluster as e:
        where = f" ({e.source})" if e.source else ""
        print(f"od-dist {name}: invalid cluster{where}:", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return EXIT_INVALID
    except UsageError as e:
        print(f"od-dist {name}: {e}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print(f"od-dist {name}: interrupted", file=sys.stderr)
        return 130


def run() -> None:
    sys.exit(main(sys.argv))
