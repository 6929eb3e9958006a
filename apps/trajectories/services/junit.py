"""A verifier's structured report (JUnit XML, as ``pytest --junitxml``, ``go-junit-report``,
``jest-junit`` write it, or a JSON result file: see ``parse_json``) as a per-test result
vector: ``{test_id: passed|failed|error|skipped}`` — the seeds' ``v_t``,
kept on the verifier step for later analysis.

The report comes from the sandbox (the policy's side), so it is parsed defensively: a
size bound, no DOCTYPE (no entities to expand), and a malformed report is "no valid
report", never a verdict."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET  # DOCTYPE refused below, size bounded
from dataclasses import dataclass, field

MAX_REPORT_BYTES = 4 * 1024 * 1024
STATUSES = ("passed", "failed", "error", "skipped")


class ReportInvalid(ValueError):
    pass


@dataclass
class Report:
    results: dict[str, str] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for status in self.results.values():
            counts[status] += 1
        return counts

    @property
    def executed(self) -> int:
        return len(self.results) - self.summary["skipped"]


def _status(case: ET.Element) -> str:
    tags = {child.tag for child in case}
    if "error" in tags:
        return "error"
    if "failure" in tags:
        return "failed"
    if "skipped" in tags:
        return "skipped"
    return "passed"


def parse_junit(text: str) -> Report:
    """Every ``<testcase>`` under the root, keyed ``classname::name`` (a repeated id
    gets ``#2``, ``#3``…). Raises ReportInvalid for a report that is not JUnit XML."""
    if len(text.encode("utf-8", "replace")) > MAX_REPORT_BYTES:
        raise ReportInvalid(f"report larger than {MAX_REPORT_BYTES} bytes")
    if "<!DOCTYPE" in text.upper() or "<!ENTITY" in text.upper():
        raise ReportInvalid("report has a DOCTYPE/ENTITY declaration")
    try:
        root = ET.fromstring(text)  # noqa: S314 - no DTD allowed (checked above)
    except ET.ParseError as exc:
        raise ReportInvalid(f"report is not XML: {exc}") from None
    if root.tag not in ("testsuites", "testsuite"):
        raise ReportInvalid(f"report root is <{root.tag}>, not <testsuites>/<testsuite>")
    report = Report()
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        test_id = f"{classname}::{name}" if classname else name or "?"
        key, n = test_id, 1
        while key in report.results:
            n += 1
            key = f"{test_id}#{n}"
        report.results[key] = _status(case)
    return report


# pytest-json-report's outcomes beyond the four: an expected failure is not a verdict
JSON_OUTCOMES = {**{s: s for s in STATUSES}, "xfailed": "skipped", "xpassed": "passed"}


def parse_json(text: str) -> Report:
    """A JSON result file: ``{"tests": [{"nodeid" or "id": …, "outcome": …}, …]}``
    (pytest-json-report's shape) or the vector itself, ``{"results": {test_id:
    outcome}}``; outcomes ``passed|failed|error|skipped`` (and ``xfailed`` → skipped,
    ``xpassed`` → passed). Raises ReportInvalid for anything else."""
    if len(text.encode("utf-8", "replace")) > MAX_REPORT_BYTES:
        raise ReportInvalid(f"report larger than {MAX_REPORT_BYTES} bytes")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ReportInvalid(f"report is not JSON: {exc}") from None
    pairs: list[tuple[object, object]]
    if isinstance(data, dict) and isinstance(data.get("tests"), list):
        pairs = [
            (t.get("nodeid", t.get("id")), t.get("outcome"))
            if isinstance(t, dict)
            else (None, None)
            for t in data["tests"]
        ]
    elif isinstance(data, dict) and isinstance(data.get("results"), dict):
        pairs = list(data["results"].items())
    else:
        raise ReportInvalid('JSON report has neither "tests" (a list) nor "results" (an object)')
    report = Report()
    for test_id, outcome in pairs:
        if not isinstance(test_id, str) or not test_id or outcome not in JSON_OUTCOMES:
            raise ReportInvalid(
                f"JSON report test {test_id!r}: outcome {outcome!r} is not one of "
                f"{', '.join(JSON_OUTCOMES)}"
            )
        key, n = test_id, 1
        while key in report.results:
            n += 1
            key = f"{test_id}#{n}"
        report.results[key] = JSON_OUTCOMES[str(outcome)]
    return report


def parse_report(text: str) -> tuple[str, Report]:
    """The report's format (``json`` when it starts with ``{``, else ``junit-xml``) and
    its parse."""
    if text.lstrip().startswith("{"):
        return "json", parse_json(text)
    return "junit-xml", parse_junit(text)
