"""A LightningCLI script for the recipes in ``callbacks/`` (the demo GPT and its generated data).

    python train.py fit --config callbacks/accelerate.yaml
    python train.py fit --config callbacks/mfu.yaml --trainer.max_steps 200 --model.config.n_layer 6

Use the recipes with your own LightningCLI script the same way: ``import lightning_accel`` first (it registers the
strategy strings such as ``ddp_bf16_compress``), then pass ``--config callbacks/<recipe>.yaml``.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning.pytorch.cli import LightningCLI

import lightning_accel  # noqa: F401  (registers the strategy strings)
from lightning_accel.demo.task import DemoDataModule, GPTTask


def main(args: Sequence[str] | None = None, **kwargs: object) -> LightningCLI:
    return LightningCLI(GPTTask, DemoDataModule, args=args, save_config_kwargs={"overwrite": True}, **kwargs)


if __name__ == "__main__":
    main()
