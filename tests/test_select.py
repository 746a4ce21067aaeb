"""ff.select: each score's chosen set is the top-k of an independently computed score.

Its references take gradients with the backend's own autodiff
(``backend_utils.gradients``): it runs on every backend, but for tf.data and
TensorFlow's allocator statistics.
"""

import json

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import attention_model, gradients, weights_of
from conftest import mlp, weights
from finefreeze._select.select import split_budget

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

#: the small models here choose a handful of elements by count, which select warns about (a count of 1 to 100
#: looks like a percent); tests/test_select_budget.py tests the warning itself
pytestmark = pytest.mark.filterwarnings("ignore:select. budget=.* is a count:finefreeze.FreezeWarning")


def data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 5)).astype("float32"), rng.integers(0, 4, n).astype("int32")


def chosen(model, plan):
    """{path: bool mask of trainable elements} under ``plan``."""
    frz = ff.Freezer(model, plan)
    return {v.path: ~frz.frozen_mask(v.path) for v in weights_of(model)}


def reference_top_k(model, scores, k, skip=()):
    """Top-k over variables in model order, ties to the lower (variable, flat index), by a full sort."""
    flat, owner = [], []
    for v in weights_of(model):
        if v.path in skip:
            continue
        s = np.asarray(scores[v.path], np.float64).ravel()
        flat.append(s)
        owner += [(v.path, i) for i in range(s.size)]
    allv = np.concatenate(flat)
    order = np.lexsort((np.arange(allv.size), -allv))[:k]
    out = {v.path: np.zeros(v.shape, bool) for v in weights_of(model)}
    for j in order:
        path, i = owner[j]
        out[path].ravel()[i] = True
    return out


def grads(model, loss_fn):
    """float64 gradients of ``loss_fn()`` w.r.t. the model's weights (tape, jax.grad or backward)."""
    return [np.asarray(keras.ops.convert_to_numpy(g), np.float64) for g in gradients(loss_fn, weights_of(model))]


def per_example_fisher(model, x, y):
    out = {v.path: np.zeros(v.shape, np.float64) for v in weights_of(model)}
    for i in range(len(y)):
        for v, g in zip(weights_of(model), grads(model, lambda i=i: LOSS(y[i : i + 1], model(x[i : i + 1])))):
            out[v.path] += g**2
    return out


def batch_gradient(model, x, y, batch_size):
    out = {v.path: np.zeros(v.shape, np.float64) for v in weights_of(model)}
    for s in range(0, len(y), batch_size):
        sl = slice(s, s + batch_size)
        for v, g in zip(weights_of(model), grads(model, lambda sl=sl: LOSS(y[sl], model(x[sl])))):
            out[v.path] += np.abs(g)
    return out


def same(a, b):
    assert a.keys() == b.keys()
    for p in a:
        assert np.array_equal(a[p], b[p]), p


@pytest.mark.slow
@pytest.mark.parametrize(  # one example a microbatch: the loop (vectorized over one is the slowest way to say it)
    "per_microbatch, per_example", [(1, "loop"), (7, "vectorized"), (7, "loop"), (64, "vectorized"), (64, "loop")]
)
def test_fisher_is_top_k_of_summed_squared_per_example_gradients(per_microbatch, per_example):
    m = mlp()
    x, y = data()
    ref = reference_top_k(m, per_example_fisher(m, x, y), 17)
    plan = ff.select(
        m,
        (x, y),
        budget=17,
        score="fisher",
        loss=LOSS,
        options={"microbatch": per_microbatch, "per_example": per_example, "verbose": 0},
    )
    same(chosen(m, plan), ref)


@pytest.mark.slow
def test_fisher_on_attention_takes_examples_in_a_loop_and_matches_the_reference():
    m = attention_model()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(12, 6, 4)).astype("float32"), rng.integers(0, 4, 12).astype("int32")
    ref = reference_top_k(m, per_example_fisher(m, x, y), 25)
    same(chosen(m, ff.select(m, (x, y), budget=25, score="fisher", loss=LOSS, options={"verbose": 0})), ref)


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="a tf.data.Dataset")
def test_gradient_is_top_k_of_summed_absolute_batch_gradients_from_a_dataset():
    import tensorflow as tf

    m = mlp()
    x, y = data()
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    ref = reference_top_k(m, batch_gradient(m, x, y, 16), 20)
    m.compile(loss=LOSS)  # the compiled loss is the default
    same(chosen(m, ff.select(m, ds, budget=20, score="gradient", options={"verbose": 0})), ref)
    batches = [(x[s : s + 16], y[s : s + 16]) for s in range(0, 40, 16)]  # an iterable of batches
    same(chosen(m, ff.select(m, batches, budget=20, score="gradient", options={"verbose": 0})), ref)


@pytest.mark.parametrize("largest", [True, False])
def test_magnitude_largest_and_smallest(largest):
    m = mlp()
    mags = {v.path: np.abs(v.numpy()) * (1 if largest else -1) for v in weights_of(m)}
    plan = ff.select(m, budget=0.1, score="magnitude", options={"largest": largest})
    n = sum(int(np.prod(v.shape)) for v in weights_of(m))
    same(chosen(m, plan), reference_top_k(m, mags, int(np.floor(0.1 * n + 0.5))))


def test_delta_is_top_k_of_a_hand_written_fine_tune_and_resets_the_model_bit_exactly():
    m = mlp()
    x, y = data()
    before = weights(m)
    ref_model = mlp()
    ref_model.set_weights(m.get_weights())
    opt = keras.optimizers.Adam(1e-2)
    opt.build(weights_of(ref_model))
    for _ in range(2):
        for s in range(0, 40, 10):
            sl = slice(s, s + 10)
            g = gradients(lambda sl=sl: LOSS(y[sl], ref_model(x[sl], training=True)), weights_of(ref_model))
            opt.apply(g, weights_of(ref_model))
    moved = {
        v.path: np.abs(r.numpy().astype(np.float64) - v.numpy()) for v, r in zip(weights_of(m), weights_of(ref_model))
    }
    plan = ff.select(
        m,
        (x, y),
        budget=0.05,
        score="delta",
        loss=LOSS,
        batch_size=10,
        options={"epochs": 2, "optimizer": keras.optimizers.Adam(1e-2), "verbose": 0},
    )
    after = weights(m)
    for p in before:
        assert np.array_equal(before[p], after[p]), p
    n = sum(int(np.prod(v.shape)) for v in weights_of(m))
    same(chosen(m, plan), reference_top_k(m, moved, int(np.floor(0.05 * n + 0.5))))


def test_random_is_deterministic_for_a_seed_and_changes_with_it():
    m = mlp()
    a = chosen(m, ff.select(m, budget=30, score="random", options={"seed": 3}))
    b = chosen(m, ff.select(m, budget=30, score="random", options={"seed": 3}))
    c = chosen(m, ff.select(m, budget=30, score="random", options={"seed": 4}))
    same(a, b)
    assert sum(int(v.sum()) for v in a.values()) == 30
    assert any(not np.array_equal(a[p], c[p]) for p in a)


@pytest.mark.slow
def test_data_scores_are_deterministic():
    m = mlp()
    x, y = data()
    for score in ("fisher", "gradient", "delta"):
        a = ff.select(m, (x, y), budget=25, score=score, loss=LOSS, options={"verbose": 0})
        b = ff.select(m, (x, y), budget=25, score=score, loss=LOSS, options={"verbose": 0})
        same(chosen(m, a), chosen(m, b))


@pytest.mark.parametrize("budget", [1, 7, 0.013, 0.5, 1.0])
def test_budget_is_exact_for_counts_and_fractions(budget):
    m = mlp()
    n = sum(int(np.prod(v.shape)) for v in weights_of(m))
    want = budget if isinstance(budget, int) else max(1, int(np.floor(budget * n + 0.5)))
    for per_variable in (False, True):
        c = chosen(m, ff.select(m, budget=budget, score="random", spread="variable" if per_variable else "model"))
        assert sum(int(v.sum()) for v in c.values()) == want


def test_ties_go_to_the_earlier_variable_then_the_lower_index():
    m = mlp()
    for v in weights_of(m):
        v.assign(np.ones(v.shape, "float32"))
    c = chosen(m, ff.select(m, budget=45, score="magnitude"))
    first = weights_of(m)[0]  # dense_0/kernel: 5 x 8 = 40, then dense_0/bias
    assert c[first.path].all()
    assert np.array_equal(c[weights_of(m)[1].path], np.arange(8) < 5)
    assert sum(int(v.sum()) for v in c.values()) == 45


@pytest.mark.slow
def test_per_variable_quota_is_proportional_and_top_k_inside_each_variable():
    m = mlp()
    x, y = data()
    fisher = per_example_fisher(m, x, y)
    c = chosen(
        m, ff.select(m, (x, y), budget=0.25, score="fisher", loss=LOSS, spread="variable", options={"verbose": 0})
    )
    sizes = [int(np.prod(v.shape)) for v in weights_of(m)]
    k = int(np.floor(0.25 * sum(sizes) + 0.5))
    quotas = split_budget(k, sizes)
    assert sum(quotas) == k
    for v, q, n in zip(weights_of(m), quotas, sizes):
        assert abs(q - 0.25 * n) < 1
        order = np.lexsort((np.arange(n), -fisher[v.path].ravel()))[:q]
        want = np.zeros(n, bool)
        want[order] = True
        assert np.array_equal(c[v.path].ravel(), want), v.path


@pytest.mark.slow
def test_include_is_trained_in_full_and_exclude_is_never_chosen():
    m = mlp()
    x, y = data()
    plan = ff.select(
        m, (x, y), budget=10, score="fisher", loss=LOSS, include="**/head/**", exclude="**/bias", options={"verbose": 0}
    )
    c = chosen(m, plan)
    assert c["mlp/head/kernel"].all() and c["mlp/head/bias"].all()
    assert not c["mlp/dense_0/bias"].any() and not c["mlp/dense_1/bias"].any()
    assert int(c["mlp/dense_0/kernel"].sum() + c["mlp/dense_1/kernel"].sum()) == 10
    skip = {"mlp/head/kernel", "mlp/head/bias", "mlp/dense_0/bias", "mlp/dense_1/bias"}
    scores = {p: (-1.0 if p in skip else 1.0) * s for p, s in per_example_fisher(m, x, y).items()}
    ref = reference_top_k(m, scores, 10)
    for p in ("mlp/dense_0/kernel", "mlp/dense_1/kernel"):
        assert np.array_equal(c[p], ref[p]), p


@pytest.mark.slow
def test_the_plan_is_ordinary_summary_verify_delta_and_compact(tmp_path):
    m = mlp(units=(64, 64, 4))
    x, y = data()
    plan = ff.select(m, (x, y), budget=12, score="fisher", loss=LOSS, include="**/head/**", options={"verbose": 0})
    assert ff.Plan.from_dict(plan.to_dict()) == plan
    frz = ff.Freezer(m, plan, strategy="compact")
    before = weights(m)
    m.compile(optimizer=frz.wrap(keras.optimizers.AdamW(1e-2)), loss=LOSS)
    m.fit(x, y, epochs=2, batch_size=8, verbose=0)
    frz.verify()
    after = weights(m)
    for p, b in before.items():
        fm = frz.frozen_mask(p)
        assert np.array_equal(b[fm], after[p][fm]), p
    assert "partial" in frz.summary()
    n = sum(int(np.prod(v.shape)) for v in weights_of(m))
    trained = 12 + 64 * 4 + 4
    assert frz.report()["totals"]["trainable_elements"] == trained
    assert frz.save_delta(tmp_path / "d.safetensors")["bytes"] < 4 * n / 2
    state = sum(int(np.prod(v.shape)) for v in m.optimizer.variables)
    assert state <= 4 * trained + 8 < 2 * n  # Adam moments (and compact indices) of the trained values only


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0, "score": "random"}, "budget"),
        ({"budget": 1.5, "score": "random"}, "budget"),
        ({"budget": 10**6, "score": "random"}, "budget"),
        ({"budget": True, "score": "random"}, "budget"),
        ({"budget": 3, "score": "fischer"}, "unknown score"),
        ({"budget": 3, "score": "random", "include": "**/haed/**"}, "include="),
        ({"budget": 3, "score": "random", "exclude": "**"}, "no element is left"),
        ({"budget": 3, "score": "fisher"}, "needs data"),
        ({"budget": 3, "options": {"microbatch": 0}}, "microbatch"),
        ({"budget": 3, "score": "random", "options": {"per_example": "pfor"}}, "per_example"),
    ],
)
def test_bad_input_is_a_plan_error_and_changes_nothing(kwargs, match):
    m = mlp()
    before = weights(m)
    with pytest.raises(ff.PlanError, match=match):
        ff.select(m, **kwargs)
    after = weights(m)
    assert all(np.array_equal(before[p], after[p]) for p in before)


def test_bad_data_and_missing_loss_are_plan_errors():
    m = mlp()
    x, y = data()
    with pytest.raises(ff.PlanError, match="not compiled with a loss"):
        ff.select(m, (x, y), budget=3, options={"verbose": 0})
    with pytest.raises(ff.PlanError, match="different numbers of examples"):
        ff.select(m, (x, y[:5]), budget=3, loss=LOSS, options={"verbose": 0})
    with pytest.raises(ff.PlanError, match=r"\(x, y\)"):
        ff.select(m, [x], budget=3, loss=LOSS, options={"verbose": 0})
    with pytest.raises(ff.PlanError, match="no batches"):
        ff.select(m, [], budget=3, loss=LOSS, options={"verbose": 0})


STREAM_CHILD = """
import json, sys, tracemalloc
import keras, numpy as np, tensorflow as tf
import finefreeze as ff

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
layers = [keras.Input((256,))] + [keras.layers.Dense(512, activation="tanh", name=f"d{i}") for i in range(8)]
m = keras.Sequential(layers + [keras.layers.Dense(4, name="head")], name="wide")
copy = 4 * m.count_params()  # 7.9 MB
rng = np.random.default_rng(0)
out = {}
for n_batches in (2, 12):
    x = rng.normal(size=(32 * n_batches, 256)).astype("float32")
    y = rng.integers(0, 4, 32 * n_batches).astype("int32")
    tf.config.experimental.reset_memory_stats("CPU:0")
    base = tf.config.experimental.get_memory_info("CPU:0")["current"]
    tracemalloc.start()
    plan = ff.select(m, (x, y), budget=0.01, score="fisher", loss=LOSS, options={"microbatch": 4, "verbose": 0})
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    info = tf.config.experimental.get_memory_info("CPU:0")
    out[n_batches] = {
        "peak": (info["peak"] - base) / copy,
        "left": (info["current"] - base) / copy,
        "numpy": numpy_peak / copy,
        "rules": len(plan),
    }
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="TensorFlow's allocator statistics, in a child process")
def test_scores_stream_one_accumulator_per_element_whatever_the_number_of_batches():
    """TensorFlow's allocator and tracemalloc (numpy) peaks, in float32 copies of the model (4 P bytes).

    Measured in a child process on the TensorFlow backend, whatever the backend
    here: TensorFlow keeps allocator statistics for the CPU only with its
    oneDNN allocator on (``TF_ENABLE_ONEDNN_OPTS=1``), which the rest of the
    suite turns off.
    """
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parent.parent
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="1", PYTHONPATH=str(root / "src"), KERAS_BACKEND="tensorflow")
    got = subprocess.run([sys.executable, "-c", STREAM_CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    res = {int(k): v for k, v in json.loads(got.stdout.strip().splitlines()[-1]).items()}
    for r in res.values():
        assert r["left"] < 0.05  # the accumulators are released
        # the scores handed over one variable at a time, masks: 1 byte per element; a sampled kernel's trained
        # elements: their row and column (8 bytes each, 1 % of the elements: 0.02 copies)
        assert r["numpy"] < 2 + 0.02
        assert r["rules"] > 1
    # one accumulator, plus a microbatch of 4 per-example gradients at a time: never a batch of 32 of them,
    # and nothing that grows with the number of batches (12 batches kept would be 12 copies)
    assert res[12]["peak"] < res[2]["peak"] + 1  # (scheduling moves the peak by up to ~0.6 copy between runs)
    assert 1 <= res[2]["peak"] < 4 + 2


@pytest.mark.slow
def test_cli_finetune_select_writes_and_uses_the_selected_plan(tmp_path, capsys):
    from finefreeze._cli.commands import main

    out = tmp_path / "out"
    assert main(["finetune", "--select", "fisher", "--budget", "300", "--epochs", "1", "--out", str(out), "-q"]) == 0
    plan = ff.Plan.load(out / "selected-plan.json")
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["trainable_elements"] == 300
    assert repr(plan.rules[0]) == "freeze('**')"
    assert main(["finetune", "--select", "fisher", "--budget", "lots", "--out", str(tmp_path / "o2")]) == 2
    assert "--budget 'lots'" in capsys.readouterr().err


def test_large_masks_are_written_packed_and_read_back_exactly(tmp_path):
    m = mlp(units=(96, 64, 4), input_dim=80)  # kernels of 7,680 and 6,144 elements: packed
    plan = ff.select(m, budget=0.01, score="magnitude", include="**/head/**")
    d = plan.to_dict()
    packed = [r["mask"] for r in d["rules"] if isinstance(r.get("mask"), dict)]
    assert packed and all(set(p) == {"shape", "zpackbits"} for p in packed)  # 1 %: sparse, compressed too
    for suffix in (".json", ".toml", ".yaml"):
        plan.save(tmp_path / f"p{suffix}")
        back = ff.Plan.load(tmp_path / f"p{suffix}")
        assert back == plan
        for a, b in zip(plan.rules, back.rules):
            assert (a.mask is None and b.mask is None) or np.array_equal(a.mask, b.mask)
    assert (tmp_path / "p.json").stat().st_size < 2 * 7680 / 6 + 1000  # a list of bools: ~6 bytes per element
    dense = np.random.default_rng(0).random((96, 80)) < 0.5  # half the elements: packed, not compressed
    assert set(ff.Plan([ff.train("**/kernel", mask=dense)]).to_dict()["rules"][0]["mask"]) == {"shape", "packbits"}
    small = ff.Plan([ff.train("**/head/bias", mask=np.array([True, False, True, False]))]).to_dict()
    assert small["rules"][0]["mask"] == [True, False, True, False]  # small masks stay readable
    frz = ff.Freezer(m, plan)
    assert frz.save_delta(tmp_path / "d.safetensors")["bytes"] < 12_000


@pytest.mark.parametrize(
    "mask, match",
    [
        ({"shape": [9000], "packbits": "!!"}, "base64"),
        ({"shape": [9000], "packbits": "AAAA"}, "needs 1125 bytes"),
        ({"shape": [90, -1], "packbits": ""}, "shape"),
        ({"shape": [9000]}, "exactly 'shape' and 'packbits'"),
        ({"shape": [9000], "zpackbits": "AAAA"}, "base64 of zlib data"),
    ],
)
def test_a_malformed_packed_mask_is_a_plan_error(mask, match):
    """Each malformed form is refused by name (the bits of a packed mask, or the zlib data of a compressed one)."""
    with pytest.raises(ff.PlanError, match=match):
        ff.Plan.from_dict({"rules": [{"train": "**/kernel", "mask": mask}]})


def test_data_that_does_not_fit_the_model_is_a_plan_error():
    m = mlp(units=(8, 4), input_dim=6)
    x, y = np.ones((16, 3), "float32"), np.zeros(16, "int32")  # 3 features for a model of 6
    with pytest.raises(ff.PlanError, match="select: the data does not fit the model"):
        ff.select(m, (x, y), budget=3, loss=LOSS, options={"verbose": 0})


@pytest.mark.slow
def test_numpy_integers_are_counts_and_microbatch_auto_is_checked():
    """``batch_size=np.int64(4)`` is a count like 4; a microbatch that is neither a count nor "auto" is refused."""
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a")], name="n")
    x, y = np.random.default_rng(0).normal(size=(8, 4)), np.random.default_rng(1).normal(size=(8, 3))
    a = ff.select(
        m, (x, y), budget=2, loss="mse", batch_size=np.int64(4), options={"microbatch": np.int32(2), "verbose": 0}
    )
    b = ff.select(m, (x, y), budget=2, loss="mse", batch_size=4, options={"microbatch": 2, "verbose": 0})
    assert [r.to_dict() for r in a.rules] == [r.to_dict() for r in b.rules]
    for bad in (0, "AUTO", 2.0, [1]):
        with pytest.raises(ff.PlanError, match=r"options\['microbatch'\] must be an int >= 1 or \"auto\""):
            ff.select(m, (x, y), budget=2, loss="mse", options={"microbatch": bad, "verbose": 0})


def gemma_lm():
    from causal_lms import task

    return task("gemma", preprocessor=False)


def counts_by(chosen_masks, key):
    out = {}
    for path, m in chosen_masks.items():
        out[key(path)] = out.get(key(path), 0) + int(m.sum())
    return out


def test_spread_kind_gives_each_kind_of_projection_its_share_and_excluding_the_table_keeps_it_out():
    lm = gemma_lm()
    plan = ff.select(lm, budget=0.1, score="random", exclude="**/token_embedding/**", spread="kind")
    got = chosen(lm, plan)
    assert not got.get("token_embedding/embeddings", np.zeros(1)).any()
    kinds = counts_by(got, lambda p: p.split("/", 1)[1] if p.startswith("decoder_block_") else p)
    sizes = counts_by({v.path: np.ones(v.shape, bool) for v in weights_of(lm) if "token_embedding" not in v.path},
                      lambda p: p.split("/", 1)[1] if p.startswith("decoder_block_") else p)  # fmt: skip
    k = int(np.floor(0.1 * sum(sizes.values()) + 0.5))
    assert sum(kinds.values()) == k
    for kind, n in sizes.items():  # a quota per kind in proportion to its size (largest remainders)
        assert abs(kinds.get(kind, 0) - 0.1 * n) < 1, (kind, kinds.get(kind), n)


def test_spread_block_gives_each_block_its_share():
    lm = gemma_lm()
    got = chosen(lm, ff.select(lm, budget=0.2, score="magnitude", exclude="**/token_embedding/**", spread="block"))
    per_block = counts_by(got, lambda p: p.split("/")[0])
    n = {b: sum(int(np.prod(v.shape)) for v in weights_of(lm) if v.path.startswith(b + "/")) for b in per_block}
    for b in ("decoder_block_0", "decoder_block_1"):
        assert abs(per_block[b] - 0.2 * n[b]) < 1


def test_spread_as_shares_of_the_budget_per_selector():
    lm = gemma_lm()
    plan = ff.select(lm, budget=100, score="random", spread={"**/attention/**": 3, "**/ffw_*/**": 1})
    got = chosen(lm, plan)
    attention = sum(int(m.sum()) for p, m in got.items() if "/attention/" in p)
    ffw = sum(int(m.sum()) for p, m in got.items() if "/ffw_" in p)
    assert (attention, ffw) == (75, 25) and sum(int(m.sum()) for m in got.values()) == 100


@pytest.mark.parametrize(
    "spread, match",
    [
        ("layers", "spread='layers'; choose one of 'model', 'variable', 'kind', 'block'"),
        ({"**/nothing/**": 1}, r"spread's selector '\*\*/nothing/\*\*' selects no variable of the model"),
        ({"**/attention/**": 1, "**/attention/query/**": 1}, "picks no candidate"),
        ({"**/attention/**": 0}, "a share is a number > 0"),
        ({"**/attention/query/**": 1, "**/ffw_*/**": 1000}, "but it has .* candidates"),
    ],
)
def test_a_bad_spread_is_a_plan_error_before_any_score(spread, match):
    with pytest.raises(ff.PlanError, match=match):
        ff.select(gemma_lm(), budget=0.5, score="random", spread=spread)
