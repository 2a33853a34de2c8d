"""`od-dist report`: one PNG of a run from the event files Model Garden writes
(``<model_dir>/train`` and ``<model_dir>/validation``): training loss, learning rate, steps/s, and
COCO AP / AP50 over steps when evaluations exist.

TF2 writes scalars as tensors: read with ``EventAccumulator(size_guidance={'tensors': 0})`` (0 keeps
every event; the default keeps 10 per tag) and ``tf.make_ndarray``.
"""

from __future__ import annotations

import glob
import os
import tempfile

from od_dist.protocol import checkpoint_feed

LOSS_TAGS = ("total_loss", "cls_loss", "box_loss")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class ReportError(RuntimeError):
    """One line for the user."""


def read_scalars(event_dir: str) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} from every event file in ``event_dir`` (sorted by step; a resumed
    run's files are merged, a repeated step keeps the latest value)."""
    if not glob.glob(os.path.join(event_dir, "events.out.tfevents.*")):
        return {}
    import tensorflow as tf
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(event_dir, size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags().get("tensors", []):
        by_step = {}
        for e in acc.Tensors(tag):
            value = tf.make_ndarray(e.tensor_proto)
            if value.size == 1:
                by_step[int(e.step)] = float(value.reshape(()))
        if by_step:
            out[tag] = sorted(by_step.items())
    for tag in acc.Tags().get("scalars", []):  # TF1-style summaries, should a run have them
        out.setdefault(tag, sorted({int(e.step): float(e.value) for e in acc.Scalars(tag)}.items()))
    return out


def report(model_dir: str, out: str | None = None, title: str | None = None) -> dict:
    """Writes the picture (default ``<model_dir>/report.png``). Returns {'out', 'train', 'validation'}
    (the tags plotted)."""
    if not os.path.isdir(model_dir):
        raise ReportError(f"--model_dir: '{model_dir}': no such folder; pass the --model_dir of a run")
    out = out or os.path.join(model_dir, "report.png")
    if os.path.isdir(out):
        raise ReportError(
            f"--out: '{out}': is a folder; --out is the PNG to write, e.g. {os.path.join(out, 'report.png')}"
        )
    train = read_scalars(os.path.join(model_dir, "train"))
    val = read_scalars(os.path.join(model_dir, "validation"))
    if not train and not val:
        raise ReportError(
            f"--model_dir: '{model_dir}': no event files in train/ or validation/; train "
            f"first (summaries are written every trainer.summary_interval steps); {checkpoint_feed.ELSEWHERE}"
        )
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), dpi=80)
    (ax_loss, ax_lr), (ax_speed, ax_ap) = axes

    def plot(ax, series, label, **kw):
        if series:
            steps, values = zip(*series)
            ax.plot(steps, values, label=label, marker="o" if len(steps) < 30 else None, markersize=3, **kw)
            return True
        return False

    drew = False
    for tag in LOSS_TAGS:
        drew |= plot(ax_loss, train.get(tag), f"train {tag}")
    drew |= plot(
        ax_loss, val.get("validation_loss") or val.get("total_loss"), "validation loss", linestyle="--"
    )
    ax_loss.set_title("loss")
    if drew:
        ax_loss.legend(fontsize=8)
        if all(v > 0 for line in ax_loss.get_lines() for v in line.get_ydata()):
            ax_loss.set_yscale("log")  # box loss is ~1/50 of the classification loss
    plot(ax_lr, train.get("learning_rate"), "learning rate")
    ax_lr.set_title("learning rate")
    plot(ax_speed, train.get("steps_per_second"), "steps/s")
    ax_speed.set_title("training speed (steps/s)")
    ax_speed.set_ylim(bottom=0)
    if plot(ax_ap, val.get("AP"), "AP (0.5:0.95)") | plot(ax_ap, val.get("AP50"), "AP50"):
        ax_ap.set_ylim(0, 1.03)
        ax_ap.legend(fontsize=8)
        last = val.get("AP")[-1] if val.get("AP") else None
        ax_ap.set_title("COCO AP" + (f" (step {last[0]}: AP {last[1]:.3f})" if last else ""))
    else:
        ax_ap.set_title("COCO AP")
        ax_ap.text(
            0.5,
            0.5,
            "no evaluation yet\n(od-dist eval, or an evaluator task)",
            ha="center",
            va="center",
            transform=ax_ap.transAxes,
            color="gray",
        )
    last_step = max([v[-1][0] for v in list(train.values()) + list(val.values())], default=0)
    for ax in axes.flat:
        if last_step:
            ax.set_xlim(0, last_step * 1.03)  # the same steps on every panel, even with one evaluation
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(title or f"od-dist run: {os.path.abspath(model_dir)}", fontsize=11)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    # A temporary file of its own (never a name the user may have), moved in when complete.
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".png", dir=folder)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png")
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"out": out, "train": sorted(train), "validation": sorted(val)}
