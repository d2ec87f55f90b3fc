"""The capture report as text: one block per module, one line per captured signature."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

NOT_CAPTURED = "not captured yet"
ENDED_BEFORE_CAPTURE = "not captured: fit ended before capture"


def ended_status(status: str, stopped_by: Optional[BaseException]) -> str:
    """A status at the end of a fit: one that was still waiting for capture says why it never came."""
    if status != NOT_CAPTURED:
        return status
    if stopped_by is None:
        return ENDED_BEFORE_CAPTURE
    lines = str(stopped_by).strip().splitlines()  # (a KeyboardInterrupt has none)
    return (f"not captured: the fit stopped before capture ({type(stopped_by).__name__}"
            f"{f': {lines[0]:.200}' if lines else ''})")


def _bytes(n: Optional[int]) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def format_report(rows: List[Dict[str, Any]], mode: str, backend: str) -> str:
    """Render :meth:`NPUGraphCallback.report` rows."""
    lines = [f"npugraph_train capture report (mode={mode}, backend={backend})"]
    if not rows:
        lines.append("  no modules graphed")
    for row in rows:
        eager = sum(row["eager_calls"].values())
        counts = f"replays {row['replays']}, eager calls {eager}"
        status = row["status"]
        if len(status) <= 40:
            lines.append(f"  {row['module']}: {status}; {counts}")
        else:  # a capture error: on a line of its own
            lines += [f"  {row['module']}: {counts}", f"    status: {status}"]
        for sig in row["signatures"]:
            times = f" ({sig['captures']} captures)" if sig.get("captures", 1) > 1 else ""
            lines.append(f"    signature {sig['description']}: replays {sig['replays']}, "
                         f"capture {sig['capture_seconds'] * 1e3:.1f} ms{times}, pool {_bytes(sig['pool_bytes'])}")
        for reason, count in row["eager_calls"].items():
            lines.append(f"    eager x{count}: {reason}")
    if any("*" in sig["description"] for row in rows for sig in row["signatures"]):
        lines.append("  (* after a shape: that input requires grad)")
    return "\n".join(lines)
