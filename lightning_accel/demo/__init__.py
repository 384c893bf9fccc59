"""The built-in demo task (a small GPT on generated tokens) used by ``lightning-accel demo`` and the notebooks."""

from lightning_accel.demo.run import DemoConfig, run_demo

__all__ = ["DemoConfig", "run_demo"]
