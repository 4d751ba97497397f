"""How numbers read in what nightloom prints: counts with their noun in the right number, short durations that
do not round to 0.00 h, percentages and thousands separators (the CLI's tables and the planner's explanations)."""

from __future__ import annotations


def plural(n: int, noun: str, many: str | None = None) -> str:
    """'1 node', '2 nodes' (`many`: an irregular plural, e.g. plural(n, 'family', 'families'))."""
    return f"{n:,} {noun if n == 1 else (many or noun + 's')}"


def duration(hours: float) -> str:
    """A duration that stays readable at every scale: '< 1 min', '12 min', '1.50 h' (never '0.00')."""
    minutes = hours * 60.0
    if minutes < 1:
        return "< 1 min"
    if minutes < 90:
        return f"{minutes:.0f} min"
    return f"{hours:,.2f} h"


def percent(x: float | None, digits: int = 1) -> str:
    """0.553 → '55.3%' ('—' for None)."""
    return "—" if x is None else f"{x:.{digits}%}"


def thousands(x: float | None) -> str:
    """82135.0 → '82,135' ('—' for None)."""
    return "—" if x is None else f"{x:,.0f}"
