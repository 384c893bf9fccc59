"""DALIImageDataModule under real 2-process Lightning DDP on CPU: exact sharding, equal batch counts, reshuffle."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.conftest import REPO, read_rank_json, run_script
from tests.data.conftest import write_solid_folder

pytestmark = [pytest.mark.dali, pytest.mark.distributed]

# both scripts: argv[1] the image folder, argv[2] the repository
PREAMBLE = """
import json, sys
import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
sys.path.insert(0, sys.argv[2])
from tests.data.conftest import identify
from lightning_accel.data.dali import DALIImageDataModule
"""

SCRIPT = (
    PREAMBLE
    + """
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
)


@pytest.mark.parametrize("source", ["folder", "shards"])
def test_ddp_every_sample_once_per_epoch_equal_batches_reshuffled(ddp_script, tmp_path, source):
    root = tmp_path / "images"
    truth = write_solid_folder(root, num_classes=3, per_class=8)  # 24 = 3 batches x 4 x 2 ranks: no padding
    label_of = {pid: label for pid, label in truth.values()}
    if source == "shards":  # WebDataset tar shards (5 of them) instead of the folder
        from lightning_accel.data.webdataset import pack_webdataset

        pack_webdataset(root, tmp_path / "shards", shard_size=5, progress_bar=False)
        root = tmp_path / "shards"
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


RESUMABLE_SCRIPT = (
    PREAMBLE
    + """
class Probe(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.seen = {}

    def training_step(self, batch, batch_idx):
        self.seen[f"{self.current_epoch}/{batch_idx}"] = identify(batch[0])
        return self.layer(batch[0].mean(dim=(2, 3))).mean()

    def on_fit_end(self):
        with open(f"{sys.argv[3]}_rank{self.trainer.global_rank}.json", "w") as f:
            json.dump(self.seen, f)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

devices = int(sys.argv[4])
resume = sys.argv[5] if len(sys.argv) > 5 else None
dm = DALIImageDataModule(train=sys.argv[1], image_size=32, batch_size=4, num_threads=1, seed=5)
trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_epochs=2,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[ModelCheckpoint(dirpath="ckpt", filename="{epoch}-{step}", save_top_k=-1,
                                                every_n_train_steps=1)])
trainer.fit(Probe(), datamodule=dm, ckpt_path=resume)
"""
)


def test_ddp_checkpoint_resumed_on_one_process_sees_every_remaining_sample_once(ddp_script, tmp_path):
    """2 ranks x batch 4 (3 batches an epoch), checkpoint 1 batch into epoch 1, resumed on 1 process x batch 4: the
    resumed epoch reads exactly the 16 images the 2 ranks had not trained on."""
    root = tmp_path / "images"
    write_solid_folder(root, num_classes=3, per_class=8)
    ddp_script(RESUMABLE_SCRIPT, args=[str(root), str(REPO), "full", "2"])
    full = read_rank_json(tmp_path, "full")
    trained = [i for r in full for i in r["1/0"]]  # epoch 1, batch 0 on both ranks: 8 images
    assert len(set(trained)) == 8
    run_script(
        RESUMABLE_SCRIPT,
        tmp_path,
        args=[str(root), str(REPO), "resumed", "1", str(tmp_path / "ckpt" / "epoch=1-step=4.ckpt")],
    )
    resumed = read_rank_json(tmp_path, "resumed", world_size=1)[0]
    assert all(key.startswith("1/") for key in resumed)
    rest = [i for ids in resumed.values() for i in ids]
    assert len(rest) == 16 and sorted(rest + trained) == list(range(24))
