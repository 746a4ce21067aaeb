"""The bundled digits experiment: shipped weights, tasks, and the command line of the benchmark."""

import os

import numpy as np

from finefreeze._data.digits import WEIGHTS, pretrained_digits_model, source_task, target_task


def test_shipped_base_is_small_and_loads_exactly():
    assert os.path.getsize(WEIGHTS) < 5 * 2**20
    m = pretrained_digits_model(seed=1)
    with np.load(WEIGHTS) as w:
        assert sorted(w.files) == sorted(v.path for v in m.weights if not v.path.startswith("head/"))
        for v in m.weights:
            if v.path in w.files:
                assert np.array_equal(v.numpy(), w[v.path].astype("float32")), v.path
    assert m.count_params() - (32 * 5 + 5) == 1_148_960


def test_tasks_are_disjoint_digits_and_the_target_split_is_seeded():
    x, y = source_task()
    assert x.shape[1] == 64 and set(y.tolist()) == {0, 1, 2, 3, 4}
    (a, ya), (at, _) = target_task(0)
    (b, _), _ = target_task(1)
    assert np.bincount(ya).tolist() == [50] * 5 and len(at) == 646
    assert not np.array_equal(a, b)
    assert np.array_equal(target_task(0)[0][0], a)
