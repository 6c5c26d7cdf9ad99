"""Sum hypothesis' passing and failing examples per property from pytest logs.

Answers: has every property of the gpu test profile drawn its examples, and did any fail? The
profile runs in pieces (`scripts/gpu_check.sh profile`, sharded by `NUMBA_DECONV_SHARDS`,
tests/conftest.py); each piece's log holds one `--hypothesis-show-statistics` block per shard.
This adds the blocks up per property (the shard dropped from the test id), over every log given:

    python benchmarks/count_examples.py out*/gpu_props.log out*/gpu_cheap.log

Needs no GPU. Exits with status 1 when any example failed.
"""
import argparse
import collections
import re
import sys

HEADER = re.compile(r"^(tests/\S+::\w+)\[(.*)\]:$|^(tests/\S+::\w+):$")
COUNTS = re.compile(r"- (\d+) passing, (\d+) failing, and (\d+) invalid")


def property_name(match):
    """The test id without its shard: 'file::test[params]'."""
    if match.group(3):
        return match.group(3)
    params = [p for p in match.group(2).split("-") if not re.fullmatch(r"shard\d+", p)]
    return match.group(1) + (f"[{'-'.join(params)}]" if params else "")


def tally(paths):
    totals = collections.defaultdict(lambda: [0, 0])
    for path in paths:
        current = None
        with open(path) as log:
            for line in log:
                header = HEADER.match(line.strip())
                if header:
                    current = property_name(header)
                    continue
                counts = COUNTS.search(line)
                if counts and current is not None:
                    totals[current][0] += int(counts.group(1))
                    totals[current][1] += int(counts.group(2))
    return totals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+")
    totals = tally(parser.parse_args().logs)
    width = max((len(name) for name in totals), default=8)
    print(f"{'property':<{width}}  passing  failing")
    for name in sorted(totals):
        passing, failing = totals[name]
        print(f"{name:<{width}}  {passing:>7}  {failing:>7}")
    return int(any(failing for _, failing in totals.values()))


if __name__ == "__main__":
    sys.exit(main())
