"""Strategy strings for ``Trainer(strategy=...)``: registered lazily by :mod:`.registration`."""
