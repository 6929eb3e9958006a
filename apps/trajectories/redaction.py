"""Secrets out of trajectory data (docs/trajectories.md, "Redaction"): find credentials
in any JSON value or text and replace each with a typed placeholder
``<SECRET:kind:scope:n>``.

* ``kind`` names the format (``github_token``, ``private_key``, ``credential``…; a
  base64-wrapped secret is ``b64_<kind>``);
* ``scope`` is the episode's (8 hex characters derived from its id), so the same secret
  in two episodes gets two different placeholders;
* ``n`` counts the distinct secrets of that kind in the episode, so the same secret in
  one episode is always the same placeholder (the trajectory still reads correctly).

Plain Python (no Django): the caller supplies what is already known about the episode
(``known``: fingerprint → placeholder) and a ``fingerprint`` function, and stores what
:attr:`Redactor.found` lists.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PLACEHOLDER = re.compile(r"<SECRET:[a-z0-9_]+:[0-9a-f]{8}:\d+>")

# Values in a credential-looking context count as secrets from this length and
# Shannon entropy (bits per character) on: "hunter2" is not caught, a random token is.
MIN_CONTEXT_LEN = 8
MIN_ENTROPY = 3.0
# A JSON object key that names a credential: its string value is one.
CREDENTIAL_KEY = re.compile(
    r"(?i)^(?:.*[_\-.])?(?:pass(?:word|wd|phrase)?|pwd|secret|token|api[_-]?key|apikey|"
    r"access[_-]?key(?:[_-]?id)?|secret[_-]?(?:access[_-]?)?key|private[_-]?key|"
    r"auth(?:[_-]?token)?|authorization|credentials?|client[_-]?secret|session[_-]?id|"
    r"cookie)$"
)
_VALUE = r"(?P<v>[^\s\"'<>&,;)\]}]+)"


@dataclass(frozen=True)
class Detector:
    """``kind``: the placeholder's kind; ``pattern``: what matches (with a ``v`` group,
    only that group is replaced, so the context stays readable); ``priority``: the
    lowest wins a span another detector also matched; ``needles``: the pattern cannot
    match unless one of them is in the text (lower-cased when ``fold``), which keeps
    a scan of ordinary output to a few substring searches."""

    kind: str
    pattern: re.Pattern[str]
    priority: int
    needles: tuple[str, ...]
    fold: bool = False


DETECTORS: list[Detector] = [
    Detector(
        "private_key",
        re.compile(
            r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----[\s\S]*?"
            r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----"
        ),
        0,
        ("PRIVATE KEY",),
    ),
    Detector("hr_key", re.compile(r"(?<![A-Za-z0-9])hr_[A-Za-z0-9_\-]{20,}"), 1, ("hr_",)),
    Detector(
        "aws_access_key",
        re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA)[A-Z0-9]{16}(?![A-Z0-9])"),
        1,
        ("AKIA", "ASIA", "AGPA", "AIDA", "AROA", "ANPA"),
    ),
    Detector(
        "aws_secret_key",
        re.compile(
            r"(?i)aws[_\-.]?secret[_\-.]?(?:access[_\-.]?)?key[\"']?\s*[:=]\s*[\"']?"
            r"(?P<v>[A-Za-z0-9/+=]{40})(?![A-Za-z0-9/+=])"
        ),
        1,
        ("aws",),
        True,
    ),
    Detector("gcp_api_key", re.compile(r"(?<![A-Za-z0-9])AIza[0-9A-Za-z_\-]{35}"), 1, ("AIza",)),
    Detector(
        "gcp_oauth_token", re.compile(r"(?<![A-Za-z0-9])ya29\.[0-9A-Za-z_\-]{20,}"), 1, ("ya29.",)
    ),
    Detector(
        "github_token",
        re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
        1,
        ("ghp_", "gho_", "ghu_", "ghs_", "ghr_", "github_pat_"),
    ),
    Detector(
        "gitlab_token",
        re.compile(r"(?<![A-Za-z0-9])gl(?:pat|dt|rt|cbt|ptt|ft)-[A-Za-z0-9_\-]{20,}"),
        1,
        ("glpat-", "gldt-", "glrt-", "glcbt-", "glptt-", "glft-"),
    ),
    Detector(
        "slack_token", re.compile(r"(?<![A-Za-z0-9])xox[abposr]-[A-Za-z0-9\-]{10,}"), 1, ("xox",)
    ),
    Detector(
        "slack_webhook",
        re.compile(r"https://hooks\.slack\.com/services/[A-Za-z0-9_/]{20,}"),
        1,
        ("hooks.slack.com",),
    ),
    Detector(
        "openai_key",
        re.compile(
            r"(?<![A-Za-z0-9])sk-(?:proj-|svcacct-|admin-|ant-[a-z0-9]+-)?[A-Za-z0-9_\-]{20,}"
        ),
        1,
        ("sk-",),
    ),
    Detector(
        "jwt",
        re.compile(
            r"(?<![A-Za-z0-9_\-])eyJ[A-Za-z0-9_\-]{8,}\.eyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"
        ),
        2,
        ("eyJ",),
    ),
    Detector(
        "bearer",
        re.compile(r"(?i)\bbearer\s+(?P<v>[A-Za-z0-9_\-.~+/]{16,}=*)"),
        3,
        ("bearer",),
        True,
    ),
    Detector(
        "basic_auth",
        re.compile(r"(?i)\bbasic\s+(?P<v>[A-Za-z0-9+/]{8,}={0,2})(?![A-Za-z0-9+/=])"),
        3,
        ("basic",),
        True,
    ),
    Detector(
        "url_password",
        re.compile(r"[a-z][a-z0-9+.\-]*://[^\s:/@\"'<>]+:(?P<v>[^\s@/\"'<>]+)@"),
        3,
        ("://",),
    ),
    Detector(
        "url_param",
        re.compile(
            r"[?&](?:access_token|token|api_key|apikey|key|secret|password|passwd|auth|sig|"
            r"signature|client_secret|code|session|x-amz-signature|x-amz-credential)="
            r"(?P<v>[^&\s#\"'<>]{6,})",
            re.IGNORECASE,
        ),
        4,
        ("=",),
    ),
]
# An AWS secret key has no prefix: a 40-character run of its alphabet with upper and
# lower case and digits, high entropy, in a text that mentions AWS at all.
_AWS_BARE = re.compile(r"(?<![A-Za-z0-9/+=])[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])")
_BASE64_RUN = re.compile(r"(?<![A-Za-z0-9+/=_\-])[A-Za-z0-9+/_\-]{20,}={0,2}(?![A-Za-z0-9+/=_\-])")
_NEEDS_ENTROPY = {"credential", "url_param", "bearer"}


def entropy(value: str) -> float:
    """Shannon entropy in bits per character."""
    if not value:
        return 0.0
    counts = Counter(value)
    n = len(value)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


def looks_secret(value: str) -> bool:
    return (
        len(value) >= MIN_CONTEXT_LEN
        and entropy(value) >= MIN_ENTROPY
        and not PLACEHOLDER.search(value)
    )


@dataclass
class Finding:
    kind: str
    placeholder: str
    path: str
    secret: str  # plaintext: only ever handed to the encrypting store


@dataclass
class Span:
    start: int
    end: int
    kind: str


def _decode_base64(run: str) -> str | None:
    padded = run + "=" * (-len(run) % 4)
    try:
        raw = (
            base64.urlsafe_b64decode(padded)
            if ("-" in run or "_" in run)
            else base64.b64decode(padded, validate=True)
        )
        text = raw.decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in text)
    return text if text and printable / len(text) > 0.95 else None


def _long_tokens(text: str) -> list[tuple[int, str]]:
    """Whitespace-separated tokens of 20 characters or more, with their offsets: the
    only places a bare AWS secret or a base64 run can be (str.split is far cheaper than
    a regex over every position)."""
    out: list[tuple[int, str]] = []
    at = 0
    for token in text.split():
        at = text.find(token, at)
        if len(token) >= 20:
            out.append((at, token))
        at += len(token)
    return out


_CONTEXT_ENDINGS = (
    "password",
    "passwd",
    "passphrase",
    "pass",
    "pwd",
    "secret",
    "token",
    "api_key",
    "api-key",
    "apikey",
    "access_key",
    "access-key",
    "auth_token",
    "auth-token",
    "client_secret",
    "client-secret",
    "private_key",
    "private-key",
    "credential",
    "credentials",
    "session_id",
    "session-id",
)
_CONTEXT_VALUE = re.compile(r"\s*[\"']?" + _VALUE)


def _credentials(text: str, folded: str) -> list[tuple[int, int, int, str]]:
    """``password=…``, ``token: …``, ``"api_key": "…"``: a high-entropy value after a
    separator that follows a credential word (found from the separators, which ordinary
    text has few of, instead of a regex tried at every position)."""
    out: list[tuple[int, int, int, str]] = []
    for sep in ":=":
        at = folded.find(sep)
        while at != -1:
            before = folded[max(0, at - 24) : at].rstrip(" \t\"'")
            for word in _CONTEXT_ENDINGS:
                if before.endswith(word):
                    head = len(before) - len(word) - 1
                    if head < 0 or not before[head].isalnum():
                        match = _CONTEXT_VALUE.match(text, at + 1)
                        if match is not None and looks_secret(match.group("v")):
                            out.append((5, match.start("v"), match.end("v"), "credential"))
                    break
            at = folded.find(sep, at + 1)
    return out


def find_spans(text: str) -> list[Span]:
    """The secrets in ``text``: non-overlapping spans, each with its kind."""
    if len(text) < 8:
        return []
    candidates: list[tuple[int, int, int, str]] = []
    folded = text.lower()
    for detector in DETECTORS:
        haystack = folded if detector.fold else text
        if not any(needle in haystack for needle in detector.needles):
            continue
        kind, pattern, priority = detector.kind, detector.pattern, detector.priority
        for match in pattern.finditer(text):
            if "v" in pattern.groupindex:
                start, end = match.span("v")
                value = match.group("v")
                if kind in _NEEDS_ENTROPY and not looks_secret(value):
                    continue
            else:
                start, end = match.span()
            candidates.append((priority, start, end, kind))
    candidates.extend(_credentials(text, folded))
    aws = "aws" in folded or "amazon" in folded or "s3://" in folded or "AKIA" in text
    for offset, token in _long_tokens(text):
        if aws:
            for match in _AWS_BARE.finditer(token):
                run = match.group()
                if (
                    any(c.isupper() for c in run)
                    and any(c.islower() for c in run)
                    and any(c.isdigit() for c in run)
                    and entropy(run) >= 4.0
                ):
                    candidates.append(
                        (1, offset + match.start(), offset + match.end(), "aws_secret_key")
                    )
        for match in _BASE64_RUN.finditer(token):
            decoded = _decode_base64(match.group())
            if decoded is None:
                continue
            inner = find_spans(decoded)
            if inner:
                candidates.append(
                    (6, offset + match.start(), offset + match.end(), f"b64_{inner[0].kind}")
                )
    # text already redacted is never redacted again (nor anything inside it)
    chosen: list[Span] = [Span(m.start(), m.end(), "") for m in PLACEHOLDER.finditer(text)]
    for _, start, end, kind in sorted(candidates, key=lambda c: (c[0], c[1], -c[2])):
        if start == end or any(start < s.end and s.start < end for s in chosen):
            continue
        chosen.append(Span(start, end, kind))
    return sorted((s for s in chosen if s.kind), key=lambda s: s.start)


@dataclass
class Redactor:
    """Replaces secrets for one episode. ``known`` maps fingerprints of secrets already
    stored for the episode to their placeholders; ``counters`` the highest ``n`` per
    kind. New secrets are appended to :attr:`found`; every replacement is counted in
    :attr:`hits` by kind."""

    scope: str
    fingerprint: Callable[[str], str]
    known: dict[str, str] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)
    found: list[Finding] = field(default_factory=list)
    hits: Counter[str] = field(default_factory=Counter)
    paths: dict[str, set[str]] = field(default_factory=dict)
    uses: Counter[str] = field(default_factory=Counter)  # replacements per placeholder

    def _placeholder(self, kind: str, secret: str, path: str) -> str:
        digest = self.fingerprint(secret)
        self.hits[kind] += 1
        self.paths.setdefault(kind, set()).add(path)
        existing = self.known.get(digest)
        if existing is not None:
            self.uses[existing] += 1
            return existing
        n = self.counters.get(kind, 0) + 1
        self.counters[kind] = n
        placeholder = f"<SECRET:{kind}:{self.scope}:{n}>"
        self.known[digest] = placeholder
        self.uses[placeholder] += 1
        self.found.append(Finding(kind, placeholder, path, secret))
        return placeholder

    def text(self, value: str, path: str = "") -> str:
        spans = find_spans(value)
        if not spans:
            return value
        out: list[str] = []
        at = 0
        for span in spans:
            out.append(value[at : span.start])
            out.append(self._placeholder(span.kind, value[span.start : span.end], path))
            at = span.end
        out.append(value[at:])
        return "".join(out)

    def value(self, data: Any, path: str = "") -> Any:
        """A copy of a JSON value with every secret replaced: strings scanned, object
        keys scanned, a value under a credential-looking key replaced whole, and
        base64 output records (``{"encoding": "base64", "head", "tail"}``) scanned as
        the bytes they hold."""
        if isinstance(data, str):
            return self.text(data, path)
        if isinstance(data, list):
            return [self.value(item, f"{path}[{i}]") for i, item in enumerate(data)]
        if not isinstance(data, dict):
            return data
        if data.get("encoding") == "base64":
            return self._base64_record(data, path)
        out: dict[str, Any] = {}
        for key, item in data.items():
            new_key = self.text(key, f"{path}.<key>") if isinstance(key, str) else key
            where = f"{path}.{new_key}" if path else str(new_key)
            if (
                isinstance(key, str)
                and isinstance(item, str)
                and CREDENTIAL_KEY.match(key)
                and len(item) >= 6
                and not PLACEHOLDER.fullmatch(item)
                and entropy(item) >= 2.0
            ):
                redacted = self.text(item, where)
                out[new_key] = (
                    redacted if redacted != item else self._placeholder("credential", item, where)
                )
            else:
                out[new_key] = self.value(item, where)
        return out

    def _base64_record(self, record: dict[str, Any], path: str) -> dict[str, Any]:
        out = dict(record)
        for part in ("head", "tail"):
            encoded = record.get(part)
            if not isinstance(encoded, str) or not encoded:
                continue
            try:
                raw = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                out[part] = self.text(encoded, f"{path}.{part}")
                continue
            text = raw.decode("latin-1")  # every byte is one character: exact round trip
            redacted = self.text(text, f"{path}.{part}")
            if redacted != text:
                out[part] = base64.b64encode(redacted.encode("latin-1")).decode()
        return out
