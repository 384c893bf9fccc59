"""PrefetchingLoader: same batches in the same order, errors with their traceback, no leaked threads, CUDA path."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import multiprocessing
import threading
import time
import traceback
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.core.batch import map_tensors
from lightning_accel.core.prefetch import PrefetchingLoader

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    name: str


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "lightning-accel-prefetch" and t.is_alive()]


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def structured_batches(n: int) -> list[Any]:
    out = []
    for i in range(n):
        x = torch.full((2, 3), float(i))
        out.append(
            {
                "pair": Pair(x, torch.tensor([i, i])),
                "sample": Sample(x * 2, torch.tensor(i), f"s{i}"),
                "ids": [i, "text", None],
                "nested": (x + 1, {"k": 3.5}),
            }
        )
    return out


def assert_same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    else:
        assert a == b


# --- map_tensors -------------------------------------------------------------------------------------------------


def test_map_tensors_keeps_structure_and_non_tensor_leaves():
    batch = structured_batches(1)[0]
    batch["od"] = OrderedDict(a=torch.ones(1))
    batch["dd"] = defaultdict(list, b=torch.ones(1))
    out = map_tensors(batch, lambda t: t + 10)
    assert isinstance(out["pair"], Pair) and isinstance(out["sample"], Sample)
    assert torch.equal(out["pair"].x, batch["pair"].x + 10)
    assert torch.equal(out["sample"].label, batch["sample"].label + 10)
    assert out["sample"].name == "s0" and out["ids"] == [0, "text", None] and out["nested"][1] == {"k": 3.5}
    assert type(out["od"]) is OrderedDict and type(out["dd"]) is defaultdict and out["dd"].default_factory is list
    assert torch.equal(batch["pair"].x, torch.zeros(2, 3))  # input untouched
    assert out["ids"] is not batch["ids"]


# --- CPU prefetching ---------------------------------------------------------------------------------------------


def test_same_batches_same_order_any_structure_over_epochs():
    batches = structured_batches(7)
    loader = PrefetchingLoader(batches, depth=3)
    for _ in range(2):  # re-iterable: one pass per epoch
        got = list(loader)
        assert len(got) == 7
        for a, b in zip(got, batches):
            assert_same(a, b)
    assert wait_for(lambda: not prefetch_threads())


def seeded_shuffled_loader():
    data = TensorDataset(torch.arange(24.0))
    return DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))


def epochs_stopping_at_len(loader, epochs=3):
    """Lightning's loop over a sized loader: ``len()`` batches per epoch, no ``next()`` after the last."""
    out = []
    for _ in range(epochs):
        it = iter(loader)
        out.append([next(it)[0].tolist() for _ in range(len(loader))])
    return out


def test_a_loop_that_stops_at_len_sees_every_epochs_order_as_without_the_wrapper():
    # A RandomSampler draws its next permutation from the DataLoader's generator on the next() that finds the end;
    # read ahead past the length, the wrapper would make that draw and every later epoch's order would change.
    plain = epochs_stopping_at_len(seeded_shuffled_loader())
    wrapped = epochs_stopping_at_len(PrefetchingLoader(seeded_shuffled_loader(), depth=8))
    assert wrapped == plain
    assert plain[1] != plain[0]  # the epochs are shuffled differently: the check can tell them apart


def test_a_plain_for_loop_sees_every_epochs_order_as_without_the_wrapper():
    def epochs(loader):
        return [[b[0].tolist() for b in loader] for _ in range(3)]

    assert epochs(PrefetchingLoader(seeded_shuffled_loader(), depth=8)) == epochs(seeded_shuffled_loader())
    assert wait_for(lambda: not prefetch_threads())


def test_a_loader_longer_than_its_len_still_delivers_every_batch():
    class Lying:
        def __iter__(self):
            return iter(range(5))

        def __len__(self):
            return 3

    assert list(PrefetchingLoader(Lying(), depth=2)) == [0, 1, 2, 3, 4]
    assert list(PrefetchingLoader(type("Zero", (Lying,), {"__len__": lambda self: 0})())) == [0, 1, 2, 3, 4]
    assert wait_for(lambda: not prefetch_threads())


def test_dataloader_attributes_and_len_are_the_inner_loaders():
    dl = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=3, shuffle=True)
    loader = PrefetchingLoader(dl)
    assert len(loader) == 4 and loader.batch_size == 3 and loader.sampler is dl.sampler
    assert loader.dataset is dl.dataset and loader.batch_sampler is dl.batch_sampler
    loader.worker_init_fn = print  # writes reach the inner loader (Lightning sets this one)
    assert dl.worker_init_fn is print
    with pytest.raises(AttributeError):
        loader.no_such_attribute

    class Stateful(list):
        def state_dict(self):
            return {"consumed": 99}

    with pytest.raises(AttributeError, match="skip them on resume"):
        PrefetchingLoader(Stateful([1])).state_dict

    class CountsTrainedBatches(Stateful):
        state_counts_trained_batches = True  # its state ignores batches fetched ahead: safe to forward

    assert PrefetchingLoader(CountsTrainedBatches([1])).state_dict() == {"consumed": 99}
    torch.manual_seed(0)
    plain = [b[0] for b in dl]
    torch.manual_seed(0)
    wrapped = [b[0] for b in loader]  # the sampler's seed is drawn at the same point
    assert all(torch.equal(a, b) for a, b in zip(plain, wrapped)) and len(plain) == len(wrapped)
    with pytest.raises(TypeError):
        len(PrefetchingLoader(iter([1, 2])))


def test_worker_processes_loader_same_batches_and_clean_shutdown():
    # iter() (which starts the workers) runs in the caller, next() in the prefetch thread
    dl = DataLoader(TensorDataset(torch.arange(40.0)), batch_size=4, num_workers=2)
    expected = [b[0] for b in dl]
    loader = PrefetchingLoader(dl)
    got = [b[0] for b in loader]
    assert len(got) == 10 and all(torch.equal(a, b) for a, b in zip(got, expected))
    it = iter(loader)
    next(it)
    loader.close()  # mid-pass: the thread drops the DataLoader iterator, whose workers then shut down
    assert not it.alive
    assert wait_for(lambda: not multiprocessing.active_children())


def test_fetches_ahead_at_most_depth_batches():
    fetched = []

    class Counting:
        def __iter__(self):
            for i in range(100):
                fetched.append(i)
                yield i

    it = iter(PrefetchingLoader(Counting(), depth=2))
    assert next(it) == 0
    # one taken, two in the queue, one in the producer's hand waiting for room
    assert wait_for(lambda: len(fetched) == 4)
    time.sleep(0.2)
    assert len(fetched) == 4
    assert next(it) == 1
    assert wait_for(lambda: len(fetched) == 5)
    it.close()
    assert not it.alive


def test_overlaps_slow_loader_with_consumer_work():
    # not a timing assertion on speed: checks that the producer works while the consumer is busy
    produced_while_busy = []
    busy = threading.Event()

    class Slow:
        def __iter__(self):
            for i in range(3):
                time.sleep(0.02)
                produced_while_busy.append(busy.is_set())
                yield i

    it = iter(PrefetchingLoader(Slow(), depth=2))
    busy.set()
    assert wait_for(lambda: len(produced_while_busy) == 3)
    busy.clear()
    assert list(it) == [0, 1, 2]
    assert produced_while_busy[1:] == [True, True]


def failing_loader(fail_at: int):
    def explode_in_collate(i):
        raise KeyError(f"bad sample {i}")

    class Failing:
        def __iter__(self):
            for i in range(10):
                if i == fail_at:
                    explode_in_collate(i)
                yield i

    return Failing()


@pytest.mark.parametrize("fail_at", [0, 3])
def test_loader_exception_reraised_with_original_traceback(fail_at):
    it = iter(PrefetchingLoader(failing_loader(fail_at)))
    got = []
    with pytest.raises(KeyError, match=f"bad sample {fail_at}") as info:
        for batch in it:
            got.append(batch)
    assert got == list(range(fail_at))
    frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    assert "explode_in_collate" in frames
    assert not it.alive
    with pytest.raises(StopIteration):
        next(it)


def test_thread_stops_when_exhausted_closed_or_collected():
    before = len(prefetch_threads())
    # exhausted
    list(PrefetchingLoader(range(5)))
    assert wait_for(lambda: len(prefetch_threads()) == before)
    # closed mid-pass, through the loader (what DevicePrefetcher.teardown does)
    loader = PrefetchingLoader(range(1000), depth=2)
    it = iter(loader)
    next(it)
    assert len(prefetch_threads()) == before + 1
    loader.close()
    assert not it.alive and len(prefetch_threads()) == before
    with pytest.raises(StopIteration):
        next(it)
    # abandoned mid-pass and garbage-collected
    it = iter(PrefetchingLoader(range(1000), depth=2))
    next(it)
    assert len(prefetch_threads()) == before + 1
    del it
    gc.collect()
    assert wait_for(lambda: len(prefetch_threads()) == before)


def test_a_new_pass_ends_the_pass_before_it_first():
    before = len(prefetch_threads())
    loader = PrefetchingLoader(range(1000), depth=2)
    first = iter(loader)
    next(first)  # abandoned mid-pass, still referenced (its thread would otherwise run on)
    assert first.alive
    second = iter(loader)
    assert not first.alive  # stopped and joined before the new pass touched the wrapped loader
    assert next(second) == 0 and len(prefetch_threads()) == before + 1
    with pytest.raises(StopIteration):
        next(first)
    loader.close()


def test_empty_loader():
    assert list(PrefetchingLoader([])) == []
    assert wait_for(lambda: not prefetch_threads())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"depth": 0}, r"depth=0\): use an integer >= 1 \(batches\), e.g. depth=2"),
        ({"depth": True}, r"depth=True\): use an integer >= 1"),
        ({"device": "meta"}, "only 'cpu' and 'cuda'"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PrefetchingLoader([1], **kwargs)
    with pytest.raises(ValueError, match="expected an iterable"):
        PrefetchingLoader(3)


# --- CUDA path, structure handling with mocks ---------------------------------------------------------------------


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event)


class FakeEvent:
    def __init__(self):
        self.recorded_on = None

    def record(self, stream):
        self.recorded_on = stream


@pytest.fixture
def fake_cuda(monkeypatch):
    log: dict[str, Any] = {
        "active_stream": [],
        "pinned": [],
        "copied": [],
        "record_stream": [],
        "current": None,
        "allow_unpinned": False,
    }
    side = FakeStream("side")
    current = FakeStream("compute")
    log["side"], log["current"] = side, current

    class StreamCtx:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log["active_stream"].append(self.stream)

        def __exit__(self, *exc):
            log["active_stream"].pop()

    pinned_ids: set[int] = set()

    def is_pinned(self):
        return id(self) in pinned_ids or getattr(self, "_fake_pinned", False)

    def pin_memory(self):
        out = self.clone()
        pinned_ids.add(id(out))
        log["pinned"].append(out)
        return out

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            assert kwargs.get("non_blocking") is True
            assert log["active_stream"] == [side], "copy issued outside the side stream"
            assert is_pinned(self) or log["allow_unpinned"], "copy from unpinned memory"
            out = self.clone()
            log["copied"].append(out)
            return out
        return real_to(self, *args, **kwargs)

    def record_stream(self, stream):
        log["record_stream"].append((self, stream))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: side)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", StreamCtx)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.Tensor, "is_pinned", is_pinned)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return log


def test_cuda_path_structure_with_mocks(fake_cuda):
    batches = structured_batches(4)
    on_device = torch.empty(2, device="meta")  # stands in for a tensor already on the GPU (DALI output)
    for b in batches:
        b["dali"] = on_device
    loader = PrefetchingLoader(batches, device="cuda:0", depth=2)
    assert loader.device == torch.device("cuda:0")
    got = list(loader)
    assert len(got) == 4
    per_batch_tensors = 6  # pair.x, pair.y, sample.image, sample.label, nested[0]; +dali untouched -> 5 copies
    per_batch_copies = per_batch_tensors - 1
    assert len(fake_cuda["copied"]) == 4 * per_batch_copies
    # every copied tensor is marked for the compute stream, and only those
    recorded = [t for t, stream in fake_cuda["record_stream"]]
    assert {id(t) for t in recorded} == {id(t) for t in fake_cuda["copied"]}
    assert all(stream is fake_cuda["current"] for _, stream in fake_cuda["record_stream"])
    # the compute stream waited once per batch on an event recorded on the side stream
    waited = fake_cuda["current"].waited
    assert len(waited) == 4 and all(e.recorded_on is fake_cuda["side"] for e in waited)
    for out, ref in zip(got, batches):
        assert out["dali"] is on_device
        assert out["sample"].name == ref["sample"].name and out["ids"] == ref["ids"]
        assert out["nested"][1] == {"k": 3.5}
        assert any(out["pair"].x is t for t in fake_cuda["copied"])
        ref_plain = {k: v for k, v in ref.items() if k != "dali"}
        assert_same({k: v for k, v in out.items() if k != "dali"}, ref_plain)


def test_cuda_path_does_not_repin_pinned_or_pin_when_disabled(fake_cuda):
    x = torch.ones(3)
    x._fake_pinned = True
    list(PrefetchingLoader([(x,)], device="cuda"))
    assert fake_cuda["pinned"] == [] and len(fake_cuda["copied"]) == 1
    fake_cuda["allow_unpinned"] = True
    out = list(PrefetchingLoader([(torch.zeros(2),)], device="cuda", pin_memory=False))
    assert fake_cuda["pinned"] == [] and len(fake_cuda["copied"]) == 2 and out[0][0] is fake_cuda["copied"][1]


def test_cpu_device_means_host_only(fake_cuda):
    loader = PrefetchingLoader([torch.ones(2)], device="cpu")
    assert loader.device is None
    assert torch.equal(list(loader)[0], torch.ones(2)) and fake_cuda["copied"] == []


# --- real CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_prefetch_real_device():
    data = [{"x": torch.randn(64, 128), "y": torch.arange(64), "meta": "m"} for _ in range(6)]
    loader = PrefetchingLoader(data, device="cuda", depth=2)
    for out, ref in zip(loader, data, strict=True):
        assert out["x"].is_cuda and out["y"].is_cuda and out["meta"] == "m"
        # use on the compute stream right away: correct only if the stream waited for the copy
        torch.testing.assert_close((out["x"] * 2).cpu(), ref["x"] * 2)
        assert torch.equal(out["y"].cpu(), ref["y"])
    on_gpu = torch.ones(3, device="cuda")
    assert list(PrefetchingLoader([on_gpu], device="cuda"))[0] is on_gpu
