"""What the callbacks share to act on a running fit, outside Lightning's loop: real training steps run and undone
exactly (``step_runner``), where the train DataLoader comes from and how to rebuild it (``loader_source``), readers
of the Trainer's state (``trainer_state``) and window metrics sent to the loggers in one call (``window_metrics``).
Private: the tuners, the doctor and the Autopilot import from the modules directly."""
