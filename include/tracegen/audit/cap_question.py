"""The gate's question to a reviewer, and the decision an answer makes: plain data, no Airflow.

Under gate_mode=ask a run whose truncation is over the threshold (at the pilot, or drifting there
mid-run) pauses at a question built here from the report JSON its audit wrote (`run.run_report`): the
verdict, the cap table (truncation with its interval, tokens per row, ETA, GPU time) and where the report
is. The options are fixed in kind (`RECOMMENDED`, `OTHER`, `CURRENT`, `STOP`) and labelled with this
run's caps. An answer (one option, and for `OTHER` the cap typed in the form) becomes a `CapDecision`,
or is refused with `AnswerRefused` saying what would be accepted: the run never continues at a cap the
servers cannot serve.

Stop is what an unanswered question resolves to; the recommended cap is listed first and marked, but a
run only ever spends GPU time on a cap somebody chose.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import quote

from tracegen.audit.formats import duration_fine, gpu_hours, num, pct
from tracegen.common.cap_rule import CapRefused, check_cap, lowest_cap, shown, whole_number
from tracegen.common.locations import shown_location

RECOMMENDED, OTHER, CURRENT, STOP = "recommended", "other", "current", "stop"
OPTION_KINDS = (RECOMMENDED, OTHER, CURRENT, STOP)
PILOT, DRIFT = "pilot", "drift"  # what raised the question: the pilot gate, or the continuous gate mid-run
RAISE = "raise"  # no question: an operator raised the cap of the running run (`tracegen.run.cap_raise`)
TRIGGERS = (PILOT, DRIFT, RAISE)
CAP_FIELD = "cap"  # the form field of the `OTHER` option
STOP_LABEL = "Stop the run"
CAP_TABLE_KEYS = ("cap", "truncation", "truncation_low", "truncation_high", "expected_tokens_per_row",
                  "eta_hours", "gpu_hours", "basis", "clipped_to_context", "truncation_excluding_runaways")
_VERDICT_KEYS = ("verdict", "reason", "action", "truncated", "total", "rate", "ci_low", "ci_high", "threshold",
                 "confidence")


class AnswerRefused(ValueError):
    """An answer the run cannot act on; the message says why and what would be accepted."""


@dataclass(frozen=True)
class CapOption:
    kind: str
    label: str
    cap: int | None = None  # the cap it continues at; None for OTHER (typed) and STOP


@dataclass(frozen=True)
class CapQuestion:
    """What the reviewer is shown and may answer; small enough for an XCom."""

    run_id: str
    trigger: str  # PILOT or DRIFT
    current_cap: int
    recommended_cap: int | None
    max_cap: int  # the highest cap a continuing run may take (below the servers' context length)
    context_length: int | None
    truncated_policy: str
    verdict: dict[str, Any]
    cap_rows: list[dict[str, Any]]
    confidence: float
    throughput: dict[str, Any] | None
    report_uri: str  # where the report is stored
    report_url: str | None  # the review page showing it, when the Airflow deployment has one
    timeout_minutes: float
    options: tuple[CapOption, ...] = field(default=())
    # What the fleet generates while the question waits (`run.while_asking.WhileAsking.to_json()`, with its
    # `statement` for the reviewer); None: nothing runs until the answer.
    while_asking: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.options:
            object.__setattr__(self, "options", _options(self))

    @property
    def labels(self) -> list[str]:
        return [o.label for o in self.options]

    def option_label(self, kind: str) -> str:
        return next(o.label for o in self.options if o.kind == kind)

    @property
    def min_cap(self) -> int:
        """The lowest cap a typed answer may take: above the current one (`cap_rule`)."""
        return lowest_cap(self.current_cap)

    def option(self, label: str) -> CapOption:
        for o in self.options:
            if o.label == label:
                return o
        raise AnswerRefused(f"{label!r} is not one of this question's options: {self.labels}")

    @property
    def subject(self) -> str:
        if self.trigger == PILOT:
            return f"The pilot is over the truncation threshold at max_tokens={self.current_cap:,}: continue at which cap?"
        return (f"The running truncation rate held chunks back at max_tokens={self.current_cap:,}: "
                "continue at which cap?")

    @property
    def body(self) -> str:
        return question_body(self)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CapQuestion:
        fields_ = dict(doc)
        fields_["options"] = tuple(CapOption(**o) for o in doc.get("options") or ())
        return cls(**fields_)


@dataclass(frozen=True)
class CapDecision:
    """What was decided, by whom and when, and the table they decided on; kept in the run's record."""

    trigger: str
    option: str  # the label chosen
    kind: str
    from_cap: int
    cap: int | None  # the cap the run continues at; None: the run stops
    responded_by: str | None  # None when the question timed out
    responded_at: str  # ISO 8601, UTC
    timed_out: bool
    verdict: dict[str, Any]
    cap_rows: list[dict[str, Any]]
    report_uri: str
    # What was generated while the question waited and what this answer makes of it, from the ledger when
    # the answer was applied (`run.while_asking.account`); None when nothing was.
    while_asking: dict[str, Any] | None = None

    @property
    def continues(self) -> bool:
        return self.cap is not None

    def summary(self) -> str:
        if self.trigger == RAISE:
            return (f"{self.responded_by or 'unknown'} raised the cap of the running run at {self.responded_at}: "
                    f"continue at max_tokens={self.cap:,} (from max_tokens={self.from_cap:,})")
        if self.timed_out:
            head = f"nobody answered by {self.responded_at}, so the default '{self.option}' was taken"
        else:
            head = f"{self.responded_by or 'unknown'} chose '{self.option}' at {self.responded_at}"
        what = f"continue at max_tokens={self.cap:,}" if self.continues else "stop the run"
        return f"{head}: {what} (the {self.trigger} gate, at max_tokens={self.from_cap:,})"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CapDecision:
        decision = cls(**doc)
        if decision.kind not in OPTION_KINDS or decision.trigger not in TRIGGERS:
            raise ValueError(f"decision: kind {decision.kind!r} or trigger {decision.trigger!r} is unknown")
        return decision


def question_from_report(
    report: dict[str, Any],
    *,
    run_id: str,
    trigger: str,
    max_cap: int,
    context_length: int | None,
    truncated_policy: str,
    report_uri: str,
    report_url: str | None,
    timeout_minutes: float,
) -> CapQuestion:
    """The question for a run whose audit wrote `report` (report.json's dict, `audit.report`)."""
    verdict = report.get("verdict") or {}
    table = report.get("cap_table") or {}
    current = int(report["audit"]["max_tokens"])
    recommended = table.get("recommended_cap")
    return CapQuestion(
        run_id=run_id, trigger=trigger, current_cap=current,
        recommended_cap=None if recommended is None else int(recommended), max_cap=max_cap,
        context_length=context_length, truncated_policy=truncated_policy,
        verdict={k: verdict.get(k) for k in _VERDICT_KEYS},
        cap_rows=[{k: row.get(k) for k in CAP_TABLE_KEYS} for row in table.get("rows") or []],
        confidence=float(table.get("confidence") or verdict.get("confidence") or 0.95),
        throughput=table.get("throughput"), report_uri=report_uri, report_url=report_url,
        timeout_minutes=timeout_minutes,
    )


def _options(q: CapQuestion) -> tuple[CapOption, ...]:
    options = []
    rec = q.recommended_cap
    # Listed first: the cap the table says meets the threshold, when the servers can take it.
    if rec is not None and lowest_cap(q.current_cap) <= rec <= q.max_cap:
        options.append(CapOption(RECOMMENDED, f"Continue at {rec:,} tokens (recommended)", rec))
    if lowest_cap(q.current_cap) <= q.max_cap:  # some cap above the current one fits the servers
        options.append(CapOption(OTHER, "Continue at the cap typed below"))
    options.append(CapOption(CURRENT, f"Continue at {q.current_cap:,} tokens, accepting the truncation",
                             q.current_cap))
    options.append(CapOption(STOP, STOP_LABEL))
    return tuple(options)


# Read as markup anywhere in a line (code spans, emphasis, links, HTML, table cells, headings, GFM's
# strikethrough, entities); backslash-escaping an ASCII punctuation character is always literal in CommonMark.
_MARKUP = re.compile(r"([\\`*_\[\]<>|#~&])")
# Read as markup only where a line starts (lists, thematic breaks, setext headings, and an ordered list's
# `1.` or `1)` followed by a space: "36.7%" is no list).
_LINE_START = re.compile(r"^([-+=]|\d{1,9}(?=[.)](?:\s|$)))")


def markdown_text(value: Any) -> str:
    """`value` as literal text in the question's Markdown: every character Markdown would read as markup is
    backslash-escaped, and line breaks become spaces, so no value can close a code span, open a link, start
    a list or end the table row it is shown in. The one escaping the question's values go through."""
    text = " ".join(str(value).split()) if value is not None else ""
    text = _MARKUP.sub(r"\\\1", text)
    match = _LINE_START.match(text)
    if match:
        end = match.end()
        # A leading '-', '+' or '=' is escaped; an ordered list's '1.' by its '.' or ')'.
        text = "\\" + text if match.group(1) in "-+=" else text[:end] + "\\" + text[end:]
    return text


def _markdown_link(label: str, url: str) -> str:
    """A link whose target cannot end early or carry markup: what a URL may not hold raw is percent-encoded."""
    target = quote(shown_location(url), safe=":/?#@!$&'*+,;=%-._~")
    return f"[{markdown_text(label)}]({target})"


def question_body(q: CapQuestion) -> str:
    """The question's Markdown: verdict, cap table, options explained, the report's whereabouts."""
    v = q.verdict
    where = "the pilot" if q.trigger == PILOT else "the rows generated so far (the continuous gate's sample)"
    head = (f"**Truncation is over the threshold in {where}.**" if v.get("verdict") == "stop" else
            # A chunk's own rows closed its gate, yet the wider sample does not stop: the reviewer decides.
            f"**Chunks were held back at this cap; the audit of {where} now says "
            f"{markdown_text(v.get('verdict'))}.**")
    lines = [f"{head} {markdown_text(v.get('reason') or '')}", ""]
    rows = q.cap_rows
    if rows:
        has_time = q.throughput is not None
        head = ["max_tokens", "predicted truncation", f"{round(q.confidence * 100)}% interval", "tokens/row"]
        head += ["ETA", "GPU time"] if has_time else []
        head += ["basis"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * (len(head) - 1) + "---|"]
        for r in rows:
            cap = int(r["cap"])
            mark = (" (current)" if cap == q.current_cap else
                    " (recommended)" if cap == q.recommended_cap else "")
            beyond = " (over the context)" if cap > q.max_cap else ""
            cells = [f"{cap:,}{mark}{beyond}", pct(r.get("truncation")),
                     f"{pct(r.get('truncation_low'))}–{pct(r.get('truncation_high'))}",
                     num(r.get("expected_tokens_per_row"))]
            if has_time:
                # Three significant digits: at small scale the options' costs still read differently.
                cells += [duration_fine(r.get("eta_hours")), gpu_hours(r.get("gpu_hours"))]
            cells.append("observed" if r.get("basis") == "observed" else "modelled")
            cells = [markdown_text(c) for c in cells]
            if cap == q.recommended_cap:
                cells = [f"**{c}**" for c in cells]
            lines.append("| " + " | ".join(cells) + " |")
        if has_time:
            t = q.throughput or {}
            lines += ["", f"ETA and GPU time: the {markdown_text(num(t.get('rows_remaining')))} rows left, at "
                          f"{markdown_text(num(t.get('tokens_per_s_per_gpu')))} tokens/s per GPU (measured in the "
                          f"pilot) on {markdown_text(num(t.get('n_gpus')))} GPUs."]
    else:
        lines.append("No cap table: too few rows finished to fit their lengths; see the report.")
    context = (f"the servers' context length is {q.context_length:,} tokens" if q.context_length
               else "the servers did not report their context length")
    redo = {"extend": "continued from their tokens to the new cap (only the new tokens are paid for)",
            "regenerate": "generated again at the new cap",
            "keep": "kept as they are (truncated_policy=keep)"}.get(q.truncated_policy,
                                                                        markdown_text(q.truncated_policy))
    lines += ["", "**Options**", ""]
    for o in q.options:
        explain = {
            RECOMMENDED: "the smallest cap in the table predicted to meet the threshold.",
            OTHER: f"type a cap in the field below, from {q.min_cap:,} to {q.max_cap:,} ({context}).",
            CURRENT: "the run goes on at this cap and the gate stops asking.",
            STOP: f"the run ends here; also what happens when nobody answers within "
                  f"{_minutes(q.timeout_minutes)}.",
        }[o.kind]
        lines.append(f"- **{markdown_text(o.label)}**: {explain}")
    lines += ["", f"An answer the run cannot act on (no cap typed, a cap outside {q.min_cap:,} to {q.max_cap:,}, "
                  "or a cap typed with another option) is refused: the question opens again, and the task's log and "
                  "its XCom `refused_answer` say why."]
    lines += ["", f"Continuing, the same run goes on: finished rows are kept, rows truncated at "
                  f"{q.current_cap:,} are {redo}, and the chunks not generated yet run at the chosen cap.",]
    if q.while_asking:
        lines += ["", markdown_text(q.while_asking["statement"])]
    lines.append("")
    report = _markdown_link("Open the report", q.report_url) if q.report_url else "The report"
    # Plain escaped text, not a code span: nothing inside a code span can be escaped, so a backtick in an
    # S3 key would close it.
    lines.append(f"{report} (stored at {markdown_text(shown_location(q.report_uri))}).")
    return "\n".join(lines)


def _minutes(minutes: float) -> str:
    if minutes < 120:
        return f"{minutes:g} minutes"
    return f"{minutes / 60:g} hours"


def decision_of_answer(
    question: CapQuestion,
    chosen_options: list[str],
    params_input: dict[str, Any] | None,
    *,
    responded_by: str | None,
    responded_at: dt.datetime | str,
    timed_out: bool = False,
) -> CapDecision:
    """The decision an answer makes; `AnswerRefused` when it cannot be acted on."""
    if len(chosen_options) != 1:
        raise AnswerRefused(f"choose exactly one option, got {list(chosen_options)}")
    option = question.option(chosen_options[0])
    typed = (params_input or {}).get(CAP_FIELD)
    if typed in ("", None):
        typed = None
    if option.kind == OTHER:
        if typed is None:
            raise AnswerRefused(f"'{option.label}' needs a cap in the form's '{CAP_FIELD}' field "
                                f"({question.min_cap:,} to {question.max_cap:,})")
        cap = answered_cap(typed, question)
    else:
        if typed is not None:
            other = next((o.label for o in question.options if o.kind == OTHER), None)
            instead = f"choose '{other}' to continue at it, or clear the field" if other else "clear the field"
            raise AnswerRefused(f"a cap ({shown(typed)}) was typed but '{option.label}' was chosen; {instead}")
        # The recommended cap goes through the same rule as a typed one (the question is data from an
        # XCom); the current cap and stop are not new caps.
        cap = answered_cap(option.cap, question) if option.kind == RECOMMENDED else option.cap
    when = responded_at.isoformat() if isinstance(responded_at, dt.datetime) else str(responded_at)
    return CapDecision(
        trigger=question.trigger, option=option.label, kind=option.kind, from_cap=question.current_cap, cap=cap,
        responded_by=None if timed_out else responded_by, responded_at=when, timed_out=timed_out,
        verdict=question.verdict, cap_rows=question.cap_rows, report_uri=question.report_uri,
    )


def answered_cap(value: Any, question: CapQuestion) -> int:
    """A typed cap as the integer the run continues at, by `cap_rule`'s one check: above the current cap
    and within the servers' context; anything else is refused, saying what fits and what else to choose."""
    try:
        cap = whole_number(value, name="cap")
        current = question.option_label(CURRENT)
        return check_cap(cap, name="cap", current=question.current_cap, context_length=question.context_length,
                          hint=f"to go on at {question.current_cap:,}, choose '{current}', or choose "
                               f"'{question.option_label(STOP)}'")
    except CapRefused as exc:
        raise AnswerRefused(str(exc)) from None
