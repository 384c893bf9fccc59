"""Every LightningCLI recipe in callbacks/ loads through LightningCLI and trains a few steps."""

from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

RECIPES = sorted((REPO / "callbacks").glob("*.yaml"))
SMALL = [
    "--trainer.max_steps=4",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.limit_val_batches=2",
    "--trainer.val_check_interval=2",
    "--trainer.num_sanity_val_steps=0",
    "--model.config.n_layer=1",
    "--model.config.d_model=32",
    "--model.config.n_head=2",
    "--model.config.seq_len=16",
    "--data.seq_len=16",
    "--data.batch_size=8",
    "--data.train_tokens=20000",
    "--data.val_tokens=2000",
]


def _class_paths(recipe: Path) -> list[str]:
    trainer = yaml.safe_load(recipe.read_text()).get("trainer", {})
    entries = list(trainer.get("callbacks") or []) + list(trainer.get("plugins") or [])
    return [e["class_path"].rsplit(".", 1)[-1] for e in entries]


def test_every_callback_has_a_recipe_and_a_combined_one_exists():
    names = {p.stem for p in RECIPES}
    assert {"mfu", "batch_size", "dataloader", "nonfinite", "compile", "checkpointing", "accelerate"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipe_trains_under_lightning_cli(recipe, tmp_path, monkeypatch):
    import train

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(recipe), *SMALL, f"--data.data_dir={tmp_path / 'data'}"]
    if recipe.stem == "compile":  # inductor's first compile takes minutes on 2 cores; the recipe's keys still load
        args.append("--trainer.callbacks.init_args.backend=aot_eager")
    if recipe.stem == "float8":  # no FP8 matmuls on a CPU: torchao's emulation, on the tiny model's layers
        pytest.importorskip("torchao.float8")
        args += ["--trainer.callbacks.init_args.emulate=true", "--trainer.callbacks.init_args.min_size=0"]
    cli = train.main(args, save_config_callback=None)
    assert cli.trainer.global_step == 4
    present = {type(cb).__name__ for cb in cli.trainer.callbacks}
    present |= {type(p).__name__ for p in [cli.trainer.precision_plugin]}
    for name in _class_paths(recipe):
        assert name in present, f"{recipe.name}: {name} not in the trainer ({sorted(present)})"
