"""One test tier's time against its budget, its slowest cases and its costliest modules, read from the JUnit XML
pytest wrote for it (scripts/test_tiers.sh calls it after each tier has run).

A case's time is pytest's total for it (set-up, call and tear-down): a module- or session-scoped fixture's set-up is
counted on the first case that uses it, so a module's sum is what the module costs.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BUDGET_S = {"fast": 720, "full": 1500}
"""Each tier's budget in seconds of pytest on the development machine: 12 and 25 minutes."""


def minutes(seconds: float) -> str:
    return f"{int(seconds) // 60} min {int(seconds) % 60} s"


def module_of(classname: str) -> str:
    """``tests.unit.test_x.TestY`` -> ``tests/unit/test_x.py``: the module part of a JUnit class name."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        if parts[end - 1].startswith("test_"):
            return "/".join(parts[:end]) + ".py"
    return classname


def report(tier: str, xml: Path, wall: float, exit_code: int, budget: float, top: int = 15) -> list[str]:
    """The lines printed for one tier."""
    if not xml.is_file():
        return [f"{tier} tier: {minutes(wall)} of pytest (exit {exit_code}); no JUnit report at {xml}"]
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as exc:  # a run killed while writing it
        return [f"{tier} tier: {minutes(wall)} of pytest (exit {exit_code}); its JUnit report is unreadable ({exc})"]
    cases = [(float(case.get("time", 0.0)), f"{module_of(case.get('classname', ''))}::{case.get('name', '')}")
             for case in root.iter("testcase")]
    modules: dict[str, list[float]] = defaultdict(list)
    for seconds, name in cases:
        modules[name.split("::")[0]].append(seconds)
    lines = [f"{tier} tier: {minutes(wall)} of pytest (exit {exit_code}; {len(cases)} cases), "
             f"budget {minutes(budget)}"]
    lines.append(f"  its {min(top, len(cases))} slowest cases:")
    lines += [f"    {seconds:7.1f} s  {name}" for seconds, name in sorted(cases, reverse=True)[:top]]
    lines.append("  its costliest modules:")
    ranked = sorted(modules.items(), key=lambda item: -sum(item[1]))[:top]
    lines += [f"    {sum(times):7.1f} s  {name} ({len(times)} cases)" for name, times in ranked]
    if wall > budget:
        lines.append(f"WARNING: the {tier} tier took {minutes(wall)}, over its budget of {minutes(budget)}: "
                     "move or shrink its slowest cases (docs/tests.md)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("tier", choices=sorted(BUDGET_S))
    parser.add_argument("xml", type=Path)
    parser.add_argument("--wall", type=float, required=True, help="the tier's wall time in seconds")
    parser.add_argument("--exit", type=int, default=0, help="pytest's exit status")
    parser.add_argument("--budget", type=float, help="seconds (default: the tier's budget)")
    args = parser.parse_args(argv)
    budget = args.budget if args.budget is not None else BUDGET_S[args.tier]
    print("\n".join(report(args.tier, args.xml, args.wall, args.exit, budget)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
