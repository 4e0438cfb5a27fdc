"""The slowest tests of a pytest run and the time per test file, from its JUnit XML (``--junitxml``).

``scripts/test --all`` prints this for the NeMo environment's run at the very end, after the Bridge tier, so the tail
of a CI log (all that may be kept of it) says where the time went::

    python -m tools.slowest_tests RESULTS.xml [--top 25]
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("xml", help="pytest's --junitxml file")
    parser.add_argument("--top", type=int, default=25, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    try:
        cases = ET.parse(args.xml).getroot().iter("testcase")
    except (OSError, ET.ParseError) as e:
        print(f"slowest tests: cannot read {args.xml}: {e}", file=sys.stderr)
        return 1
    times = [(float(c.get("time", 0)), c.get("classname", ""), c.get("name", "")) for c in cases]
    per_file: dict[str, float] = defaultdict(float)
    for t, module, _ in times:  # pytest's classname: the test's module, dotted (and its class, if any)
        per_file[module] += t
    print(f"slowest tests ({len(times)} tests, {sum(t for t, _, _ in times) / 60:.1f} min in all):")
    for t, module, name in sorted(times, reverse=True)[:args.top]:
        print(f"  {t:7.1f}s  {module}::{name}")
    print("time per test module:")
    for name, t in sorted(per_file.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {t:7.1f}s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
