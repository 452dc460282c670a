"""Print a Markdown table, one row per JUnit report (named <backend>.xml): passed, failed, skipped."""

import pathlib
import sys
import xml.etree.ElementTree as ET


def main(paths: list[str]) -> None:
    print("| backend | passed | failed | skipped | seconds |")
    print("|---|---|---|---|---|")
    for path in sorted(paths):
        suites = ET.parse(path).getroot()
        suites = [suites] if suites.tag == "testsuite" else list(suites)
        total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        seconds = sum(float(s.get("time", 0)) for s in suites)
        failed = total["failures"] + total["errors"]
        passed = total["tests"] - failed - total["skipped"]
        print(f"| {pathlib.Path(path).stem} | {passed} | {failed} | {total['skipped']} | {seconds:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
