"""The demo's --precision auto / --compile / --checkpointing flags build the right Trainer pieces."""

from __future__ import annotations

import argparse

from lightning_accel.demo.run import add_demo_arguments, build_callbacks, build_precision, config_from_args


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    return parser.parse_args(list(argv))


def test_flags_map_to_plugin_and_callbacks() -> None:
    from lightning_accel import ActivationCheckpointing, AutoMixedPrecision, TorchCompile
    from lightning_accel.demo.model import Block

    cfg = config_from_args(parse("--precision", "auto", "--compile", "--checkpointing"))
    kwargs = build_precision(cfg)
    assert list(kwargs) == ["plugins"] and isinstance(kwargs["plugins"][0], AutoMixedPrecision)
    assert kwargs["plugins"][0].dtype == "auto"
    callbacks = build_callbacks(cfg)
    assert any(isinstance(cb, TorchCompile) for cb in callbacks)
    assert any(isinstance(cb, ActivationCheckpointing) and cb.modules == [Block] for cb in callbacks)


def test_defaults_keep_the_lightning_precision_string() -> None:
    cfg = config_from_args(parse())
    assert build_precision(cfg) == {"precision": "32-true"}
    assert [type(cb).__name__ for cb in build_callbacks(cfg)] == ["MFUMonitor", "BottleneckDoctor"]
