"""samples_in_batch's fast path (a tensor first) agrees with the generic walk."""

import torch

from lightning_accel.core.batch import samples_in_batch


def test_fast_path_and_generic_walk_agree():
    x = torch.zeros(5, 3)
    assert samples_in_batch(x) == 5
    assert samples_in_batch([x, torch.zeros(7)]) == 5 and samples_in_batch((x,)) == 5
    assert samples_in_batch({"a": x, "b": torch.zeros(9)}) == 5
    # the first item is not a batched tensor: the generic walk finds the first that is
    assert samples_in_batch([torch.tensor(1.0), x]) == 5
    assert samples_in_batch([{"ids": torch.zeros(4, 2)}]) == 4
    assert samples_in_batch([]) == 0 and samples_in_batch({}) == 0 and samples_in_batch("text") == 0
