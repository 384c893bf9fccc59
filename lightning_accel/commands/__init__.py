"""Subcommands of ``lightning-accel``: one module each, with ``ORDER`` (position in ``--help``) and
``register(subparsers)``, which adds the subparser and sets ``func`` (``args -> exit code``). The CLI finds them
by listing this package, so adding a command is adding a file. Import heavy things inside ``func`` only."""
