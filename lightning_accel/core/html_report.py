"""One self-contained HTML page of a run: what the doctor measured, what it found, what the Autopilot tried.

:func:`render_html` turns a :class:`~lightning_accel.core.report.DoctorReport` (and optionally a baseline report and
an Autopilot plan) into a single HTML file that loads nothing from the network: the plots are inline SVG drawn by
matplotlib (the ``plots`` extra), the style is inline CSS, and there is no script. Sections, in reading order:

1. the summary (bottleneck, step time, throughput, MFU, ranks) and the findings with their fix, largest saving first;
2. the step breakdown over time (stacked shares per window) and the throughput over time, with MFU where
   ``MFUMonitor`` ran (each window's MFU is the run's MFU scaled by that window's throughput: the FLOPs per sample
   do not change within a run);
3. the compute attribution, when the report carries one (modules by time, with their costliest operations);
4. the fit's phases (training, validation, checkpoints, start-up) and the code smells;
5. the Autopilot's trials, when a plan is given;
6. with a baseline, what changed per stage and overall.
"""

from __future__ import annotations

import html
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_accel.core.findings import STAGES
from lightning_accel.core.report import DoctorReport, compare

__all__ = ["render_html", "write_html"]

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
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _pct(x: float | None) -> str:
    return "—" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"


def _num(x: float | None, fmt: str = "{:.3g}") -> str:
    return "—" if x is None or not math.isfinite(float(x)) else fmt.format(x)


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


def _figure() -> Any:
    from lightning_accel._imports import require

    require("matplotlib", "the HTML report's plots")
    from matplotlib.backends.backend_svg import FigureCanvasSVG  # no global backend touched
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 3.4), dpi=100)
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


def _throughput_plot(timeline: list[dict[str, Any]], mfu: float | None) -> str | None:
    points = [
        (w["batch"], w["samples_per_sec"])
        for w in timeline
        if isinstance(w.get("samples_per_sec"), (int, float)) and w["samples_per_sec"] > 0
    ]
    if not points:
        return None
    x, rate = zip(*points)
    fig = _figure()
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, rate, marker="o", color="#1f77b4", label="samples/s (all ranks)")
    ax.set_xlabel("batches measured (per device)")
    ax.set_ylabel("samples/s")
    ax.set_ylim(bottom=0)
    handles, labels = ax.get_legend_handles_labels()
    if mfu is not None and math.isfinite(mfu):
        mean = sum(rate) / len(rate)
        ax2 = ax.twinx()
        ax2.plot(x, [100 * mfu * r / mean for r in rate], color="#d62728", linestyle="--", label="MFU (%)")
        ax2.set_ylabel("MFU (%)")
        ax2.set_ylim(bottom=0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="lower right", fontsize="small")
    ax.set_title("Throughput per window" + (" and MFU" if mfu is not None else ""))
    fig.tight_layout()
    return _svg(fig)


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
    mapping of module → fields, shown as a table."""
    if isinstance(attribution, Mapping):
        modules = attribution.get("modules", attribution.get("rows"))
        if modules is None:
            modules = [
                {"module": k, **(v if isinstance(v, Mapping) else {"value": v})}
                for k, v in attribution.items()
                if k not in ("notes", "window", "overhead")
            ]
        extra = {k: v for k, v in attribution.items() if k in ("window", "overhead", "notes")}
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
            elif isinstance(v, float):
                cells.append(_num(v))
            elif isinstance(v, (list, tuple)):
                cells.append("<br>".join(_e(_op(o)) for o in v[:5]))
            else:
                cells.append(_e("" if v is None else v))
        rows.append(cells)
    out = _table(keys, rows)
    if extra:
        out += "<ul class='notes'>" + "".join(f"<li>{_e(k)}: {_e(v)}</li>" for k, v in extra.items()) + "</ul>"
    return out


def _op(op: Any) -> str:
    if isinstance(op, Mapping):
        name = op.get("name", op.get("op", "?"))
        parts = [str(name)]
        for key in ("share", "ms", "seconds", "shapes"):
            if key in op:
                v = op[key]
                parts.append(f"{key} {_pct(v) if key == 'share' else v}")
        return " · ".join(parts)
    return str(op)


def _fit_section(report: DoctorReport) -> str:
    seconds = report.fit.get("seconds") if report.fit else None
    if not seconds:
        return "<p>The fit's phases were not measured.</p>"
    wall = float(report.fit.get("wall", 0.0)) or sum(seconds.values())
    names = [k for k, v in seconds.items() if v > 0]
    rows = [[_e(k), _num(seconds[k], "{:.2f}"), _pct(seconds[k] / wall if wall else None)] for k in names]
    plot = _bars_plot("The fit's phases", names, {"seconds": [seconds[k] for k in names]}, "seconds")
    return f"<figure>{plot}</figure>" + _table(["phase", "seconds", "share of the fit"], rows, numeric=[1, 2])


def _autopilot_section(plan: Mapping[str, Any]) -> str:
    trials = plan.get("trials") or []
    base, final = plan.get("baseline_samples_per_sec"), plan.get("final_samples_per_sec")
    speedup, low, high = plan.get("speedup"), plan.get("speedup_low"), plan.get("speedup_high")
    if speedup is not None and plan.get("kept"):
        claim = f" ({speedup:.2f}× the untouched configuration"
        if plan.get("speedup_source") == "trials":
            claim += ", product of the kept trials' paired ratios)"
        else:
            claim += f", final paired A/B{f', 90 % interval {low:.2f}–{high:.2f}' if low and high else ''})"
    else:
        claim = f" ({final / base:.2f}× in the search's windows)" if base and final else ""
    head = (
        f"<p>Baseline {_num(base)} samples/s → {_num(final)} samples/s" + claim + f"; noise {_pct(plan.get('noise'))}; "
        f"search {_num(plan.get('search_seconds'), '{:.1f}')} s"
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
                _num(t.get("ratio") or t.get("vs_baseline"), "{:.3f}×"),
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


def render_html(
    report: DoctorReport,
    *,
    baseline: DoctorReport | None = None,
    plan: Mapping[str, Any] | None = None,
    title: str = "lightning-accel run report",
) -> str:
    """The page as a string (see the module docstring). Needs matplotlib for the plots (``pip install
    'lightning-accel[plots]'``); raises ``ImportError`` naming that install otherwise."""
    cards = [
        ("bottleneck", _e(report.bottleneck or "—")),
        ("step time", _num(1e3 * report.step_seconds, "{:.1f} ms") if report.step_seconds else "—"),
        ("throughput", f"{_num(report.samples_per_sec)} samples/s"),
        ("MFU", _pct(report.mfu)),
        ("ranks", _e(report.world_size)),
        ("batches measured", _e(report.batches)),
    ]
    parts = [
        f"<h1>{_e(title)}</h1>",
        f'<p class="sub">{_e(report.context.device_type or "")} · {report.windows} windows</p>',
        '<div class="cards">'
        + "".join(f"<div class='card'><b>{v}</b><span>{_e(k)}</span></div>" for k, v in cards)
        + "</div>",
        "<h2>Findings, largest saving first</h2>",
        _findings_section(report),
    ]
    if report.shares:
        rows = [
            [_e(s), _pct(report.shares.get(s)), _num(1e3 * report.stage_seconds.get(s, math.nan), "{:.2f}")]
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
