"""The account a machine's start-at-boot unit runs as (`od-dist scripts --at_boot`): its cluster
file's `hosts.<host>.user`, else `--at_boot_user`. What each system takes as a user name, and the
system account, which runs a unit only when it is named. No TensorFlow here.

The system account has one meaning on both systems, whichever name (in any case) is given: root on
Linux, SYSTEM (LocalSystem) on Windows, so that one `--at_boot_user=root` serves a file of Linux and
Windows machines. A user of a machine whose os is not declared (it gets both systems' units) must be
a name both take.
"""

from __future__ import annotations

import re

from od_dist.cluster.messages import problem, unsafe_char

SYSTEM_NAMES = ("root", "system", "nt authority\\system")  # lower case: compared so
SYSTEM = {"linux": "root", "windows": "SYSTEM"}  # each system's own name for its system account
OSES = tuple(SYSTEM)

LINUX_USER = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*|[0-9]+")  # a name or a uid, as systemd's User= takes
# Not in a Windows account name: the characters Windows refuses there, `@` (but one before the
# domain), and `%`, which the README's interactive cmd line cannot escape.
_WINDOWS_CHAR = r'[^\\/"\[\]:;|=,+*?<>%@]'
WINDOWS_USER = re.compile(rf"(?:{_WINDOWS_CHAR}+\\)?{_WINDOWS_CHAR}+(?:@[A-Za-z0-9.-]+)?")
SYSTEM_HINT = "root or SYSTEM for the system account"
EXAMPLES = {"linux": "od or 1000", "windows": "od, LAB\\od or od@lab.example"}


def is_system(user: str) -> bool:
    return user.lower() in SYSTEM_NAMES


def on(user: str, os_name: str) -> str:
    """The name `user` has on `os_name`: the system account as that system calls it."""
    return SYSTEM[os_name] if is_system(user) else user


def _fits(user: str, os_name: str) -> bool:
    """Whether `os_name` takes `user` as a name: its form, no space around it, no leading '-' (an
    option to schtasks, which takes -RU for /RU), nothing that ends or reorders a line."""
    form = LINUX_USER if os_name == "linux" else WINDOWS_USER
    return bool(form.fullmatch(user)) and user == user.strip() and user[0] != "-" and not unsafe_char(user)


def problems(key: str, user, os_name=None, host: str = "") -> list[str]:
    """Why `user` names no account of `os_name` (undeclared: of both systems, whose units the
    machine gets), one line naming `key`, the value and the fix; [] when it does. `host`: the
    machine, where `key` does not name it."""
    if not isinstance(user, str) or not user.strip():  # YAML reads `user: 1000` as a number
        fix = "write it as text, in quotes for a uid ('1000')"
        return [problem(key, user, "not a user name", f"{fix}; {SYSTEM_HINT}")]
    if is_system(user):
        return []
    declared = os_name in OSES
    for name in (os_name,) if declared else OSES:
        if _fits(user, name):
            continue
        what = f"not a {name.capitalize()} user name" + (f" (for {host})" if host else "")
        fix = f"give one such as {EXAMPLES[name]}"
        if not declared:
            what += ", and the host's os is not declared: it gets Linux and Windows units"
            fix = f"declare its os, or {fix}"
        return [problem(key, user, what, f"{fix}; {SYSTEM_HINT}")]
    return []
