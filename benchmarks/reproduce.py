"""Whether the recorded headline figures reproduce: this run's results.json against an earlier one's.

A figure reproduces when this run's median lies within the earlier run's min-max over rounds
(a figure of one value: within 2% of it, as measured sizes are). Figures are matched by name, less
the run's own choice in it ("auto / best (ring)" and "auto / best (hierarchical)" are one figure). Writes the section
"Reproduction" of RESULTS.md (the figures themselves stay those of this run).

    cp benchmarks/results.json /tmp/first.json && python -m benchmarks   # a second full run
    python -m benchmarks.reproduce /tmp/first.json --label "first full run"
"""

from __future__ import annotations

import argparse
import json
import re

from benchmarks import _results

ONE_VALUE_TOLERANCE = 0.02


def reproduces(earlier: dict, now: dict) -> bool:
    """Whether figure `now` reproduces figure `earlier` (both `_results.figure` records).

    Example:

    >>> reproduces({"median": 1.0, "min": 0.9, "max": 1.2, "rounds": 5}, {"median": 1.1, "rounds": 5})
    True
    >>> reproduces({"median": 1.0, "min": 1.0, "max": 1.0, "rounds": 1}, {"median": 1.05, "rounds": 1})
    False
    """
    if earlier["rounds"] == 1:
        return abs(now["median"] - earlier["median"]) <= ONE_VALUE_TOLERANCE * abs(earlier["median"])
    return earlier["min"] <= now["median"] <= earlier["max"]


def _key(name: str) -> str:
    """A figure's name without the run's own choice in it ("auto / best (ring)" -> "auto / best")."""
    return re.sub(r"best \([^)]*\)", "best", name)


def rows(earlier: dict, now: dict) -> list[tuple[str, str, dict | None, dict, bool | None]]:
    """(section, figure, earlier record or None, this record, reproduces or None) for every figure of `now`."""
    out = []
    for section, entry in now.items():
        before = {_key(f["figure"]): f for f in earlier.get(section, {}).get("figures", [])}
        for f in entry.get("figures", []):
            old = before.get(_key(f["figure"]))
            out.append((section, f["figure"], old, f, None if old is None else reproduces(old, f)))
    return out


def _spread(f: dict) -> str:
    if f["rounds"] == 1:
        return f"{f['median']:.3g}"
    return f"{f['median']:.3g} ({f['min']:.3g}-{f['max']:.3g}, {f['rounds']})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("previous", help="results.json of the earlier run")
    parser.add_argument("--label", default="earlier run", help="what the earlier run was, for the section")
    parser.add_argument("--no_write", action="store_true", help="print only; leave RESULTS.md alone")
    args = parser.parse_args(argv)
    with open(args.previous) as f:
        earlier = json.load(f)
    now = _results.read_figures()
    table = rows(earlier, now)
    compared = [r for r in table if r[4] is not None]
    held = sum(r[4] for r in compared)
    dates = sorted({earlier[s]["date"] for s, *_ in compared if s in earlier})
    body = (
        f"This run's headline figures against the {args.label} ({', '.join(dates[:1] + dates[-1:])}), same "
        "commands and machine: a figure reproduces when this run's median lies within the earlier run's "
        f"min-max over rounds (one value: within {ONE_VALUE_TOLERANCE:.0%}).\n\n"
        f"**{held} of {len(compared)} figures reproduce.**\n\n"
        f"| section | figure | {args.label}: median (min-max, rounds) | this run | reproduces |\n"
        "|---|---|---|---|---|\n"
        + "".join(
            f"| {section} | {name} | {_spread(old) if old else 'not measured'} | {_spread(new)} | "
            f"{'' if ok is None else ('yes' if ok else '**no**')} |\n"
            for section, name, old, new, ok in table
        )
    )
    print(body)
    if not args.no_write:
        _results.write_section("Reproduction", _results.command("reproduce", argv), body)
    return held, len(compared)


if __name__ == "__main__":
    main()
