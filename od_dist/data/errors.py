"""The errors of the data tools and of the writes into a user's folder: each message one line, exit 2."""

from __future__ import annotations


class BadAnnotation(ValueError):
    """One annotation problem; the message is one line naming the file and the fix."""


class ProblemsReported(BadAnnotation):
    """Problems were already printed one per line (``report_problems``); nothing was written."""


class DatasetError(ValueError):
    """The dataset as a whole cannot be converted (no images, a bad flag); one line, exit 2."""
