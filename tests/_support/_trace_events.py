"""A small validator of Chrome's trace event format (the JSON that ui.perfetto.dev and chrome://tracing load).

Checks what those viewers need of the events tfdist writes: the top level (`traceEvents`, a valid
`displayTimeUnit`), each event's phase and fields (`ph`, `name`, numeric `ts` and `dur` >= 0, integer
`pid` and `tid`), `B`/`E` pairs that match per lane (same name, in order), `X` slices that nest within
each lane (Perfetto rejects partial overlaps on one track), and metadata events naming every process
and thread that has events. `validate` returns the problems found; an empty list means valid.
"""

import collections
import numbers

PHASES = {"X", "B", "E", "i", "I", "M", "C"}
METADATA = {"process_name", "process_sort_index", "thread_name", "thread_sort_index", "process_labels"}
# Slices whose ends are within this many microseconds (1 ns) of each other count as nested.
TOLERANCE_US = 1e-3


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_time(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0


def validate(trace) -> list[str]:
    """The problems of `trace` (a parsed JSON object) as a Chrome trace; empty when it is valid."""
    problems = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["the top level is not an object with a traceEvents list"]
    if trace.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        problems.append(f"displayTimeUnit {trace['displayTimeUnit']!r} is not 'ms' or 'ns'")
    named_processes, named_threads = set(), set()
    used_processes, used_threads = set(), set()
    slices = collections.defaultdict(list)
    open_begins = collections.defaultdict(list)
    for i, event in enumerate(trace["traceEvents"]):
        where = f"event {i} ({event.get('name')!r})" if isinstance(event, dict) else f"event {i}"
        if not isinstance(event, dict):
            problems.append(f"{where} is not an object")
            continue
        ph = event.get("ph")
        if ph not in PHASES:
            problems.append(f"{where}: ph {ph!r} is not one of {sorted(PHASES)}")
            continue
        if not isinstance(event.get("name"), str):
            problems.append(f"{where}: no name")
        if not _is_int(event.get("pid")):
            problems.append(f"{where}: pid {event.get('pid')!r} is not an integer")
            continue
        if ph == "M":
            if event.get("name") not in METADATA or not isinstance(event.get("args"), dict):
                problems.append(f"{where}: not a known metadata event with args")
            elif event["name"] == "process_name":
                named_processes.add(event["pid"])
            elif event["name"] == "thread_name":
                named_threads.add((event["pid"], event.get("tid")))
            continue
        if not _is_int(event.get("tid")):
            problems.append(f"{where}: tid {event.get('tid')!r} is not an integer")
            continue
        if not _is_time(event.get("ts")):
            problems.append(f"{where}: ts {event.get('ts')!r} is not a time >= 0")
            continue
        lane = (event["pid"], event["tid"])
        used_processes.add(event["pid"])
        used_threads.add(lane)
        if ph == "X":
            if not _is_time(event.get("dur")):
                problems.append(f"{where}: dur {event.get('dur')!r} is not a duration >= 0")
                continue
            slices[lane].append((event["ts"], event["ts"] + event["dur"], event["name"]))
        elif ph == "B":
            open_begins[lane].append((event["ts"], event["name"]))
        elif ph == "E":
            if not open_begins[lane]:
                problems.append(f"{where}: an E event on lane {lane} without a B before it")
            else:
                begin, name = open_begins[lane].pop()
                if event["ts"] < begin or event.get("name", name) != name:
                    problems.append(f"{where}: E does not match B {name!r} at {begin} on lane {lane}")
    for lane, begins in open_begins.items():
        for begin, name in begins:
            problems.append(f"B event {name!r} at {begin} on lane {lane} has no E")
    for lane, spans in slices.items():
        stack = []
        for start, end, name in sorted(spans, key=lambda s: (s[0], -s[1])):
            while stack and stack[-1][1] <= start + TOLERANCE_US:
                stack.pop()
            if stack and end > stack[-1][1] + TOLERANCE_US:
                problems.append(f"slice {name!r} [{start}, {end}] partly overlaps {stack[-1][2]!r} "
                                f"[{stack[-1][0]}, {stack[-1][1]}] on lane {lane}")
                continue
            stack.append((start, end, name))
    problems += [f"process {pid} has events but no process_name" for pid in sorted(used_processes - named_processes)]
    problems += [f"lane {lane} has events but no thread_name" for lane in sorted(used_threads - named_threads)]
    return problems
