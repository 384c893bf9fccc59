"""DALIImageDataModule under real 2-process Lightning DDP on CPU: exact sharding, equal batch counts, reshuffle."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.conftest import REPO, read_rank_json
from tests.data.conftest import write_solid_folder

pytestmark = [pytest.mark.dali, pytest.mark.distributed]

SCRIPT = """
import json, sys
import lightning.pytorch as pl
import torch
sys.path.insert(0, sys.argv[2])
from tests.data.conftest import identify
from lightning_accel.data.dali import DALIImageDataModule

class Probe(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.record = {"train": {}, "val": {}, "types": []}

    def _ids(self, split, batch):
        images, labels = batch
        assert isinstance(images, torch.Tensor) and isinstance(labels, torch.Tensor)
        self.record["types"].append([str(images.dtype), str(labels.dtype), images.device.type])
        epoch = str(self.current_epoch)
        self.record[split].setdefault(epoch, []).append([identify(images), labels.tolist()])

    def training_step(self, batch, batch_idx):
        self._ids("train", batch)
        return self.layer(batch[0].mean(dim=(2, 3))).mean()

    def validation_step(self, batch, batch_idx):
        self._ids("val", batch)

    def on_fit_end(self):
        rank = self.trainer.global_rank
        with open(f"seen_rank{rank}.json", "w") as f:
            json.dump({**self.record, "len_train": len(self.trainer.train_dataloader),
                       "num_val_batches": self.trainer.num_val_batches}, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

root = sys.argv[1]
dm = DALIImageDataModule(train=root, val=root, image_size=32, batch_size=4, val_batch_size=4, num_threads=1,
                         last_batch="pad", seed=5)
trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0)
trainer.fit(Probe(), datamodule=dm)
"""


def test_ddp_every_sample_once_per_epoch_equal_batches_reshuffled(ddp_script, tmp_path):
    root = tmp_path / "images"
    truth = write_solid_folder(root, num_classes=3, per_class=8)  # 24 = 3 batches x 4 x 2 ranks: no padding
    label_of = {pid: label for pid, label in truth.values()}
    ddp_script(SCRIPT, args=[str(root), str(REPO)])
    ranks = read_rank_json(tmp_path, "seen")
    orders = []
    for epoch in ("0", "1", "2"):
        per_rank = [[i for ids, _ in r["train"][epoch] for i in ids] for r in ranks]
        assert [len(r["train"][epoch]) for r in ranks] == [3, 3]  # equal batch counts
        assert sorted(per_rank[0] + per_rank[1]) == list(range(24))  # every image exactly once (by content)
        orders.append(per_rank[0] + per_rank[1])
        for r in ranks:
            for ids, labels in r["train"][epoch]:
                assert [label_of[i] for i in ids] == labels
        # validation: sharded, no double counting, the same number of batches on both ranks
        val = [[i for ids, _ in r["val"][epoch] for i in ids] for r in ranks]
        assert sorted(val[0] + val[1]) == list(range(24))
        assert [len(r["val"][epoch]) for r in ranks] == [3, 3]
    assert len({tuple(o) for o in orders}) == 3  # reshuffled every epoch
    assert all(r["len_train"] == 3 for r in ranks)
    assert Counter(tuple(t) for r in ranks for t in r["types"]) == {("torch.float32", "torch.int64", "cpu"): 36}
