"""benchmarks/autopilot_scripts.py and bench_autopilot_real.py must not rot: the naive scripts build and train, the
hand-tuned configuration is the same model (eager and SDPA attention compute the same loss), a run in-process
returns its row, and the report computes its ratios from the rows."""

import importlib
import math
import sys

import pytest
import torch

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
scripts = importlib.import_module("autopilot_scripts")
real = importlib.import_module("bench_autopilot_real")


def test_tokenizer_is_deterministic_merges_pairs_and_fits_the_vocabulary():
    table = scripts._merge_table()
    text = "the cat eats a hat " * 10
    once, again = scripts.tokenize(text, table, 3), scripts.tokenize(text, table, 3)
    assert once == again
    assert len(once) < len(text.encode())  # merges happened
    assert scripts.tokenize(text, table, 0) == list(text.encode())
    data = scripts.TokenizingDataset(4, seed=1)
    item = data[0]
    assert item.shape == (scripts.SEQ + 1,) and item.dtype == torch.long
    assert int(item.max()) < scripts.VOCAB and torch.equal(item, data[0])


def test_build_refuses_a_micro_batch_that_changes_the_global_batch():
    with pytest.raises(ValueError, match="global batch must stay 32"):
        scripts.build(scripts.SCRIPTS["demo"], dict(scripts.VANILLA, micro=(8, 8)), samples=8)


@pytest.mark.parametrize("name", list(scripts.SCRIPTS))
def test_the_hand_tuned_attention_is_the_same_model(name):
    script = scripts.SCRIPTS[name]
    if script.missing():
        pytest.skip(script.missing())
    batch = scripts.example_batch(script)
    losses = []
    for attention in ("eager", "sdpa"):
        module, _ = scripts.build(script, dict(scripts.VANILLA, attention=attention), samples=8)
        with torch.no_grad():
            losses.append(float(module.loss(batch)))
    assert math.isfinite(losses[0]) and losses[0] == pytest.approx(losses[1], rel=1e-5)
    if script.hf:  # the knob exists: the vanilla model really runs eager attention
        module, _ = scripts.build(script, dict(scripts.VANILLA), samples=8)
        assert module.model.config._attn_implementation == "eager"


def test_a_run_in_process_trains_the_asked_steps_and_reports_its_row():
    row = real.run_real(
        {"kind": "real", "script": "demo", "variant": "hand_fp32", "steps": 3, "skip": 1, "planned_steps": 3}
    )
    assert row["global_step"] == 3 and row["samples_per_sec"] > 0 and math.isfinite(row["loss"])
    assert row["seconds_per_step"] > 0


@pytest.mark.slow
def test_an_autopilot_run_in_process_carries_its_search():
    row = real.run_real(
        {"kind": "real", "script": "demo", "variant": "autopilot", "steps": 3, "skip": 1, "planned_steps": 3}
    )
    assert row["global_step"] == 3 and row["search_seconds"] >= 0 and isinstance(row["trials"], list)
    assert row["stopped"]  # a 3-step fit cannot repay a search: it says why


def r(variant, sps, **extra):
    """A result row of script ``s``."""
    return {"kind": "real", "script": "s", "variant": variant, "samples_per_sec": sps, "loss": 1.0, **extra}


def test_report_divides_by_vanilla_and_by_the_better_hand_tuned_precision():
    rows = [
        r("vanilla", 100.0),
        r("hand_fp32", 150.0),
        r("hand_bf16", 200.0),
        r("autopilot", 180.0, search_seconds=6.0, kept=["a"], commit="abc"),
        r("autopilot", 190.0, search_seconds=12.0, kept=["a"], commit="abc"),
        r("autopilot", 50.0, search_seconds=1.0, kept=[], commit="old"),
    ]
    table = real.report(rows, commit="abc")
    line = next(ln for ln in table.splitlines() if ln.startswith("| s |"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[6] == "1.85 (1.80–1.90)"  # ÷ vanilla
    assert cells[7] == "0.93 (0.90–0.95)"  # ÷ the bf16 hand-tuned run, the better one
    assert cells[10] == "1.50 (1.00–2.00) %"  # of a 600 s fit
    assert cells[11] == "a (2)"  # the old commit's search is not counted


def test_claims_are_divided_by_what_training_measured_against_the_vanilla_median():
    rows = [
        r("vanilla", 90.0),
        r("vanilla", 110.0),
        r("vanilla", 100.0),
        r("autopilot", 150.0, kept=["a"], claimed_speedup=1.65, claimed_low=1.5, claimed_high=1.8),
        r("autopilot", 100.0, kept=[], claimed_speedup=None),  # nothing kept: the claim is 1x
    ]
    lines = real.claims_table(rows)
    cells = [c.strip() for c in lines[-1].split("|")]
    assert cells[2] == "a (1)<br>nothing (1)"
    assert cells[3] == "1.65 [1.50–1.80], 1.00"
    assert cells[4] == "1.50, 1.00 (vanilla 90, 110, 100)"
    assert cells[5] == "1.05 (1.00–1.10)"  # claimed ÷ measured: 1.10 and 1.00


def test_every_vanilla_run_asked_for_runs_and_the_first_comes_first(monkeypatch):
    ran = []
    monkeypatch.setattr(real, "_child", lambda spec, out, timeout: ran.append(spec["variant"]) or {"variant": "x"})
    monkeypatch.setattr(real, "_say", lambda row: None)
    real.drive_real(["demo"], 1, 4, 1, None, {}, ["autopilot", "vanilla", "autopilot", "vanilla"])
    assert ran == ["vanilla", "autopilot", "autopilot", "vanilla"]


def test_the_grid_holds_every_combination_once_with_vanilla_and_the_hand_tuned_sets_among_them():
    lm, hf = scripts.grid(scripts.SCRIPTS["demo"]), scripts.grid(scripts.SCRIPTS["gpt2"])
    assert len(lm) == 2 * 3 * 4 * 3 and len(hf) == 2 * len(lm)  # attention only where there is an eager one
    assert len({repr(sorted(c.items())) for c in hf}) == len(hf)
    assert scripts.VANILLA in hf
    for precision in ("32-true", "bf16-mixed"):
        assert dict(scripts.VANILLA, **scripts.HAND_TUNED, precision=precision) in hf
    assert len(scripts.grid(scripts.SCRIPTS["gpt2"], ["micro"])) == 4
    with pytest.raises(ValueError, match="grid knobs \\['warp'\\]"):
        scripts.grid(scripts.SCRIPTS["demo"], ["warp"])


def test_grid_points_run_among_the_variants_each_with_its_configuration(monkeypatch):
    ran = []
    monkeypatch.setattr(
        real, "_child", lambda spec, out, timeout: ran.append(spec) or {**spec, "seconds_per_step": 0.1}
    )
    monkeypatch.setattr(real, "_say", lambda row: None)
    real.drive_real(["demo"], 2, 4, 1, None, {}, ["vanilla", "autopilot"], ["micro"])
    first, second = ran[:6], ran[6:]
    assert [s["variant"] for s in first] == ["vanilla", "autopilot", "grid", "grid", "grid", "grid"]
    assert [s["config"]["micro"] for s in first[2:]] == [(4, 8), (8, 4), (16, 2), (32, 1)]
    assert [s["variant"] for s in second] == ["grid"] * 4 + ["autopilot", "vanilla"]  # the next round reversed
    assert [s["config"]["micro"] for s in second[:4]] == [(32, 1), (16, 2), (8, 4), (4, 8)]


def test_the_fastest_grid_points_run_again_so_the_best_is_a_median_not_the_luckiest_run(monkeypatch):
    rates = {(4, 8): 100.0, (8, 4): 130.0, (16, 2): 120.0, (32, 1): 110.0}
    ran = []

    def child(spec, out, timeout):
        ran.append(spec)
        rate = rates[tuple(spec["config"]["micro"])] if spec["variant"] == "grid" else 90.0
        return {**spec, "samples_per_sec": rate, "seconds_per_step": 0.1}

    monkeypatch.setattr(real, "_child", child)
    monkeypatch.setattr(real, "_say", lambda row: None)
    rows = real.drive_real(["demo"], 1, 4, 1, None, {}, ["vanilla"], ["micro"], grid_top=2)
    again = [tuple(s["config"]["micro"]) for s in ran[5:]]
    assert again == [(8, 4), (16, 2), (16, 2), (8, 4)]  # the two fastest, twice more, alternating
    assert len(rows) == 9 and all(s["steps"] == 4 and s["planned_steps"] == ran[1]["planned_steps"] for s in ran[5:])
    assert len(real.drive_real(["demo"], 1, 4, 1, None, {}, ["vanilla"], ["micro"])) == 5  # grid_top=0: none


def test_the_grid_table_divides_each_search_by_the_best_grid_point():
    def point(micro, sps):
        return r("grid", sps, config=dict(scripts.VANILLA, micro=micro))

    rows = [
        point((4, 8), 100.0),
        point((32, 1), 200.0),
        point((32, 1), 180.0),  # the median of a point's runs: 190
        r("autopilot", 190.0, kept=["32 x 1"]),
        r("autopilot", 171.0, kept=["32 x 1"]),
        r("autopilot", 95.0, kept=[]),
    ]
    cells = [c.strip() for c in real.grid_table(rows)[-1].split("|")]
    assert cells[2] == "2" and cells[3].endswith("32 × 1, 0 workers (190.0, median of 2)")
    assert cells[4] == "1.00, 0.90, 0.50"
    assert cells[5] == "1 of 3" and cells[6] == "2 of 3"


def test_a_run_reads_back_the_configuration_it_trained_with_as_a_grid_point():
    config = dict(scripts.VANILLA, precision="bf16-mixed", optimizer="fused", micro=(16, 2))
    spec = {"kind": "real", "script": "demo", "variant": "grid", "config": config, "steps": 2, "skip": 1}
    row = real.run_real({**spec, "planned_steps": 2})
    assert row["trained_config"] == config  # read from the trainer, the optimizer and the batches after the fit
    assert real._config_name(row["trained_config"]) == real._config_name(config)
    vanilla = real.run_real({**spec, "variant": "vanilla", "planned_steps": 2})
    assert vanilla["trained_config"] == dict(scripts.VANILLA)
    assert "other" not in vanilla["trained_config"]


def test_the_grid_table_names_each_kept_configuration_as_the_grid_measured_it_pooled_over_the_optimizer():
    def point(sps, **knobs):
        return r("grid", sps, config=dict(scripts.VANILLA, **knobs))

    def search(sps, **knobs):
        return r("autopilot", sps, kept=["x"], trained_config=dict(scripts.VANILLA, **knobs))

    rows = [
        point(100.0, micro=(4, 8)),
        point(200.0, micro=(32, 1), optimizer="single"),
        point(210.0, micro=(32, 1), optimizer="fused"),  # the best single point: 210
        point(150.0, micro=(32, 1), optimizer="foreach"),  # pooled 32 x 1: median of 200, 210, 150 = 200
        point(190.0, micro=(32, 1), precision="bf16-mixed"),
        search(100.0, micro=(32, 1), optimizer="foreach"),  # an unlucky run of the pooled best: 1.00
        search(230.0, micro=(32, 1), precision="bf16-mixed"),  # a lucky run of a worse one: 0.95
        search(150.0, micro=(32, 1), other=["compile"]),
    ]
    cells = [c.strip() for c in real.grid_table(rows)[-1].split("|")]
    assert cells[3].endswith("fused, 32 × 1, 0 workers (210.0, median of 1)")
    assert cells[4] == "0.48, 1.10, 0.71"  # each search's own run ÷ the best single point
    assert cells[7] == "eager, 32-true, 32 × 1, 0 workers (200.0, median of 3)"
    assert cells[8] == "1.00 (3), 0.95 (1), not in the grid"
    assert cells[9] == "2 of 3"


def test_the_optimizer_step_is_timed_per_knob_value_on_the_scripts_own_parameters():
    row = real.optimizer_step_ms("demo", repeats=2)
    module, _ = scripts.build(scripts.SCRIPTS["demo"], dict(scripts.VANILLA), samples=8)
    assert row["parameters"] == sum(p.numel() for p in module.parameters()) and row["tensors"] > 1
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("single", "foreach", "fused"))


def test_the_classification_script_trains_and_validates():
    script = scripts.SCRIPTS["bert_cls"]
    if script.missing():
        pytest.skip(script.missing())
    ids, labels = scripts.example_batch(script, 64, seed=5)
    assert ids.shape == (64, scripts.SEQ) and set(labels.tolist()) == {0, 1}  # both classes occur
    row = real.run_real(
        {"kind": "real", "script": "bert_cls", "variant": "vanilla", "steps": 6, "skip": 1, "planned_steps": 6}
    )
    assert row["global_step"] == 6 and math.isfinite(row["loss"])
    assert row["val_loss"] is not None and math.isfinite(row["val_loss"])  # validation ran inside the fit
