"""The run report as one self-contained HTML page (``lightning-accel report RUN.json --html OUT.html``)."""

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pytest

from lightning_accel.core.html_report import render_html, write_html
from lightning_accel.core.report import DoctorReport
from lightning_accel.core.rules import Finding
from tests.core.test_report import make

pytest.importorskip("matplotlib")


class Page(HTMLParser):
    """The page's tags, headings, table cells and external references."""

    def __init__(self):
        super().__init__()
        self.tags, self.headings, self.cells, self.external = [], [], [], []
        self._in = None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "xlink:href") and value and not value.startswith("#"):
                self.external.append(value)
        self._in = tag

    def handle_data(self, data):
        if self._in in ("h1", "h2") and data.strip():
            self.headings.append(data.strip())
        if self._in in ("td", "span", "b") and data.strip():
            self.cells.append(data.strip())

    def handle_endtag(self, tag):
        self._in = None


def parse(text):
    page = Page()
    page.feed(text)
    return page


def full_report():
    report = make()
    for i, w in enumerate(report.timeline):  # throughput per window, the second one faster
        w["samples_per_sec"] = 100.0 * (i + 1)
    report.findings = [
        Finding("data_wait", "data", "waiting 46 %", "DataLoaderTuner()", 0.46, saving=0.40),
        Finding(
            "validation_heavy",
            "validation",
            "validation 25 % of the fit",
            "Trainer(val_check_interval=200)",
            0.25,
            kind="fit",
            saving=0.12,
        ),
    ]
    report.fit = {
        "seconds": {"startup": 2.0, "train": 10.0, "validation": 3.0, "checkpoint": 0.5},
        "wall": 15.5,
        "counts": {},
        "train_batches": 40,
    }
    report.smells = [
        Finding("optimizer_not_foreach", "optimizer", "Adam(foreach=False)", "foreach=True", 1.0, kind="smell")
    ]
    return report


PLAN = {
    "trials": [
        {
            "index": 1,
            "name": "dataloader",
            "change": "num_workers=4",
            "samples_per_sec": 180.0,
            "vs_baseline": 1.8,
            "kept": True,
            "reason": "1.80x, lower bound 1.62x",
            "ratio": 1.8,
        },
        {
            "index": 2,
            "name": "compile",
            "change": "torch.compile",
            "samples_per_sec": 178.0,
            "vs_baseline": 0.99,
            "kept": False,
            "reason": "no gain beyond the noise",
            "ratio": 0.99,
        },
    ],
    "baseline_samples_per_sec": 100.0,
    "final_samples_per_sec": 180.0,
    "noise": 0.03,
    "search_seconds": 12.5,
}


def test_the_page_holds_every_section_in_reading_order_and_loads_nothing():
    text = render_html(full_report(), baseline=make(data=0.1, sps=50.0), plan=PLAN)
    page = parse(text)
    assert page.headings[0] == "lightning-accel run report"
    order = [
        "Findings, largest saving first",
        "Step breakdown",
        "Over time",
        "The fit's phases",
        "Code smells",
        "The Autopilot's trials",
        "Against the baseline",
        "Notes",
    ]
    assert [h for h in page.headings if h in order] == order
    # self-contained: no script, no stylesheet link, no image or font fetched from anywhere
    assert page.external == [] and "script" not in page.tags and "link" not in page.tags
    assert not re.search(r"url\((?!#)|@import", text)  # clip paths refer to the page itself (url(#id))
    assert text.count("<svg") == 4  # breakdown, throughput + MFU, fit phases, before/after
    # the findings with their fixes, largest saving first, with the share each would save
    assert page.cells.index("DataLoaderTuner()") < page.cells.index("Trainer(val_check_interval=200)")
    assert "40.0 %" in page.cells and "12.0 %" in page.cells
    # the Autopilot's trials: kept and undone
    assert "num_workers=4" in page.cells and "kept" in page.cells and "undone" in page.cells
    # the comparison names the throughput change
    assert "samples/s" in text and "MFU (%)" in text


def test_the_throughput_plot_follows_the_windows_and_is_left_out_without_them():
    report = full_report()
    with_rate = render_html(report)
    for w in report.timeline:
        del w["samples_per_sec"]
    without = render_html(report)
    assert with_rate.count("<svg") == without.count("<svg") + 1
    assert "Throughput per window" in with_rate and "Throughput per window" not in without


def test_user_text_is_escaped():
    report = full_report()
    report.findings[0] = Finding("data_wait", "data", "w", "<script>alert(1)</script>", 0.4, saving=0.4)
    text = render_html(report)
    assert "<script>" not in text and "&lt;script&gt;" in text


def test_an_attribution_in_the_report_gets_its_section():
    report = full_report()
    data = report.to_dict()
    data["attribution"] = {
        "modules": [
            {
                "module": "model.blocks.0.attn",
                "share": 0.42,
                "ops": [{"name": "aten::bmm", "share": 0.3, "shapes": "[8, 64, 64]"}],
            }
        ]
    }
    page = render_html(DoctorReport.from_dict(data)) if "attribution" in DoctorReport.__dataclass_fields__ else None
    if page is None:  # the report has no attribution field yet: the section reads the dict it is given
        from lightning_accel.core.html_report import _attribution_section

        page = _attribution_section(data["attribution"])
    assert "model.blocks.0.attn" in page and "42.0 %" in page and "aten::bmm" in page


def test_write_is_atomic_and_a_failed_render_leaves_no_file(tmp_path, monkeypatch):
    out = write_html(full_report(), tmp_path / "sub" / "run.html")
    assert out.read_text().startswith("<!DOCTYPE html>")
    assert [p.name for p in out.parent.iterdir()] == ["run.html"]
    import lightning_accel.core.html_report as html_report

    def broken(*args, **kwargs):
        raise RuntimeError("plot failed")

    monkeypatch.setattr(html_report, "_breakdown_plot", broken)
    with pytest.raises(RuntimeError, match="plot failed"):
        write_html(full_report(), tmp_path / "other.html")
    assert not (tmp_path / "other.html").exists()


def test_the_command_writes_the_page_with_baseline_and_plan(tmp_path):
    import json

    full_report().save(tmp_path / "new.json")
    make(data=0.1, sps=50.0).save(tmp_path / "old.json")
    from lightning_accel.core.autopilot import AutopilotPlan

    plan = AutopilotPlan(**{k: v for k, v in PLAN.items()})
    plan.save(tmp_path / "plan.json")
    assert json.loads((tmp_path / "plan.json").read_text())["trials"][0]["name"] == "dataloader"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "lightning_accel.cli",
            "report",
            str(tmp_path / "new.json"),
            "--baseline",
            str(tmp_path / "old.json"),
            "--plan",
            str(tmp_path / "plan.json"),
            "--html",
            str(tmp_path / "out.html"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    page = parse((tmp_path / "out.html").read_text())
    assert "The Autopilot's trials" in page.headings and "Against the baseline" in page.headings


@pytest.mark.skipif(
    shutil.which("chromium") is None and shutil.which("chromium-browser") is None,
    reason="no headless chromium (apt-get install chromium)",
)
def test_a_headless_browser_loads_the_page_without_console_errors(tmp_path):
    path = write_html(full_report(), tmp_path / "run.html", baseline=make(data=0.1), plan=PLAN)
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    proc = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--dump-dom",
            path.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Findings, largest saving first" in proc.stdout  # the DOM it built
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert console == [], console


def test_the_title_names_the_run_and_the_command_names_an_old_report_after_its_folder(tmp_path):
    from lightning_accel.core.report import run_name

    report = full_report()
    report.run = {"model": "GPTTask", "name": "demo/version_0"}
    text = render_html(report)
    assert parse(text).headings[0] == "GPTTask · demo/version_0"
    assert "<title>GPTTask · demo/version_0</title>" in text
    assert DoctorReport.from_dict(report.to_dict()).run == report.run
    assert run_name(tmp_path / "logs" / "demo" / "version_3") == "demo/version_3"  # Lightning's numbered runs
    assert run_name(tmp_path / "exp7") == "exp7"
    # a report that does not name its run (older JSON) is named after the folder it sits in
    folder = tmp_path / "exp7"
    folder.mkdir()
    full_report().save(folder / "bottleneck_report.json")
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_accel.cli", "report", str(folder / "bottleneck_report.json")]
        + ["--html", str(tmp_path / "out.html")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert parse((tmp_path / "out.html").read_text()).headings[0] == "exp7"


def test_mfu_has_its_own_panel_below_the_throughput_sharing_the_batch_axis():
    from lightning_accel.core.html_report import _throughput_figure

    timeline = full_report().timeline
    top, bottom = _throughput_figure(timeline, 0.3).axes
    assert top.get_ylabel().startswith("samples/s") and bottom.get_ylabel() == "MFU (%)"
    assert bottom.get_position().y1 <= top.get_position().y0  # stacked, not a twin axis drawn over the other
    assert top.get_shared_x_axes().joined(top, bottom)
    assert len(top.get_lines()) == 1 and len(bottom.get_lines()) == 1
    assert [y * 100 for y in bottom.get_lines()[0].get_ydata()] == pytest.approx([2000, 4000])  # 30 % × rate / mean
    assert len(_throughput_figure(timeline, None).axes) == 1  # without MFUMonitor: the throughput only


def test_numbers_are_printed_to_three_significant_figures():
    from lightning_accel.core.html_report import _sig

    cases = {19.2418: "19.2", 0.012345: "0.0123", 9.996: "10.0", 12345.6: "12,300", 0.0: "0", -0.5: "-0.500"}
    assert {x: _sig(x) for x in cases} == cases
    text = render_html(full_report(), baseline=make(data=0.1, sps=50.0), plan=PLAN)
    numbers = re.findall(r'<td class="num">([^<]*)</td>', text)
    assert "23.0" in numbers and "10.8" in numbers  # ms per batch of the step breakdown
    for cell in numbers:
        digits = re.sub(r"[^0-9]", "", cell).lstrip("0")
        assert len(digits) <= 3, cell


def test_each_modules_operations_are_a_small_table():
    from lightning_accel.core.html_report import _attribution_section

    section = _attribution_section(
        {
            "modules": [
                {
                    "module": "model.blocks.0.attn",
                    "share": 0.42,
                    "forward_ms": 41.53217,
                    "ops": [
                        {"name": "aten::bmm", "share": 0.3, "ms": 19.2418, "shapes": "[8, 64, 64], [8, 64, 64]"},
                        {"name": "aten::softmax", "share": 0.05, "ms": 3.2071, "shapes": "[8, 64, 64]"},
                    ],
                }
            ]
        }
    )
    page = parse(section)
    assert page.tags.count("table") == 2  # the modules, and the operations nested in the module's row
    nested = section[section.index("<table class='ops'>") :]
    headers = re.findall(r"<th>([^<]*)</th>", nested)
    assert headers == ["operation", "ms / step", "share", "shapes"]
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in re.findall(r"<tr><td.*?</tr>", nested)]
    assert rows == [
        ["aten::bmm", "19.2", "30.0 %", "[8, 64, 64], [8, 64, 64]"],
        ["aten::softmax", "3.21", "5.00 %", "[8, 64, 64]"],
    ]
    assert "41.5" in page.cells and "19.2418" not in section
