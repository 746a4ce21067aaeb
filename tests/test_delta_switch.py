"""Many tasks on one base: DeltaSwitch (in place, bit for bit, all or nothing) and merge_deltas."""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest

import finefreeze as ff
from backend_utils import BACKEND, shares_its_buffer

VOCAB, NEW = 20, 4  # the base's table has VOCAB rows; tasks may train NEW more at its end

PLANS = {  # five tasks, five kinds of trained element sets
    "rows": [ff.freeze("**"), ff.train(f"**/tokens/embeddings[{VOCAB}:]"), ff.train("**/head/**")],
    "scattered": [
        ff.freeze("**"),
        ff.train("**/mid/kernel", where=lambda w: (np.arange(w.size) % 7 == 0).reshape(w.shape)),
    ],
    "columns": [ff.freeze("**"), ff.train("**/mid/kernel[:, 0:3]"), ff.train("**/mid/bias")],
    "head": [ff.freeze("**"), ff.train("**/head/**")],
    "corner": [ff.freeze("**"), ff.train("**/mid/kernel[0:2, 5:8]"), ff.train("**/tokens/embeddings[0]")],
}


def base_model():
    keras.utils.set_random_seed(7)
    ids = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(VOCAB + NEW, 8, name="tokens")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(12, activation="relu", name="mid")(h)
    return keras.Model(ids, keras.layers.Dense(3, name="head")(h), name="net")


def data(n=48):
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB + NEW, size=(n, 6)).astype("int32"), rng.integers(0, 3, size=n)


def values(model):
    return [np.array(w.numpy(), copy=True) for w in model.weights]


def same(model, want):
    return all(np.array_equal(w.numpy(), v) for w, v in zip(model.weights, want))


@pytest.fixture(scope="module")
def deltas(tmp_path_factory):
    """One delta per plan, each trained from the same base (``gradients="sliced"`` for the column task)."""
    root = tmp_path_factory.mktemp("deltas")
    x, y = data()
    out = {}
    for name, rules in PLANS.items():
        model = base_model()
        frz = ff.Freezer(model, ff.Plan(rules), gradients="sliced" if name == "columns" else "auto")
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=frz.wrap(keras.optimizers.AdamW(0.05)), loss=loss)
        model.fit(x, y, epochs=2, batch_size=16, verbose=0)
        out[name] = str(root / f"{name}.safetensors")
        frz.save_delta(out[name])
    return out


@pytest.fixture(scope="module")
def loaded(deltas):
    """What a fresh load_delta of each delta onto the base gives."""
    out = {}
    for name, path in deltas.items():
        model = base_model()
        ff.load_delta(model, path)
        out[name] = values(model)
    return out


@pytest.mark.slow
def test_switching_gives_each_delta_as_load_delta_does_and_the_base_back(deltas, loaded):
    model = base_model()
    base = values(model)
    switch = ff.DeltaSwitch(model, deltas)
    assert switch.active is None and switch.names == tuple(PLANS)
    for name in [*PLANS, "rows", None, "head", "head", "scattered", None, None, "corner"]:
        got = switch.use(name)
        assert switch.active == name and got["active"] == name
        assert same(model, base if name is None else loaded[name]), name
    switch.use(None)
    assert same(model, base)
    assert all(not same(model, loaded[n]) for n in PLANS)  # each delta changes something


@pytest.mark.skipif(BACKEND != "tensorflow", reason="copy-on-read is TensorFlow's runtime mode")
def test_after_a_switch_whole_reads_of_the_written_variables_are_not_copies(deltas):
    """A switch reads and writes elements (sparse ops); the next forward pass must not copy each variable it reads."""
    model = base_model()
    switch = ff.DeltaSwitch(model, deltas)
    for name in [*PLANS, None]:
        switch.use(name)
        assert all(shares_its_buffer(v) for v in model.weights), name
        switch.verify()  # reads the active delta's elements only
        assert all(shares_its_buffer(v) for v in model.weights), name


@pytest.mark.slow
def test_two_thousand_random_switches_then_the_base_bit_for_bit(deltas, loaded):
    model = base_model()
    base = values(model)
    switch = ff.DeltaSwitch(model, deltas)
    names = [None, *PLANS]
    rng = np.random.default_rng(1)
    for step in range(2_000):
        name = names[rng.integers(len(names))]
        switch.use(name)
        assert same(model, base if name is None else loaded[name]), (step, name)
    switch.use(None)
    assert same(model, base)


def test_a_delta_of_another_base_is_refused_up_front_and_nothing_changes(deltas, tmp_path):
    model = base_model()
    ff.load_delta(model, deltas["corner"])  # not the base any more: its corner elements moved
    before = values(model)
    with pytest.raises(ff.DeltaError, match=r"delta 'scattered'.*'tokens/embeddings'.*fingerprint mismatch"):
        ff.DeltaSwitch(model, {"corner": deltas["corner"], "scattered": deltas["scattered"]})
    assert same(model, before)
    damaged = tmp_path / "d.safetensors"
    damaged.write_bytes(open(deltas["head"], "rb").read()[:-3])
    with pytest.raises(ff.DeltaError, match="damaged or truncated"):
        ff.DeltaSwitch(base_model(), {"head": deltas["head"], "bad": damaged})


@pytest.mark.parametrize(
    "deltas_arg, message",
    [
        ({}, "deltas is a dict of name -> delta file"),
        (["a.safetensors"], "deltas is a dict"),
        ({None: "x"}, "names are non-empty strings"),
    ],
)
def test_bad_arguments_are_delta_errors(deltas_arg, message):
    with pytest.raises(ff.DeltaError, match=message):
        ff.DeltaSwitch(base_model(), deltas_arg)


def test_an_unknown_name_and_a_model_changed_behind_the_switch_change_nothing(deltas, loaded):
    model = base_model()
    switch = ff.DeltaSwitch(model, {"rows": deltas["rows"], "head": deltas["head"]})
    switch.use("rows")
    with pytest.raises(ff.DeltaError, match=r"no delta named 'columns'; this switch holds 'rows', 'head'"):
        switch.use("columns")
    assert switch.active == "rows" and same(model, loaded["rows"])
    head = model.get_layer("head").kernel
    head.assign(head.numpy() + 1.0)  # someone trains or assigns behind the switch's back
    changed = values(model)
    with pytest.raises(
        ff.DeltaError, match=r"'head/kernel' no longer holds the values of delta 'rows'.*Nothing was changed"
    ):
        switch.use("head")
    assert switch.active == "rows" and same(model, changed)


class FailingVariable(keras.Variable):
    """A variable whose whole-value writes fail, as a read-only store would."""

    fail = False

    def assign(self, value):
        if self.fail:
            raise RuntimeError("this store is read-only")
        return super().assign(value)


def test_a_failing_write_leaves_the_active_delta_in(tmp_path):
    a = keras.Variable(np.zeros((4, 4), "float32"), name="a")
    b = FailingVariable(np.zeros(3, "float32"), name="b")
    paths = {}
    for name, rows in {"one": slice(0, 1), "two": slice(1, 3)}.items():
        va, vb = keras.Variable(np.zeros((4, 4), "float32"), name="a"), keras.Variable(np.zeros(3, "float32"), name="b")
        frz = ff.Freezer([va, vb], ff.Plan([ff.freeze("a"), ff.train(f"a[{rows.start}:{rows.stop}]"), ff.train("b")]))
        new = np.zeros((4, 4), "float32")
        new[rows] = 1.0 if name == "one" else 2.0
        va.assign(new)
        vb.assign(np.full(3, 5.0, "float32"))
        paths[name] = tmp_path / f"{name}.safetensors"
        frz.save_delta(paths[name])
    switch = ff.DeltaSwitch([a, b], paths)
    switch.use("one")
    one = [a.numpy().copy(), b.numpy().copy()]
    b.fail = True
    with pytest.raises(
        ff.DeltaError, match=r"writing 'b' failed \(RuntimeError: this store is read-only\).*holds 'one'"
    ):
        switch.use("two")
    assert switch.active == "one"
    assert np.array_equal(a.numpy(), one[0]) and np.array_equal(b.numpy(), one[1])
    b.fail = False
    switch.use(None)
    assert not a.numpy().any() and not b.numpy().any()


def test_merged_deltas_apply_as_each_of_them(deltas, loaded, tmp_path):
    merged = tmp_path / "merged.safetensors"
    info = ff.merge_deltas([deltas["scattered"], deltas["rows"]], merged)
    model = base_model()
    base = values(model)
    ff.load_delta(model, merged)
    for w, b, s, r in zip(model.weights, base, loaded["scattered"], loaded["rows"]):
        want = np.where(s != b, s, r)  # each element from the delta that wrote it
        assert np.array_equal(w.numpy(), want), w.path
    switch = ff.DeltaSwitch(base_model(), {"both": merged, "head": deltas["head"]})
    assert info["elements"] == switch.elements("both") > 0
    other = base_model()
    ff.load_delta(other, deltas["corner"])
    with pytest.raises(ff.DeltaError, match="fingerprint mismatch"):  # every merged delta's check of the base holds
        ff.load_delta(other, merged)


def test_overlapping_deltas_are_named_and_nothing_is_written(deltas, tmp_path):
    out = tmp_path / "m.safetensors"
    with pytest.raises(ff.DeltaError, match=r"both write 'head/kernel' \(shape \(12, 3\)\) at \(0, 0\), \(0, 1\)"):
        ff.merge_deltas([deltas["rows"], deltas["scattered"], deltas["head"]], out)
    assert not out.exists()
    with pytest.raises(ff.DeltaError, match="is one of the deltas to merge"):
        ff.merge_deltas([deltas["rows"], deltas["head"]], deltas["rows"])
    with pytest.raises(ff.DeltaError, match="two or more"):
        ff.merge_deltas([deltas["rows"]], out)


def test_deltas_of_different_bases_do_not_merge(deltas, tmp_path):
    keras.utils.set_random_seed(8)
    other = base_model()
    keras.utils.set_random_seed(99)
    for w in other.weights:
        w.assign(np.random.default_rng(3).normal(size=w.shape).astype(w.dtype))
    frz = ff.Freezer(other, ff.Plan(PLANS["head"]))
    frz.save_delta(tmp_path / "other.safetensors")
    with pytest.raises(ff.DeltaError, match="different bases"):
        ff.merge_deltas([deltas["scattered"], tmp_path / "other.safetensors"], tmp_path / "m.safetensors")


def test_the_same_delta_is_the_same_bytes(deltas, tmp_path):
    model = base_model()
    ff.load_delta(model, deltas["columns"])
    frz = ff.Freezer(model, ff.Plan(PLANS["columns"]))
    frz.save_delta(tmp_path / "a.safetensors")
    frz.save_delta(tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    code = (
        "import sys, safetensors.numpy as s; t = s.load_file(sys.argv[1]); "
        "from safetensors import safe_open; m = safe_open(sys.argv[1], 'np').metadata(); print(sorted(t), sorted(m))"
    )
    got = subprocess.run([sys.executable, "-c", code, str(tmp_path / "a.safetensors")], capture_output=True, text=True)
    assert got.returncode == 0 and "::values" in got.stdout and "checksum" in got.stdout, (
        got.stderr
    )  # safetensors reads it


def test_a_merged_file_has_the_one_format_with_every_check_and_about_the_size_of_its_parts(deltas, tmp_path):
    merged = tmp_path / "m.safetensors"
    ff.merge_deltas([deltas["scattered"], deltas["rows"]], merged)
    from safetensors import safe_open

    with safe_open(str(merged), "np") as f:
        assert f.metadata()["format"] == "finefreeze.delta/1"
        checks = [len(v["checks"]) for v in json.loads(f.metadata()["variables"]).values() if "checks" in v]
    assert checks and max(checks) == 2  # a variable both deltas check keeps both checks
    assert os.path.getsize(merged) < os.path.getsize(deltas["scattered"]) + os.path.getsize(deltas["rows"]) + 4096


def test_verify_finds_what_was_written_outside_the_active_delta(deltas, loaded):
    model = base_model()
    switch = ff.DeltaSwitch(model, {"rows": deltas["rows"], "columns": deltas["columns"]})
    switch.verify()
    switch.use("columns")
    switch.verify()  # the base, with columns in: nothing else moved
    mid = model.get_layer("mid").kernel
    mid.assign(mid.numpy() * 1.0)  # the same values: still the base
    switch.verify()
    tokens = model.get_layer("tokens").embeddings
    tokens.assign(tokens.numpy() + 1.0)  # outside the columns delta: use() cannot see it, verify() does
    with pytest.raises(ff.DeltaError, match=r"1 variable\(s\) differ from the base with delta 'columns': 'tokens/"):
        switch.verify()


def test_merging_in_another_order_writes_the_same_bytes(deltas, tmp_path):
    ff.merge_deltas([deltas["rows"], deltas["columns"], deltas["corner"]], tmp_path / "a.safetensors")
    ff.merge_deltas([deltas["corner"], deltas["rows"], deltas["columns"]], tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: ff.DeltaSwitch("base.keras", {"a": d["rows"]}), "not a path"),
        (lambda d: ff.DeltaSwitch(base_model(), {"a": None}), "delta 'a' is None; give the path"),
        (lambda d: ff.DeltaSwitch(base_model(), {"": d["rows"]}), "non-empty strings"),
        (lambda d: ff.DeltaSwitch(base_model(), {"a": d["rows"]}).use(["a"]), r"no delta named \['a'\]"),
        (lambda d: ff.DeltaSwitch(base_model(), {"a": "nope.safetensors"}), "delta 'a': delta file 'nope.safetensors'"),
        (lambda d: ff.merge_deltas(d["rows"], "x.safetensors"), "got one path"),
        (lambda d: ff.merge_deltas([d["rows"], d["head"]], "nodir/x.safetensors"), "folder of out_path"),
    ],
)
def test_wrong_arguments_are_one_delta_error(deltas, make, message):
    with pytest.raises(ff.DeltaError, match=message):
        make(deltas)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_deltas_switch_bit_for_bit(dtype, tmp_path):
    def model():
        keras.utils.set_random_seed(5)
        layer = keras.layers.Dense(6, name="d", dtype=dtype)
        net = keras.Sequential([keras.Input((4,)), layer], name="h")
        return net, layer

    tuned, layer = model()
    frz = ff.Freezer(tuned, ff.Plan([ff.freeze("**"), ff.train("**/d/kernel[:, 1:3]")]))
    kernel = keras.ops.convert_to_numpy(layer.kernel)
    moved = kernel.copy()
    moved[:, 1:3] += np.asarray(0.5, dtype=kernel.dtype)
    layer.kernel.assign(moved)
    frz.save_delta(tmp_path / "d.safetensors")
    base, base_layer = model()
    switch = ff.DeltaSwitch(base, {"t": tmp_path / "d.safetensors"})
    switch.use("t")
    assert keras.ops.convert_to_numpy(base_layer.kernel).tobytes() == moved.tobytes()
    switch.use(None)
    assert keras.ops.convert_to_numpy(base_layer.kernel).tobytes() == kernel.tobytes()
