#!/usr/bin/env python3
"""Closing lines of a CI run (docs/testing.md, "Skips").

Counts the tests of the README's test command apart: passed, failed,
skipped for a reason (a test that called tern_test_skip::skip, listed in
the TERN_SKIP_LOG file with its reason), ignored (#[ignore], not run), and
says which optional paths the run exercised. A test that skipped returned
early and counts as passed for the test runner: it is taken out of the
passed count here, so a machine that can run nothing never shows a suite
that passed.

    summary.py --junit target/nextest/default/junit.xml --log LOG --skips SKIPLOG
"""

import argparse
import re
import sys
import xml.etree.ElementTree as ElementTree
from collections import defaultdict

# The optional paths CI reports, by the need a test names when it skips.
PATHS = {
    "kvm": "KVM (/dev/kvm)",
    "userfaultfd": "userfaultfd",
    "io-uring": "io_uring zero-copy send",
    "qpl": "QPL (libqpl)",
}


def nextest_counts(junit_path):
    """(passed, failed) from nextest's JUnit report."""
    root = ElementTree.parse(junit_path).getroot()
    passed = failed = 0
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        else:
            passed += 1
    return passed, failed


def log_counts(log_text):
    """(ignored by nextest, doc tests passed, failed, ignored) from the log."""
    ignored = 0
    for line in log_text.splitlines():
        if line.strip().startswith("Summary") and "tests run" in line:
            match = re.search(r"(\d+) skipped", line)
            ignored = int(match.group(1)) if match else 0
    doc_passed = doc_failed = doc_ignored = 0
    for match in re.finditer(
        r"^test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored", log_text, re.M
    ):
        doc_passed += int(match.group(1))
        doc_failed += int(match.group(2))
        doc_ignored += int(match.group(3))
    return ignored, doc_passed, doc_failed, doc_ignored


def read_skips(path):
    """{test: (need, reason)} from the skip log (one line per skip)."""
    skips = {}
    try:
        with open(path, encoding="utf-8") as log:
            for line in log:
                parts = line.rstrip("\n").split("\t", 2)
                if len(parts) == 3:
                    skips[parts[0]] = (parts[1], parts[2])
    except FileNotFoundError:
        pass
    return skips


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--junit", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--skips", required=True)
    args = parser.parse_args()
    try:
        passed, failed = nextest_counts(args.junit)
    except (FileNotFoundError, ElementTree.ParseError) as error:
        print(f"tests: no nextest report ({error})")
        return 1
    with open(args.log, encoding="utf-8", errors="replace") as log:
        ignored, doc_passed, doc_failed, doc_ignored = log_counts(log.read())
    skips = read_skips(args.skips)
    passed += doc_passed
    failed += doc_failed
    ignored += doc_ignored
    ran = passed - len(skips)
    print(
        f"tests: {ran} passed, {failed} failed, {len(skips)} skipped for a reason, "
        f"{ignored} ignored (#[ignore], not run)"
    )
    by_need = defaultdict(list)
    for test, (need, reason) in sorted(skips.items()):
        by_need[need].append((test, reason))
    if skips:
        print("skipped for a reason:")
        for need, tests in sorted(by_need.items()):
            print(f"  {need}: {len(tests)}")
            for test, reason in tests:
                print(f"    {test}: {reason}")
    paths = []
    for need, name in PATHS.items():
        missing = len(by_need.get(need, []))
        paths.append(
            f"{name} exercised" if missing == 0 else f"{name} NOT exercised ({missing} tests skipped)"
        )
    print("optional paths: " + "; ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
