"""Write tests/durations.json from a pytest run's ``--durations=0`` report: each test file's measured seconds
(setup + call + teardown of its tests), which tests/conftest.py reads to start the longest xdist groups first.

    bash tools/run_tests.sh --durations=0 2>&1 | tee /tmp/tests.log
    python tools/test_durations.py /tmp/tests.log --note "2 cores, 2 xdist workers, 2026-12-06"
"""

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"^(\d+(?:\.\d+)?)s (setup|call|teardown)\s+(\S+?\.py)(?:::|\s|$)")


def file_seconds(lines) -> dict:
    """{test file: seconds} summed over a ``--durations`` report's lines (other lines are ignored)."""
    seconds = {}
    for line in lines:
        m = LINE.match(line.strip())
        if m:
            seconds[m.group(3)] = seconds.get(m.group(3), 0.0) + float(m.group(1))
    return seconds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="pytest output of a run with --durations=0")
    ap.add_argument("--note", required=True, help="where and how it was measured (cores, workers, date)")
    ap.add_argument("--out", default=os.path.join(ROOT, "tests", "durations.json"))
    args = ap.parse_args(argv)
    with open(args.log) as f:
        seconds = file_seconds(f)
    if not seconds:
        print(f"no --durations lines in {args.log} (run pytest with --durations=0)", file=sys.stderr)
        return 1
    ordered = {k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}
    with open(args.out, "w") as f:
        json.dump({"measured": args.note, "seconds": ordered}, f, indent=1)
        f.write("\n")
    print(f"{args.out}: {len(ordered)} files, {sum(ordered.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
