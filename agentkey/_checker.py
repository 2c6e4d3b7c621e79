"""``agentkey check``: does a tool server honour the idempotency contract?

WARNING: the checker sends real requests. A correct server runs the tool four
times (a fresh call, a concurrent burst, changed arguments and the header-style
round trip); a broken one may run it more often. Point it at a test instance
or a tool whose side effect is harmless.

It is a client only (httpx), so it lives in the core package.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ._canonical import canonical_json, to_jsonable
from ._exceptions import ConfigurationError, InsecureTransport
from ._keys import HeaderStyle, StepKey
from ._protocol import is_loopback
from ._retry_after import parse_retry_after

__all__ = ["CheckReport", "CheckResult", "Verdict", "acheck_server", "check_server"]

Verdict = Literal["PASS", "FAIL", "SKIP"]

_TOKEN = re.compile(r"[\x21-\x7e]+")

_REPLAY_HEADERS = (
    "idempotent-replayed",
    "idempotent-replay",
    "x-idempotent-replayed",
    "x-idempotency-replayed",
)


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One point of the contract: its verdict and what was seen."""

    name: str
    verdict: Verdict
    detail: str


@dataclass(frozen=True, slots=True)
class CheckReport:
    """Every point checked against one target; :attr:`ok` when none failed."""

    target: str
    style: HeaderStyle
    results: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.verdict != "FAIL" for r in self.results)

    def table(self) -> str:
        """A plain-text pass/fail table."""
        width = max(len(r.name) for r in self.results)
        lines = [f"agentkey check {self.target}  (key header style: {self.style})", ""]
        lines.append(f"  {'result':<6}  {'check':<{width}}  detail")
        lines.append(f"  {'-' * 6}  {'-' * width}  {'-' * 40}")
        lines += [f"  {r.verdict:<6}  {r.name:<{width}}  {r.detail}" for r in self.results]
        counts = {v: sum(r.verdict == v for r in self.results) for v in ("PASS", "FAIL", "SKIP")}
        lines.append("")
        lines.append(
            f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
            + ("" if self.ok else "  -> the server does NOT honour the contract")
        )
        return "\n".join(lines)


@dataclass
class _Sent:
    status: int
    body: bytes
    replayed: bool
    retry_after: str | None
    seconds: float


class _Target:
    def __init__(self, client: httpx.AsyncClient, url: str, token: str | None) -> None:
        self.client = client
        self.url = url
        self.token = token

    async def post(self, body: bytes, key: str | None) -> _Sent:
        headers = {"content-type": "application/json"}
        if key is not None:
            headers["idempotency-key"] = key
        if self.token is not None:
            headers["authorization"] = f"Bearer {self.token}"
        started = time.monotonic()
        response = await self.client.post(self.url, content=body, headers=headers)
        replayed = any(
            response.headers.get(h, "").strip().lower() == "true" for h in _REPLAY_HEADERS
        )
        return _Sent(
            response.status_code,
            response.content,
            replayed,
            response.headers.get("retry-after"),
            time.monotonic() - started,
        )


def _other(style: HeaderStyle) -> HeaderStyle:
    return "sf-string" if style == "raw" else "raw"


async def _fresh_and_duplicate(
    target: _Target, plan: str, body: bytes, args: Mapping[str, Any], style: HeaderStyle
) -> list[CheckResult]:
    key = StepKey.build(plan, 0, args).header_value(style)
    first = await target.post(body, key)
    results = []
    if 200 <= first.status < 300 and not first.replayed:
        results.append(CheckResult("fresh request runs", "PASS", f"{first.status}"))
    else:
        results.append(
            CheckResult(
                "fresh request runs",
                "FAIL",
                f"{first.status}{' with a replay header' if first.replayed else ''}; "
                "expected a 2xx: check --path, --args and --token",
            )
        )
        return [*results, CheckResult("duplicate is replayed", "SKIP", "no fresh result")]
    again = await target.post(body, key)
    problems = []
    if again.status != first.status:
        problems.append(f"status {again.status} != {first.status}")
    if again.body != first.body:
        problems.append("body differs from the first answer")
    if not again.replayed:
        problems.append("no Idempotent-Replayed: true header")
    if problems:
        results.append(CheckResult("duplicate is replayed", "FAIL", "; ".join(problems)))
    else:
        results.append(
            CheckResult(
                "duplicate is replayed", "PASS", f"{again.status}, same body, replay header"
            )
        )
    return results


async def _concurrent(
    target: _Target, plan: str, body: bytes, args: Mapping[str, Any], style: HeaderStyle, n: int
) -> CheckResult:
    name = "concurrent duplicate gets 409"
    key = StepKey.build(plan, 1, args).header_value(style)
    sent = await asyncio.gather(*(target.post(body, key) for _ in range(n)))
    ran = [s for s in sent if 200 <= s.status < 300 and not s.replayed]
    conflicts = [s for s in sent if s.status == 409]
    replays = [s for s in sent if 200 <= s.status < 300 and s.replayed]
    others = sorted({s.status for s in sent if s not in ran + conflicts + replays})
    problems = []
    if not ran and not replays:
        problems.append(
            f"none of the {n} answers was a 2xx: the step never ran (a key stuck in "
            "progress answers 409 forever)"
        )
    if len(ran) > 1:
        problems.append(
            f"{len(ran)} of {n} answers were 2xx without a replay header (the step ran "
            f"{len(ran)} times, or replays are not marked)"
        )
    if any(parse_retry_after(s.retry_after) is None for s in conflicts):
        problems.append("a 409 came without a valid Retry-After")
    if others:
        problems.append(f"unexpected statuses {others}")
    if ran and any(r.body != ran[0].body for r in replays):
        problems.append("a replay's body differs from the executed answer")
    if problems:
        return CheckResult(name, "FAIL", "; ".join(problems))
    if not conflicts:
        return CheckResult(
            name,
            "SKIP",
            f"all {n - 1} duplicates were replays: the tool finished before they arrived; "
            "check a slower tool to prove this point",
        )
    return CheckResult(
        name,
        "PASS",
        f"{n} at once: {len(ran)} ran, {len(conflicts)} got 409 + Retry-After, "
        f"{len(replays)} replayed",
    )


async def _changed_args(
    target: _Target, plan: str, args: Mapping[str, Any], changed: Mapping[str, Any]
) -> list[CheckResult]:
    key = StepKey.build(plan, 0, changed).header_value("raw")
    sent = await target.post(canonical_json(changed), key)
    results = []
    if 200 <= sent.status < 300 and not sent.replayed:
        results.append(CheckResult("changed args are a new operation", "PASS", f"{sent.status}"))
    else:
        why = "replayed the old answer" if sent.replayed else f"answered {sent.status}"
        results.append(
            CheckResult(
                "changed args are a new operation",
                "FAIL",
                f"same step, new args_hash: the server {why}; if the tool rejects the changed "
                "arguments, pass --changed-args with a variant it accepts",
            )
        )
    # The key claims `args`, the body carries `changed`.
    mismatched = StepKey.build(plan, 3, args).header_value("raw")
    bad = await target.post(canonical_json(changed), mismatched)
    results.append(
        CheckResult(
            "mismatched hash gets 422",
            "PASS" if bad.status == 422 else "FAIL",
            f"{bad.status}" + ("" if bad.status == 422 else "; expected 422"),
        )
    )
    return results


async def _malformed(target: _Target, body: bytes) -> list[CheckResult]:
    results = []
    for name, key in (
        ("malformed key gets 400", "not-a-valid:key"),
        ("missing key gets 400", None),
    ):
        sent = await target.post(body, key)
        results.append(
            CheckResult(
                name,
                "PASS" if sent.status == 400 else "FAIL",
                f"{sent.status}" + ("" if sent.status == 400 else "; expected 400"),
            )
        )
    return results


async def _styles(
    target: _Target, plan: str, body: bytes, args: Mapping[str, Any], style: HeaderStyle
) -> CheckResult:
    name = "both header styles accepted"
    key = StepKey.build(plan, 2, args)
    other = _other(style)
    first = await target.post(body, key.header_value(other))
    if not (200 <= first.status < 300):
        return CheckResult(name, "FAIL", f"{other} style answered {first.status}; expected 2xx")
    second = await target.post(body, key.header_value(style))
    if second.replayed and second.body == first.body:
        return CheckResult(name, "PASS", f"{other} ran, {style} replayed it: one key")
    return CheckResult(
        name,
        "FAIL",
        f"{other} then {style} with the same key: the second answer ({second.status}) was "
        "not a replay, so the styles are not treated as one key",
    )


async def acheck_server(
    base_url: str,
    *,
    path: str,
    args: Mapping[str, Any],
    changed_args: Mapping[str, Any] | None = None,
    token: str | None = None,
    style: HeaderStyle = "raw",
    concurrency: int = 8,
    timeout: float = 30.0,
) -> CheckReport:
    """Check every point of the contract against ``base_url + path``. Real side effects!"""
    try:
        url = httpx.URL(base_url.rstrip("/") + "/" + path.lstrip("/"))
    except (httpx.InvalidURL, TypeError, AttributeError):
        raise ConfigurationError(
            f"the target must be an http(s) URL and path, got {base_url!r} and {path!r}"
        ) from None
    if token is not None and not _TOKEN.fullmatch(token):
        # Checked here, never echoed: httpx would fail deep inside with the token in
        # the exception (UnicodeEncodeError carries the whole header value).
        raise ConfigurationError(
            "the token must be printable ASCII without spaces or line breaks (a bearer "
            "token as issued); it was not sent"
        )
    if url.scheme not in ("http", "https") or not url.host:
        raise ConfigurationError(f"the target must be an http(s) URL, got {base_url!r}")
    if token is not None and url.scheme == "http" and not is_loopback(url.host):
        raise InsecureTransport(
            f"refusing to send a bearer token over plain http to {url.host}; use https "
            "(plain http is allowed to loopback only)"
        )
    if style not in ("raw", "sf-string"):
        raise ConfigurationError(f"unknown key header style {style!r}; use 'raw' or 'sf-string'")
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 2:
        raise ConfigurationError(f"concurrency must be a whole number >= 2, got {concurrency!r}")
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not 0 < timeout < float("inf")
    ):
        raise ConfigurationError(f"timeout must be a positive number of seconds, got {timeout!r}")
    plain = to_jsonable(args)
    changed = (
        to_jsonable(changed_args, root="changed_args")
        if changed_args is not None
        else {**plain, "agentkey_check_nonce": uuid.uuid4().hex}
    )
    if canonical_json(changed) == canonical_json(plain):
        raise ConfigurationError("changed_args must differ from args")
    body = canonical_json(plain)
    plan = "agentkey-check-" + uuid.uuid4().hex[:16]
    results: list[CheckResult] = []
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(
        timeout=timeout, follow_redirects=False, limits=limits, trust_env=False
    ) as client:
        target = _Target(client, str(url), token)
        try:
            results += await _fresh_and_duplicate(target, plan, body, plain, style)
            results.append(await _concurrent(target, plan, body, plain, style, concurrency))
            results += await _changed_args(target, plan, plain, changed)
            results += await _malformed(target, body)
            results.append(await _styles(target, plan, body, plain, style))
        except httpx.HTTPError as exc:
            results.append(
                CheckResult("request", "FAIL", f"{type(exc).__name__}: could not talk to {url}")
            )
    if token:
        results = [CheckResult(r.name, r.verdict, r.detail.replace(token, "***")) for r in results]
    return CheckReport(str(url), style, tuple(results))


def check_server(
    base_url: str,
    *,
    path: str,
    args: Mapping[str, Any],
    changed_args: Mapping[str, Any] | None = None,
    token: str | None = None,
    style: HeaderStyle = "raw",
    concurrency: int = 8,
    timeout: float = 30.0,
) -> CheckReport:
    """Blocking form of :func:`acheck_server`."""
    return asyncio.run(
        acheck_server(
            base_url,
            path=path,
            args=args,
            changed_args=changed_args,
            token=token,
            style=style,
            concurrency=concurrency,
            timeout=timeout,
        )
    )
