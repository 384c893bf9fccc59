"""Shared test helpers: a fake clock, datasets (slow, indexed), tiny models and a quiet CPU Trainer."""

from tests.helpers.clock import FakeClock
from tests.helpers.data import IndexedDataset, SleepyDataset
from tests.helpers.models import TinyRegressor, cpu_trainer

__all__ = ["FakeClock", "IndexedDataset", "SleepyDataset", "TinyRegressor", "cpu_trainer"]
