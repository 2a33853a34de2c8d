"""One line of `od-dist doctor`: its status and what it says (host/doctor.py, host/doctor_here.py)."""

from __future__ import annotations

from dataclasses import dataclass

OK, WARN, FIX = "ok", "warn", "FIX"


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN or FIX
    what: str
    detail: str

    def __str__(self) -> str:
        return f"{self.status:<5} {self.what}: {self.detail}"
