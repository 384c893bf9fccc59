"""One self-contained HTML page of a run: what the doctor measured, what it found, what the Autopilot tried.

:func:`render_html` turns a :class:`~lightning_accel.core.report.DoctorReport` (and optionally a baseline report and
an Autopilot plan) into a single HTML file that loads nothing from the network: inline SVG plots, inline CSS, no
script. See docs/measuring/doctor.md (The HTML page), which lists its sections.
"""

from __future__ import annotations

import html
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

from lightning_accel.core.findings import STAGES
from lightning_accel.core.report import DoctorReport, compare

__all__ = ["page_title", "render_html", "write_html"]

_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1100px;padding:1rem 1.5rem;
color:#1d1d1f;line-height:1.45}
h1{font-size:1.5rem;margin-bottom:.2rem}h2{font-size:1.15rem;margin-top:2rem;border-bottom:1px solid #ddd}
.sub{color:#666;margin-top:0}
.cards{display:flex;flex-wrap:wrap;gap:.75rem;margin:1rem 0}
.card{border:1px solid #ddd;border-radius:6px;padding:.5rem .9rem;min-width:9rem}
.card b{display:block;font-size:1.2rem}.card span{color:#666;font-size:.85rem}
table{border-collapse:collapse;width:100%;font-size:.9rem;margin:.5rem 0}
th,td{border-bottom:1px solid #eee;padding:.3rem .5rem;text-align:left;vertical-align:top}
th{background:#f6f6f8}td.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.fix{color:#0b5394}.kept{color:#1a7f37;font-weight:600}.undone{color:#888}
figure{margin:.5rem 0}figure svg{max-width:100%;height:auto}
ul.notes{color:#555;font-size:.9rem}
table.ops{width:100%;table-layout:fixed;font-size:.8rem;margin:0}table.ops th:nth-child(1){width:34%}
table.ops th:nth-child(2){width:11%;text-align:right}table.ops th:nth-child(3){width:11%;text-align:right}table.ops th,table.ops td{border:0;padding:.05rem .5rem .05rem 0;
background:none}table.ops th{color:#666;font-weight:500;white-space:nowrap}table.ops td.shapes{font-family:ui-monospace,monospace;
font-size:.75rem;color:#444}
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _sig(x: float, digits: int = 3) -> str:
    """``x`` to ``digits`` significant figures in plain notation, for a person: ``19.2418`` → ``19.2``,
    ``0.012345`` → ``0.0123``, ``12345.6`` → ``12,300``."""
    if x == 0:
        return "0"
    rounded = float(f"{x:.{digits - 1}e}")  # rounded first: 9.996 has the exponent of 10.0
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:,.{decimals}f}"


def _finite(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _pct(x: float | None) -> str:
    return f"{_sig(100 * x)} %" if _finite(x) else "—"


def _num(x: float | None, unit: str = "") -> str:
    return f"{_sig(float(x))}{unit}" if _finite(x) else "—"


def _value(v: Any) -> str:
    """Any JSON value of the report as text, its floats to three significant figures."""
    if isinstance(v, float):
        return _num(v)
    if isinstance(v, Mapping):
        return ", ".join(f"{k} {_value(x)}" for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return ", ".join(_value(x) for x in v)
    return "—" if v is None else str(v)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> str:
    """An HTML table; cells are already escaped HTML."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _svg(fig: Any) -> str:
    """The figure as inline SVG (no XML header: it sits inside the page)."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    text = buf.getvalue()
    return text[text.index("<svg") :]


def _figure(height: float = 3.4) -> Any:
    from lightning_accel._imports import require

    require("matplotlib", "the HTML report's plots")
    from matplotlib.backends.backend_svg import FigureCanvasSVG  # no global backend touched
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, height), dpi=100)
    FigureCanvasSVG(fig)
    return fig


def _breakdown_plot(timeline: list[dict[str, Any]], bottleneck: str | None) -> str:
    x = [w["batch"] for w in timeline]
    ys = [[100 * w["shares"].get(s, 0.0) for w in timeline] for s in STAGES]
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    if len(x) == 1:  # a stacked area needs two points
        bottom = 0.0
        for stage, y in zip(STAGES, ys):
            ax.bar(x, y, bottom=bottom, label=stage, width=max(1, x[0] * 0.5))
            bottom += y[0]
    else:
        ax.stackplot(x, ys, labels=list(STAGES))
    ax.set_xlabel("batches measured (per device)")
    ax.set_ylabel("share of step time (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"Where each window's step time went (bottleneck: {bottleneck})")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize="small")
    fig.tight_layout()
    return _svg(fig)


def _throughput_figure(timeline: list[dict[str, Any]], mfu: float | None) -> Any:
    """Throughput per window, and below it, in a panel of its own sharing the batch axis, MFU per window (on one
    axis the two lines would coincide: each window's MFU is the run's scaled by the window's throughput)."""
    points = [(w["batch"], w["samples_per_sec"]) for w in timeline if _finite(w.get("samples_per_sec"))]
    points = [(b, r) for b, r in points if r > 0]
    if not points:
        return None
    x, rate = zip(*points)
    with_mfu = mfu is not None and math.isfinite(mfu)
    fig = _figure(5.6 if with_mfu else 3.4)
    ax = fig.add_subplot(2 if with_mfu else 1, 1, 1)
    ax.plot(x, rate, marker="o", color="#1f77b4")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput per window" + (" and MFU" if with_mfu else ""))
    bottom = ax
    if with_mfu:
        assert mfu is not None
        mean = sum(rate) / len(rate)
        bottom = fig.add_subplot(2, 1, 2, sharex=ax)
        bottom.plot(x, [100 * mfu * r / mean for r in rate], marker="o", color="#d62728")
        bottom.set_ylabel("MFU (%)")
        bottom.set_ylim(bottom=0)
        ax.tick_params(labelbottom=False)
    bottom.set_xlabel("batches measured (per device)")
    fig.tight_layout()
    return fig


def _throughput_plot(timeline: list[dict[str, Any]], mfu: float | None) -> str | None:
    fig = _throughput_figure(timeline, mfu)
    return None if fig is None else _svg(fig)


def _bars_plot(title: str, labels: list[str], series: Mapping[str, list[float]], ylabel: str) -> str:
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], values, width=width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return _svg(fig)


def _findings_section(report: DoctorReport) -> str:
    if not report.findings:
        return "<p>No finding: no stage or phase crossed its threshold.</p>"
    rows = [
        [
            _e(f"{f.stage}: {f.module}" if f.module else f.stage),
            _e(f.rule),
            _pct(f.saving),
            _e(f.evidence),
            f'<span class="fix">{_e(f.fix)}</span>',
        ]
        for f in report.findings
    ]
    return _table(["stage", "finding", "would save", "evidence", "fix"], rows, numeric=[2])


def _attribution_section(attribution: Any) -> str:
    """The compute attribution: a list of modules (``module``, ``share`` or ``seconds``, ``ops``), or any other
    mapping of module → fields, shown as a table; each module's operations are a table in its cell."""
    if isinstance(attribution, Mapping):
        modules = attribution.get("modules", attribution.get("rows"))
        if modules is None:
            modules = [
                {"module": k, **(v if isinstance(v, Mapping) else {"value": v})}
                for k, v in attribution.items()
                if k not in ("notes", "window", "overhead")
            ]
        extra = {k: v for k, v in attribution.items() if k in ("window", "overhead", "notes") and v}
    else:
        modules, extra = attribution, {}
    if not isinstance(modules, Sequence) or not modules:
        return "<p>No compute attribution in this report.</p>"
    keys: list[str] = []
    for row in modules:
        if isinstance(row, Mapping):
            keys.extend(k for k in row if k not in keys)
    rows = []
    for row in modules:
        if not isinstance(row, Mapping):
            continue
        cells = []
        for k in keys:
            v = row.get(k)
            if isinstance(v, float) and ("share" in k or "frac" in k):
                cells.append(_pct(v))
            elif k == "ops" and isinstance(v, (list, tuple)):
                cells.append(_ops_table(v[:5]))
            else:
                cells.append(_e(_value(v)) if v is not None else "")
        rows.append(cells)
    numeric = [i for i, k in enumerate(keys) if k != "module" and k != "ops"]
    out = _table([_header(k) for k in keys], rows, numeric=numeric)
    if extra:
        out += "<ul class='notes'>" + "".join(f"<li>{_e(k)}: {_e(_value(v))}</li>" for k, v in extra.items()) + "</ul>"
    return out


def _header(key: str) -> str:
    """``forward_ms`` → ``forward ms``: the JSON keys as column names."""
    return key.replace("_", " ")


def _ops_table(ops: Sequence[Any]) -> str:
    """A module's costliest operations as a small table: operation, ms per step, share, input shapes."""
    rows = []
    for op in ops:
        if not isinstance(op, Mapping):
            rows.append(f"<tr><td colspan='4'>{_e(op)}</td></tr>")
            continue
        ms = op.get("ms")
        if not _finite(ms) and _finite(op.get("seconds")):
            ms = 1e3 * op["seconds"]
        shapes = op.get("shapes")
        rows.append(
            f"<tr><td>{_e(op.get('name', op.get('op', '?')))}</td><td class='num'>{_num(ms)}</td>"
            f"<td class='num'>{_pct(op.get('share'))}</td>"
            f"<td class='shapes'>{_e(_value(shapes) if shapes else '')}</td></tr>"
        )
    head = "<tr><th>operation</th><th>ms / step</th><th>share</th><th>shapes</th></tr>"
    return f"<table class='ops'><thead>{head}</thead><tbody>{''.join(rows)}</tbody></table>"


def _fit_section(report: DoctorReport) -> str:
    seconds = report.fit.get("seconds") if report.fit else None
    if not seconds:
        return "<p>The fit's phases were not measured.</p>"
    wall = float(report.fit.get("wall", 0.0)) or sum(seconds.values())
    names = [k for k, v in seconds.items() if v > 0]
    rows = [[_e(k), _num(seconds[k]), _pct(seconds[k] / wall if wall else None)] for k in names]
    plot = _bars_plot("The fit's phases", names, {"seconds": [seconds[k] for k in names]}, "seconds")
    return f"<figure>{plot}</figure>" + _table(["phase", "seconds", "share of the fit"], rows, numeric=[1, 2])


def _autopilot_section(plan: Mapping[str, Any]) -> str:
    trials = plan.get("trials") or []
    base, final = plan.get("baseline_samples_per_sec"), plan.get("final_samples_per_sec")
    speedup, low, high = plan.get("speedup"), plan.get("speedup_low"), plan.get("speedup_high")
    if speedup is not None and plan.get("kept"):
        claim = f" ({_num(speedup, '×')} the untouched configuration"
        if plan.get("speedup_source") == "trials":
            claim += ", product of the kept trials' paired ratios)"
        else:
            claim += f", final paired A/B{f', 90 % interval {_sig(low)}–{_sig(high)}' if low and high else ''})"
    else:
        claim = f" ({_num(final / base, '×')} in the search's windows)" if base and final else ""
    head = (
        f"<p>Baseline {_num(base)} samples/s → {_num(final)} samples/s" + claim + f"; noise {_pct(plan.get('noise'))}; "
        f"search {_num(plan.get('search_seconds'))} s"
        + (f"; stopped: {_e(plan['stopped'])}" if plan.get("stopped") else "")
        + ".</p>"
    )
    rows = []
    for t in trials:
        kept = t.get("kept")
        rows.append(
            [
                _e(t.get("index", "")),
                _e(t.get("name", "")),
                _e(t.get("change", "")),
                _num(t.get("samples_per_sec")),
                _num(t.get("ratio") or t.get("vs_baseline"), "×"),
                '<span class="kept">kept</span>' if kept else '<span class="undone">undone</span>',
                _e(t.get("reason", "")),
            ]
        )
    return head + _table(["#", "fix", "change", "samples/s", "ratio", "", "why"], rows, numeric=[3, 4])


def _comparison_section(report: DoctorReport, baseline: DoctorReport) -> str:
    stages = [s for s in STAGES if s in report.stage_seconds or s in baseline.stage_seconds]
    plot = _bars_plot(
        "ms per batch, before and after",
        stages,
        {
            "baseline": [1e3 * baseline.stage_seconds.get(s, 0.0) for s in stages],
            "this run": [1e3 * report.stage_seconds.get(s, 0.0) for s in stages],
        },
        "ms per batch",
    )
    lines = "".join(f"<li>{_e(line)}</li>" for line in compare(report, baseline))
    return f"<figure>{plot}</figure><ul>{lines}</ul>"


_GENERIC_TITLE = "lightning-accel run report"


def page_title(report: DoctorReport) -> str:
    """What names the run: ``DoctorReport.run``'s model class and run name (``GPTTask · demo/version_0``), else
    the generic ``lightning-accel run report``."""
    named = [str(report.run[k]) for k in ("model", "name") if report.run.get(k)]
    return " · ".join(named) or _GENERIC_TITLE


def render_html(
    report: DoctorReport,
    *,
    baseline: DoctorReport | None = None,
    plan: Mapping[str, Any] | None = None,
    title: str | None = None,
) -> str:
    """The page as a string (docs/measuring/doctor.md, The HTML page); ``title`` defaults to :func:`page_title`. Needs
    matplotlib for the plots (``pip install 'lightning-accel[plots]'``); raises ``ImportError`` naming that
    install otherwise."""
    title = title or page_title(report)
    sub = [] if title == _GENERIC_TITLE else [_GENERIC_TITLE]
    sub += [report.context.device_type or "", f"{report.windows} windows"]
    cards = [
        ("bottleneck", _e(report.bottleneck or "—")),
        ("step time", _num(1e3 * report.step_seconds, " ms") if report.step_seconds else "—"),
        ("throughput", f"{_num(report.samples_per_sec)} samples/s"),
        ("MFU", _pct(report.mfu)),
        ("ranks", _e(report.world_size)),
        ("batches measured", _e(report.batches)),
    ]
    parts = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(" · ".join(x for x in sub if x))}</p>',
        '<div class="cards">'
        + "".join(f"<div class='card'><b>{v}</b><span>{_e(k)}</span></div>" for k, v in cards)
        + "</div>",
        "<h2>Findings, largest saving first</h2>",
        _findings_section(report),
    ]
    if report.shares:
        rows = [
            [_e(s), _pct(report.shares.get(s)), _num(1e3 * report.stage_seconds.get(s, math.nan))]
            for s in STAGES
            if s in report.shares
        ]
        parts += ["<h2>Step breakdown</h2>", _table(["stage", "share of step", "ms / batch"], rows, numeric=[1, 2])]
    if report.timeline:
        parts += ["<h2>Over time</h2>", f"<figure>{_breakdown_plot(report.timeline, report.bottleneck)}</figure>"]
        throughput = _throughput_plot(report.timeline, report.mfu)
        if throughput is not None:
            parts.append(f"<figure>{throughput}</figure>")
    attribution = report.to_dict().get("attribution")
    if attribution:
        parts += ["<h2>Compute attribution</h2>", _attribution_section(attribution)]
    parts += ["<h2>The fit's phases</h2>", _fit_section(report)]
    if report.smells:
        rows = [[_e(f.rule), _e(f.evidence), f'<span class="fix">{_e(f.fix)}</span>'] for f in report.smells]
        parts += ["<h2>Code smells</h2>", _table(["smell", "evidence", "fix"], rows)]
    if plan is not None:
        parts += ["<h2>The Autopilot's trials</h2>", _autopilot_section(plan)]
    if baseline is not None:
        parts += ["<h2>Against the baseline</h2>", _comparison_section(report, baseline)]
    if report.notes:
        parts += ["<h2>Notes</h2>", "<ul class='notes'>" + "".join(f"<li>{_e(n)}</li>" for n in report.notes) + "</ul>"]
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def write_html(report: DoctorReport, path: str | os.PathLike[str], **kwargs: Any) -> Path:
    """Write :func:`render_html` to ``path`` atomically (never a half-written page)."""
    from lightning_accel._atomic import atomic_open

    page = render_html(report, **kwargs)  # rendered first: a failure leaves no file behind
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(target, "w") as fh:
        fh.write(page)
    return target
