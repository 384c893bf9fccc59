"""pack_webdataset: round trip, class index, atomic shards, CLI."""

from __future__ import annotations

import json
import tarfile

import pytest

from lightning_accel.data.webdataset import pack_webdataset
from tests.data.conftest import write_solid_folder


def read_shards(out):
    samples = {}
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar:
                key, _, ext = m.name.partition(".")
                samples.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return samples


def test_round_trip_content_labels_and_index(tmp_path):
    src = tmp_path / "src"
    truth = write_solid_folder(src, num_classes=3, per_class=5)
    meta = pack_webdataset(src, tmp_path / "out", shard_size=4, progress_bar=False)
    assert [s["num_samples"] for s in meta["shards"]] == [4, 4, 4, 3]
    index = json.loads((tmp_path / "out" / "classes.json").read_text())
    assert index == meta and index["classes"] == ["class_0", "class_1", "class_2"] and index["num_samples"] == 15
    packed = sorted((s["jpg"], int(s["cls"])) for s in read_shards(tmp_path / "out").values())
    original = sorted(((src / name).read_bytes(), label) for name, (_, label) in truth.items())
    assert packed == original  # identical bytes and labels
    # shuffled across shards (not class-sorted); deterministic for a seed
    order = [int(s["cls"]) for _, s in sorted(read_shards(tmp_path / "out").items())]
    assert order != sorted(order)
    pack_webdataset(src, tmp_path / "again", shard_size=4, progress_bar=False)
    for a, b in zip(sorted((tmp_path / "out").glob("*.tar")), sorted((tmp_path / "again").glob("*.tar"))):
        assert a.read_bytes() == b.read_bytes()


def test_interrupted_pack_leaves_no_partial_shard(tmp_path, monkeypatch):
    import lightning_accel.data.webdataset as wds

    src = tmp_path / "src"
    write_solid_folder(src, num_classes=2, per_class=5)
    calls = {"n": 0}
    real = wds._add_member

    def failing(tar, name, data):
        calls["n"] += 1
        if calls["n"] == 11:  # in the middle of the second shard
            raise KeyboardInterrupt
        real(tar, name, data)

    monkeypatch.setattr(wds, "_add_member", failing)
    with pytest.raises(KeyboardInterrupt):
        pack_webdataset(src, tmp_path / "out", shard_size=4, progress_bar=False)
    left = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert left == ["shard-000000.tar"]  # the finished shard only: no temp file, no partial shard, no index
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        assert len(tar.getmembers()) == 8


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        pack_webdataset(tmp_path / "nope", tmp_path / "out", progress_bar=False)
    src = tmp_path / "src"
    write_solid_folder(src, num_classes=1, per_class=2)
    (src / "class_0" / "img_1.jpg").write_text("not an image")
    with pytest.raises(ValueError, match="img_1.jpg is not an image"):
        pack_webdataset(src, tmp_path / "out", progress_bar=False)
    with pytest.raises(ValueError, match="shard_size"):
        pack_webdataset(src, tmp_path / "out", shard_size=0)


def test_cli_pack_webdataset(tmp_path, capsys):
    from lightning_accel.cli import main

    src = tmp_path / "src"
    write_solid_folder(src, num_classes=2, per_class=3)
    assert main(["pack", "webdataset", str(src), str(tmp_path / "out"), "--shard-size", "4", "--no-progress-bar"]) == 0
    assert "packed 6 images of 2 classes into 2 shard(s)" in capsys.readouterr().out
    assert len(read_shards(tmp_path / "out")) == 6
    assert main(["pack", "webdataset", str(tmp_path / "missing"), str(tmp_path / "o2")]) == 2
    assert "missing does not exist" in capsys.readouterr().err
