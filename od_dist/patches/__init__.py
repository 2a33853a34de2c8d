"""Every use of a private API of TensorFlow, Orbit, tf_keras and Model Garden, in one package: a
module for each library (`tensorflow`, `orbit`, `model_garden`, `tf_keras`), and `imports`, what a
task's imports of them leave out; `base`, what they share.

Each entry of PATCHES (each module's own, gathered here) says what it touches, why, and the version
of its library it was written against; the modules' functions are the only code of od_dist that
reaches into those libraries' private names. `check()` runs at the start of every TensorFlow task
(trainer, server, evaluator, eval, export): when an attribute a patch needs is missing, as after a
library upgrade, it ends the task with one line naming the patch and the installed version (exit 2,
INVALID: nothing was started) instead of letting the patch fail silently mid-run (a renamed
`Controller._train_n_steps` would drop the save on stop, the loop guard and the progress lines
without an error). An attribute that a library sets on its instances (`held`) cannot be seen on the
class: `check()` sees its class, and the patch reads it through `base.held`, which ends the task the
same way where the instance is first at hand, before any step (no getattr default: a rename would be
other behaviour, not an error).

The libraries are imported inside the functions: od_dist's host side imports this package without
TensorFlow. Not here: `sys._getframe` (host/console.py), the standard library's own and documented.
"""

from __future__ import annotations

from od_dist.patches import base, imports, model_garden, orbit, tensorflow, tf_keras

PATCHES = orbit.PATCHES + tensorflow.PATCHES + model_garden.PATCHES + tf_keras.PATCHES + imports.PATCHES


def problems(libraries=None) -> list[str]:
    """One line for each patch (of `libraries`, distribution names; None: all) whose attribute is
    missing here (for a `held` attribute, its class)."""
    found = []
    for patch in PATCHES:
        if libraries is not None and patch.library[0] not in libraries:
            continue
        for need in patch.needs + tuple(h.rsplit(".", 1)[0] for h in patch.held):
            if base.is_missing(need):
                found.append(base.missing_line(patch, need))
                break
    return found


def check(libraries=None) -> None:
    """At a TensorFlow task's start: ends it with one line and exit 2 (INVALID) when an attribute a
    patch needs is missing (the first such patch)."""
    found = problems(libraries)
    if found:
        base.end_task(found[0])
