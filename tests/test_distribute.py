"""tf.distribute: MirroredStrategy over logical CPUs and MultiWorkerMirroredStrategy over loopback."""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import finefreeze as ff
from backend_utils import weights_of
from conftest import N_LOGICAL_CPUS
from finefreeze._backends.distribute import replica_values

pytestmark = pytest.mark.backends("tensorflow", reason="tf.distribute strategies")

PLAN = ff.Plan([ff.freeze("**/a/kernel[:2]"), ff.freeze("**/b/bias"), ff.train("**/b/bias[1]")])
X = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
Y = np.random.default_rng(1).normal(size=(64, 2)).astype("float32")


_MIRRORED = {}


def mirrored(n=2):
    """One MirroredStrategy per replica count and process: TensorFlow's collective
    instance keys collide between strategies that run collectives in one process."""
    assert n <= N_LOGICAL_CPUS
    if n not in _MIRRORED:
        devices = [f"/cpu:{i}" for i in range(n)]
        # the 2-replica strategy uses the default (collective) all-reduce; a second
        # collective group of another size in the same process would share its group key
        ops = None if n == 2 else tf.distribute.ReductionToOneDevice()
        _MIRRORED[n] = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
    return _MIRRORED[n]


def make(plan=PLAN, strategy="restore", opt=None, policy="float32", gradients="dense", inputs=5, units=8):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    m = keras.Sequential(
        [keras.Input((inputs,)), keras.layers.Dense(units, name="a"), keras.layers.Dense(2, name="b", dtype="float32")],
        name="net",
    )
    frz = ff.Freezer(m, plan, strategy=strategy, gradients=gradients)
    m.compile(optimizer=frz.wrap(opt() if opt else keras.optimizers.AdamW(0.05, weight_decay=0.1)), loss="mse")
    return m, frz


def check_replicas(model, frz, before):
    """Frozen elements bit-identical on every replica; every replica identical to the first."""
    for v in weights_of(model):
        copies = replica_values(v)
        assert len(copies) > 1, v.path
        frozen = frz.frozen_mask(v.path)
        for c in copies:
            assert np.array_equal(c.view(np.uint8), copies[0].view(np.uint8)), v.path
            assert np.array_equal(c[frozen], before[v.path][frozen]), v.path
    frz.verify()


VARIANTS = {
    "adamw": (lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1), "float32", 1e-5),
    "ema_finalize": (lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1, use_ema=True), "float32", 1e-5),
    "mixed_float16": (lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1), "mixed_float16", 2e-2),
    # Keras clips each replica's gradient before the all-reduce, so these do not
    # follow a one-device run; replicas must still agree and stay exact.
    "clipnorm": (lambda: keras.optimizers.Adam(0.05, clipnorm=0.5), "float32", None),
    "global_clipnorm": (lambda: keras.optimizers.Adam(0.05, global_clipnorm=0.5), "float32", None),
    "schedule": (
        lambda: keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 2, 0.5), momentum=0.9),
        "float32",
        1e-5,
    ),
    "bfloat16": (lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1), "mixed_bfloat16", 5e-2),
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
@pytest.mark.parametrize("variant", VARIANTS.keys())
def test_mirrored_fit_is_exact_on_every_replica_and_matches_one_device(strategy, variant):
    opt, policy, tol = VARIANTS[variant]
    with mirrored().scope():
        model, frz = make(strategy=strategy, opt=opt, policy=policy)
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    check_replicas(model, frz, before)
    assert not np.array_equal(before["net/a/kernel"][2:], model.get_layer("a").kernel.numpy()[2:])
    if tol is not None:  # trainable elements follow a one-device run on the same global batch
        single, _ = make(strategy=strategy, opt=opt, policy=policy)
        single.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        for a, b in zip(weights_of(model), weights_of(single)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=tol, atol=tol, err_msg=a.path)


@pytest.mark.slow
def test_mirrored_fit_of_a_sliced_kernel_is_exact_on_every_replica_and_matches_one_device():
    sliced = ff.Plan([ff.freeze("**/a/kernel"), ff.train("**/a/kernel[:, 6:]")])
    with mirrored().scope():
        model, frz = make(plan=sliced, strategy="auto", gradients="sliced")
    assert "_finefreeze_sliced" in model.get_layer("a").__dict__  # the slice's own weight gradient
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    model.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    check_replicas(model, frz, before)
    single, _ = make(plan=sliced, strategy="auto", gradients="sliced")
    single.fit(X, Y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(weights_of(model), weights_of(single)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=a.path)


def test_mirrored_fit_of_sampled_elements_is_exact_on_every_replica_and_matches_the_dense_path_on_one_device():
    """Scattered trained elements get the sampled product; its kernel-shaped gradient all-reduces like a dense one."""
    n = 256  # one trained element in every row and column of a 256 x 256 kernel: no block holds them
    rng = np.random.default_rng(4)
    x, y = rng.normal(size=(64, n)).astype("float32"), rng.normal(size=(64, 2)).astype("float32")
    scattered = np.eye(n, dtype=bool)[rng.permutation(n)]
    plan = ff.Plan([ff.freeze("**/a/kernel"), ff.train("**/a/kernel", mask=scattered)])
    sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)  # noqa: E731  (Adam would hide a gradient's scale)
    with mirrored().scope():
        model, frz = make(plan=plan, strategy="auto", opt=sgd, gradients="sliced", inputs=n, units=n)
    kinds = {v["path"]: (v["gradient"], v["strategy"]) for v in frz.report()["variables"]}
    assert kinds["net/a/kernel"] == ("sampled", "compact"), kinds
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    check_replicas(model, frz, before)
    moved = model.get_layer("a").kernel.numpy() != before["net/a/kernel"]
    assert moved.sum() == n and not moved[frz.frozen_mask("net/a/kernel")].any()
    single, _ = make(plan=plan, strategy="auto", opt=sgd, gradients="dense", inputs=n, units=n)
    single.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    for a, b in zip(weights_of(model), weights_of(single)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5, err_msg=a.path)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_mirrored_custom_loop_matches_one_device(strategy):
    def run(dist):
        scope = dist.scope() if dist else tf.distribute.get_strategy().scope()
        with scope:
            model, frz = make(strategy=strategy)
            opt = model.optimizer
            opt.build(frz.trainable_variables)
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(16)

        def step(x, y):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(y, model(x, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=16)
            grads = tape.gradient(loss, frz.trainable_variables)
            opt.apply_gradients(zip(grads, frz.trainable_variables))

        before = {v.path: v.numpy().copy() for v in weights_of(model)}
        if dist:
            fn = tf.function(lambda x, y: dist.run(step, args=(x, y)))
            for x, y in dist.experimental_distribute_dataset(ds):
                fn(x, y)
        else:
            fn = tf.function(step)
            for x, y in ds:
                fn(x, y)
        return model, frz, before

    model, frz, before = run(mirrored())
    check_replicas(model, frz, before)
    single, _, _ = run(None)
    for a, b in zip(weights_of(model), weights_of(single)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6, err_msg=a.path)


class MeanVar(keras.layers.Layer):
    """A layer whose weight averages across replicas on replica-context writes."""

    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], 4), initializer="glorot_uniform", name="w", aggregation="mean")

    def call(self, x):
        return x @ self.w


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_mean_aggregated_variable_partially_frozen_over_three_replicas_stays_exact(strategy):
    with mirrored(3).scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), MeanVar(name="mv")], name="net")
        assert model.get_layer("mv").w.aggregation == "mean"
        frz = ff.Freezer(model, ff.Plan([ff.freeze("**/mv/w"), ff.train("**/mv/w[1:3, ::2]")]), strategy=strategy)
        model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.3, weight_decay=0.1)), loss="mse")
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    y = np.random.default_rng(2).normal(size=(64, 4)).astype("float32") * 3.3
    model.fit(X, y, batch_size=24, epochs=3, verbose=0)  # 8 per replica
    check_replicas(model, frz, before)
    assert not np.array_equal(before["net/mv/w"][1:3, ::2], model.get_layer("mv").w.numpy()[1:3, ::2])


@pytest.mark.slow
def test_update_under_mirrored_strategy():
    strategy = mirrored()
    with strategy.scope():
        model, frz = make()
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    frz.update(ff.Plan([ff.freeze("**/b/**"), ff.freeze("**/a/kernel[3:]")]))
    before = {v.path: v.numpy().copy() for v in weights_of(model)}
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    check_replicas(model, frz, before)
    assert not np.array_equal(before["net/a/kernel"][:3], model.get_layer("a").kernel.numpy()[:3])


def test_verify_names_a_replica_whose_frozen_copy_differs():
    with mirrored().scope():
        model, frz = make()
    k = model.get_layer("b").bias.value
    copy = k.values[1]
    copy.assign(copy.numpy() + 1.0)  # replica 1 only
    with pytest.raises(ff.FrozenValueChanged, match="on replica 1"):
        frz.verify()


def test_freezer_outside_the_scope_is_a_clear_error_and_changes_nothing():
    strategy = mirrored()
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="a")], name="net")
    flags = [v.trainable for v in weights_of(model)]
    with pytest.raises(ff.DistributionError, match=r"outside its scope.*MirroredStrategy.*strategy.scope\(\)"):
        ff.Freezer(model, ff.Plan([ff.freeze("**/a/bias")]))
    assert [v.trainable for v in weights_of(model)] == flags
    other = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # never runs a step
    with other.scope(), pytest.raises(ff.DistributionError, match="in the scope of another MirroredStrategy"):
        ff.Freezer(model, ff.Plan([ff.freeze("**/a/bias")]))
    with strategy.scope():
        frz = ff.Freezer(model, ff.Plan([ff.freeze("**/a/bias")]))
    outside = keras.optimizers.Adam()
    with strategy.scope(), pytest.raises(ff.DistributionError, match="optimizer Adam was created outside"):
        frz.wrap(outside)
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, name="a")], name="plain")
    with strategy.scope(), pytest.raises(ff.DistributionError, match="were created outside it"):
        ff.Freezer(plain, ff.Plan([ff.freeze("**/a/bias")]))


def test_nested_scopes_of_two_strategies_fail_at_the_nesting_before_anything_is_built():
    other = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # never runs a step
    with mirrored().scope():
        with pytest.raises(RuntimeError, match="Mixing different tf.distribute.Strategy objects"):
            with other.scope():
                pass  # TensorFlow refuses here: no Freezer can be created half-nested


def test_summary_and_report_on_distributed_variables():
    with mirrored().scope():
        model, frz = make()
    rep = frz.report()
    assert rep["totals"]["frozen_elements"] == 2 * 8 + 1
    assert "partial" in frz.summary()


def free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["restore", "compact"])
def test_multiworker_mirrored_two_processes_agree(tmp_path, strategy):
    ports = free_ports(2)
    cluster = {"worker": [f"localhost:{p}" for p in ports]}
    worker = os.path.join(os.path.dirname(__file__), "multiworker_worker.py")
    procs, outs = [], []
    try:
        for i in range(2):
            env = dict(
                os.environ,
                TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}),
                TF_CPP_MIN_LOG_LEVEL="3",
                FF_STRATEGY=strategy,
                CUDA_VISIBLE_DEVICES="",
            )
            out = tmp_path / f"worker{i}.json"
            outs.append(out)
            log = open(tmp_path / f"worker{i}.log", "w")
            procs.append(subprocess.Popen([sys.executable, worker, str(out)], env=env, stdout=log, stderr=log))
        deadline = time.monotonic() + 240
        for p in procs:
            p.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = "\n".join((tmp_path / f"worker{i}.log").read_text()[-2000:] for i in range(2))
    assert all(p.returncode == 0 for p in procs), logs
    reports = [json.loads(o.read_text()) for o in outs]
    assert [r["task"] for r in reports] == [0, 1]
    assert all(r["frozen_ok"] and r["trained"] for r in reports)
    assert reports[0]["weights_sha256"] == reports[1]["weights_sha256"]
    assert reports[0]["fingerprint"] == reports[1]["fingerprint"]
    assert reports[0]["totals"] == reports[1]["totals"]
    assert reports[0]["iterations"] == reports[1]["iterations"] == 8


def test_freezeboard_under_mirrored_strategy(tmp_path):
    with mirrored().scope():
        model, frz = make()
    board = ff.callbacks.FreezeBoard(tmp_path)
    model.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[board])
    trainable, frozen = board.last_gradient_norms
    assert trainable > 0 and frozen > 0  # a/kernel[:2] and b/bias[0] get gradients the plan blocks
    frz.verify()
