"""Fresh state means fresh: a released element's update is a fresh optimizer's, step count included.

Each test trains with fixed gradients through ``FreezingOptimizer.apply``,
releases part of the model with ``Freezer.update`` after ``K`` steps, and
compares the released elements with an independent reference: a new inner
optimizer of the same class on copies of those elements, fed the same
gradients from the release on. Elements that trained all along are compared
with a plain optimizer that trained them from the first step.
"""

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import weights_of
from finefreeze._backends.questions import keras_backend

K, J = 7, 5  # steps before the release, steps after it


def model():
    keras.utils.set_random_seed(3)
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(5, name="a"), keras.layers.Dense(3, name="b")], name="m"
    )


PATHS = ["m/a/kernel", "m/a/bias", "m/b/kernel", "m/b/bias"]


def grads_for(variables, step):
    """The gradients of ``variables`` at ``step``: the same for a variable whatever else trains."""
    return [
        np.random.default_rng([step, PATHS.index(v.path)]).normal(size=tuple(v.shape)).astype("float32")
        for v in variables
    ]


def raw(v):
    return np.asarray(keras.ops.convert_to_numpy(v))


def train(frz, opt, m, steps, first):
    for s in range(first, first + steps):
        variables = frz.trainable_variables
        opt.apply([keras.ops.convert_to_tensor(g) for g in grads_for(variables, s)], variables)


def fresh_run(make, start_values, grads_by_step, iterations=0):
    """A new optimizer on copies of ``start_values``, fed ``grads_by_step``; the values after each step."""
    copies = [keras.Variable(v) for v in start_values]
    opt = make()
    opt.build(copies)
    if iterations:
        opt.iterations.assign(iterations)
    for gs in grads_by_step:
        opt.apply([keras.ops.convert_to_tensor(g) for g in gs], copies)
    return [raw(c) for c in copies]


def same(a, b, bound=0.0):
    """Bytes equal, or within ``bound`` ulps of the largest value (``MIXED_AGES``)."""
    a, b = np.asarray(a), np.asarray(b)
    if bound == 0.0:
        return np.array_equal(a, b) and a.dtype == b.dtype
    return a.dtype == b.dtype and np.max(np.abs(a - b)) <= bound * np.spacing(np.max(np.abs(b)))


# Elements of one variable released at different steps read a tensor of step
# counts: TensorFlow's vectorised power and PyTorch's per-variable update_step
# (in place of the fused torch._foreach one) round differently from a
# scalar count; every element of such a variable is concerned, also those
# trained from the first step. Measured after 5 steps (ulps of the largest
# value): Adam 6.75 (TensorFlow), 0.5 (PyTorch), 0 (JAX); Nadam 6 (TensorFlow),
# 1 (JAX), 16.9 (PyTorch). A variable whose trained elements share one count
# is bit for bit.
MIXED_AGES = 0.0 if keras_backend() == "jax" else 16.0
NADAM_MIXED_AGES = 64.0 if keras_backend() == "torch" else 16.0


def released_run(make, plan_before, plan_after, strategy="auto", step_count="release"):
    m = model()
    frz = ff.Freezer(m, plan_before, strategy=strategy)
    opt = frz.wrap(make(), step_count=step_count)
    opt.build(frz.trainable_variables)
    train(frz, opt, m, K, 0)
    at_release = [raw(v) for v in weights_of(m)]
    frz.update(plan_after)
    train(frz, opt, m, J, K)
    return m, frz, opt, at_release


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.Adam(0.05),
        lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1),
        lambda: keras.optimizers.Adamax(0.05),
        lambda: keras.optimizers.Lamb(0.05),
        lambda: keras.optimizers.Adafactor(0.05),
        lambda: keras.optimizers.Nadam(0.05),
        lambda: keras.optimizers.ScheduleFreeAdamW(0.05, warmup_steps=3),
    ],
    ids=["Adam", "AdamW", "Adamax", "Lamb", "Adafactor", "Nadam", "ScheduleFreeAdamW"],
)
@pytest.mark.slow
def test_a_released_layer_moves_as_under_a_fresh_optimizer(make):
    m, frz, opt, at_release = released_run(make, ff.Plan([ff.freeze("**/a/**")]), ff.Plan([]))
    a = weights_of(m)[:2]
    start = [raw(v) for v in model().weights if "/a/" in v.path]
    assert all(np.array_equal(s, x) for s, x in zip(start, at_release[:2]))  # frozen until the release
    want = fresh_run(make, start, [grads_for(weights_of(m), s)[:2] for s in range(K, K + J)])
    assert all(same(raw(v), w) for v, w in zip(a, want))
    b = weights_of(m)[2:]
    grads_b = [grads_for(weights_of(m), s)[2:] for s in range(K + J)]
    plain = fresh_run(make, [raw(v) for v in model().weights[2:]], grads_b)
    assert all(same(raw(v), w) for v, w in zip(b, plain))  # trained all along: Keras' own count
    assert [int(raw(e.born)) if e.born is not None else 0 for e in opt._enforcers] == [K, K, 0, 0]


@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("name", ["Adam", "Nadam"])
def test_released_elements_of_a_training_kernel_move_as_under_a_fresh_optimizer(strategy, name):
    make = lambda: getattr(keras.optimizers, name)(0.05)  # noqa: E731
    before = ff.Plan([ff.freeze("**/a/kernel[:, :3]"), ff.freeze("**/b/**")])
    after = ff.Plan([ff.freeze("**/a/kernel[:, :1]"), ff.freeze("**/b/**")])
    m, frz, opt, at_release = released_run(make, before, after, strategy=strategy)
    kernel = raw(weights_of(m)[0])
    start = raw(model().weights[0])
    grads = [grads_for(weights_of(m), s)[0] for s in range(K + J)]
    bound = MIXED_AGES if name == "Adam" else NADAM_MIXED_AGES
    released = fresh_run(make, [at_release[0][:, 1:3]], [[g[:, 1:3]] for g in grads[K:]])[0]
    assert same(kernel[:, 1:3], released, bound)
    all_along = fresh_run(make, [start[:, 3:]], [[g[:, 3:]] for g in grads])[0]
    assert same(kernel[:, 3:], all_along, bound)
    assert np.array_equal(kernel[:, :1], start[:, :1])
    frz.verify()
    born = raw(next(e.born for e in opt._enforcers if e.path.endswith("a/kernel")))
    trained = born if strategy == "compact" else born[:, 1:]  # compact: one per trained element
    assert sorted(set(trained.reshape(-1).tolist())) == [0, K]


def test_step_count_global_keeps_keras_count():
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    m, frz, opt, at_release = released_run(make, ff.Plan([ff.freeze("**/a/**")]), ff.Plan([]), step_count="global")
    start = [raw(v) for v in model().weights[:2]]
    grads = [grads_for(weights_of(m), s)[:2] for s in range(K, K + J)]
    keras_count = fresh_run(make, start, grads, iterations=K)
    assert all(same(raw(v), w) for v, w in zip(weights_of(m)[:2], keras_count))
    fresh = fresh_run(make, start, grads)
    assert not np.array_equal(raw(weights_of(m)[0]), fresh[0])
    assert all(e.born is None for e in opt._enforcers)


@pytest.mark.parametrize("make", [lambda: keras.optimizers.SGD(0.1, momentum=0.9), lambda: keras.optimizers.Lion()])
def test_optimizers_without_a_step_count_hold_nothing_more(make):
    m, frz, opt, _ = released_run(make, ff.Plan([ff.freeze("**/a/**")]), ff.Plan([]))
    assert all(e.born is None for e in opt._enforcers)
    assert not any(".born" in w.name for w in opt.variables)


def test_a_second_release_into_a_counted_kernel_is_written_in_place():
    make = lambda: keras.optimizers.Adam(0.05)  # noqa: E731
    plans = [ff.Plan([ff.freeze(f"**/a/kernel[:, :{n}]"), ff.freeze("**/b/**")]) for n in (4, 3, 2)]
    m = model()
    frz = ff.Freezer(m, plans[0], strategy="restore")
    opt = frz.wrap(make())
    opt.build(frz.trainable_variables)
    train(frz, opt, m, K, 0)
    frz.update(plans[1])
    assert frz.history[-1]["retraced"]  # the first release makes the step counts
    train(frz, opt, m, 2, K)
    at_second = raw(weights_of(m)[0])[:, 2:3]
    frz.update(plans[2])
    assert not frz.history[-1]["retraced"]  # later ones write into them
    train(frz, opt, m, J, K + 2)
    born = raw(next(e.born for e in opt._enforcers))
    assert born[:, 2].tolist() == [K + 2] * 6 and born[:, 3].tolist() == [K] * 6 and born[:, 4].tolist() == [0] * 6
    grads = [grads_for(weights_of(m), s)[0] for s in range(K + 2 + J)]
    # the column released second moves as a fresh optimizer from its own release
    released = fresh_run(make, [at_second], [[g[:, 2:3]] for g in grads[K + 2 :]])[0]
    assert same(raw(weights_of(m)[0])[:, 2:3], released, MIXED_AGES)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Adam", "Nadam"])
def test_release_steps_survive_a_checkpoint(tmp_path, name):
    make = lambda: getattr(keras.optimizers, name)(0.05)  # noqa: E731
    m, frz, opt, _ = released_run(make, ff.Plan([ff.freeze("**/a/**")]), ff.Plan([]))
    m.compile(optimizer=opt, loss="mse")
    m.save_weights(tmp_path / "w.weights.h5")
    train(frz, opt, m, 3, K + J)
    m2 = model()
    frz2 = ff.Freezer(m2, ff.Plan([ff.freeze("**/a/**")]))
    opt2 = frz2.wrap(make())
    m2.compile(optimizer=opt2, loss="mse")
    m2.load_weights(tmp_path / "w.weights.h5")
    train(frz2, opt2, m2, 3, K + J)
    assert [raw(w).tobytes() for w in weights_of(m)] == [raw(w).tobytes() for w in weights_of(m2)]
    assert [raw(w).tobytes() for w in opt.variables] == [raw(w).tobytes() for w in opt2.variables]
    assert [int(raw(e.born)) if e.born is not None else 0 for e in opt2._enforcers] == [K, K, 0, 0]
