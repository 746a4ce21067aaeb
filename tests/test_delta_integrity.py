"""Delta files that cannot lie: every damaged byte is refused or harmless, and apply is all or nothing."""

import hashlib
import json
import struct

import keras
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import finefreeze as ff
from backend_utils import weights_of
from conftest import mlp


def snapshot(model):
    return [np.array(v.numpy(), copy=True) for v in weights_of(model)]


def same(a, b):
    return len(a) == len(b) and all(
        x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)) for x, y in zip(a, b)
    )


def small_pair(tmp_path):
    """A base, a delta trained from it (whole, partial and frozen variables), and the applied result."""
    keras.utils.set_random_seed(5)
    base = mlp(units=(3, 2), input_dim=2)
    keras.utils.set_random_seed(5)
    tuned = mlp(units=(3, 2), input_dim=2)
    frz = ff.Freezer(tuned, ff.Plan([ff.freeze("**/dense_0/bias"), ff.freeze("**/dense_0/kernel[0]")]))
    tuned.compile(optimizer=frz.wrap(keras.optimizers.Adam(0.1)), loss="mse")
    rng = np.random.default_rng(0)
    tuned.fit(rng.normal(size=(16, 2)), rng.normal(size=(16, 2)), epochs=1, verbose=0)
    path = tmp_path / "d.safetensors"
    frz.save_delta(path)
    return base, snapshot(tuned), path


def header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def rewrite(path, out, *, tensors=None, meta=None, fix_checksums=True):
    """Write ``out`` from ``path`` with tensors and metadata changed, checksums recomputed (a consistent forgery)."""
    with safe_open(str(path), framework="np") as f:
        m = dict(f.metadata())
        t = {k: f.get_tensor(k) for k in f.keys()}
    t = tensors(t) if tensors else t
    m = meta(m) if meta else m
    if fix_checksums:
        table = {
            k: {
                "dtype": str(v.dtype),
                "shape": list(v.shape),
                "sha256": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
            }
            for k, v in t.items()
        }
        m["tensors"] = json.dumps(table)
        body = json.dumps({k: v for k, v in m.items() if k != "checksum"}, sort_keys=True)
        m["checksum"] = hashlib.sha256(body.encode()).hexdigest()
    save_file(t, str(out), metadata=m)
    return out


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="bytes of a file, the same on every backend")
def test_every_flipped_byte_is_refused_or_harmless(tmp_path):
    base, tuned, path = small_pair(tmp_path)
    pristine = snapshot(base)
    ff.load_delta(base, path)
    assert same(snapshot(base), tuned)
    data = path.read_bytes()
    payload = header_end(data)
    assert len(data) < 4096, len(data)  # small enough to flip every byte
    damaged = tmp_path / "damaged.safetensors"
    refused = applied = 0
    for pos in range(len(data)):
        for bits in (0xFF, 0x01):
            flipped = bytearray(data)
            flipped[pos] ^= bits
            damaged.write_bytes(bytes(flipped))
            for v, p in zip(weights_of(base), pristine):
                v.assign(p)
            try:
                ff.load_delta(base, damaged)
            except ff.DeltaError:
                refused += 1
                assert same(snapshot(base), pristine), f"byte {pos} ^ {bits:#x}: refused but the base changed"
                continue
            applied += 1
            assert pos < payload, f"byte {pos} ^ {bits:#x} of the tensor data was applied"
            assert same(snapshot(base), tuned), f"byte {pos} ^ {bits:#x}: applied with another result"
    assert refused > 0.95 * 2 * len(data), (refused, applied)


@pytest.mark.slow
@pytest.mark.backends("tensorflow", reason="bytes of a file, the same on every backend")
def test_spread_flips_of_the_bundled_delta_are_refused_or_harmless(tmp_path):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model

    base, tuned = build_text_model(), build_text_model()
    frz = ff.Freezer(tuned, ff.Plan.from_dict(DEFAULT_PLAN))
    rng = np.random.default_rng(1)
    for v in weights_of(tuned):  # stand-in for training: move exactly the trainable elements
        v.assign(np.where(frz.frozen_mask(v.path), v.numpy(), rng.normal(size=v.shape).astype(v.dtype)))
    path = tmp_path / "d.safetensors"
    frz.save_delta(path)
    want, pristine = snapshot(tuned), snapshot(base)
    data = path.read_bytes()
    damaged = tmp_path / "damaged.safetensors"
    for pos in np.unique(np.linspace(0, len(data) - 1, 300).astype(int)):
        flipped = bytearray(data)
        flipped[pos] ^= 0x10
        damaged.write_bytes(bytes(flipped))
        try:
            ff.load_delta(base, damaged)
        except ff.DeltaError:
            assert same(snapshot(base), pristine), f"byte {pos}: refused but the base changed"
            continue
        assert same(snapshot(base), want), f"byte {pos}: applied with another result"
        for v, p in zip(weights_of(base), pristine):
            v.assign(p)


def test_damaged_header_is_a_delta_error(tmp_path):
    base, _, path = small_pair(tmp_path)
    pristine = snapshot(base)
    data = path.read_bytes()
    n = header_end(data)
    header = json.loads(data[8:n])
    cases = {
        "not json": b"[" + data[9:n],
        "no metadata": json.dumps({k: v for k, v in header.items() if k != "__metadata__"}).encode(),
        "variables not a dict": None,
    }
    meta = header["__metadata__"]
    bad = dict(meta, variables="[1, 2]")
    cases["variables not a dict"] = json.dumps(dict(header, __metadata__=bad)).encode()
    for name, head in cases.items():
        head = head + b" " * (-len(head) % 8)
        (tmp_path / "h.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data[n:])
        with pytest.raises(ff.DeltaError) as e:
            ff.load_delta(base, tmp_path / "h.safetensors")
        assert "h.safetensors" in str(e.value), name
        assert same(snapshot(base), pristine), name


def test_values_shorter_than_the_metadata_say_change_nothing(tmp_path):
    base, _, path = small_pair(tmp_path)
    pristine = snapshot(base)
    key = "mlp/dense_0/kernel::values"
    out = rewrite(path, tmp_path / "short.safetensors", tensors=lambda t: {**t, key: t[key][:-1]})
    with pytest.raises(ff.DeltaError, match="dense_0/kernel::values"):
        ff.load_delta(base, out)
    assert same(snapshot(base), pristine)


def test_another_dtype_is_refused_not_cast(tmp_path):
    base, _, path = small_pair(tmp_path)
    pristine = snapshot(base)
    key = "mlp/head/kernel"
    out = rewrite(path, tmp_path / "f64.safetensors", tensors=lambda t: {**t, key: t[key].astype(np.float64)})
    with pytest.raises(ff.DeltaError, match="head/kernel.*float64"):
        ff.load_delta(base, out)
    assert same(snapshot(base), pristine)


def test_missing_and_extra_tensors_are_named(tmp_path):
    base, _, path = small_pair(tmp_path)
    pristine = snapshot(base)
    gone = rewrite(
        path, tmp_path / "gone.safetensors", tensors=lambda t: {k: v for k, v in t.items() if k != "mlp/head/bias"}
    )
    with pytest.raises(ff.DeltaError, match="'mlp/head/bias' of variable 'mlp/head/bias' is missing"):
        ff.load_delta(base, gone)
    extra = rewrite(
        path, tmp_path / "extra.safetensors", tensors=lambda t: {**t, "mlp/stowaway": np.zeros(3, "float32")}
    )
    with pytest.raises(ff.DeltaError, match="'mlp/stowaway' belongs to no variable"):
        ff.load_delta(base, extra)
    unlisted = rewrite(
        path,
        tmp_path / "unlisted.safetensors",
        tensors=lambda t: {**t, "x": np.zeros(1, "float32")},
        fix_checksums=False,
    )
    with pytest.raises(ff.DeltaError, match="metadata is damaged|'x' is not listed"):
        ff.load_delta(base, unlisted)
    assert same(snapshot(base), pristine)


def _without_frozen(m):
    variables = json.loads(m["variables"])
    partial = next(p for p, info in variables.items() if info["kind"] == "partial")
    del variables[partial]["frozen"]
    return {**m, "variables": json.dumps(variables)}


@pytest.mark.parametrize(
    "change, found",
    [
        (lambda m: {**m, "format": "finefreeze.delta/2"}, "is format 'finefreeze.delta/2'"),
        (lambda m: {**m, "format": "finefreeze.delta/0"}, "is format 'finefreeze.delta/0'"),
        (lambda m: {k: v for k, v in m.items() if k != "format"}, "has no format entry"),
    ],
    ids=["newer", "older", "none"],
)
def test_a_delta_of_another_format_is_refused_with_how_to_export_again(tmp_path, change, found):
    base, tuned, path = small_pair(tmp_path)
    with safe_open(str(path), framework="np") as f:
        assert f.metadata()["format"] == "finefreeze.delta/1"  # the one format, as save_delta writes it
    pristine = snapshot(base)
    other = rewrite(path, tmp_path / "other.safetensors", meta=change)  # checksums fixed: only the format differs
    with pytest.raises(ff.DeltaError) as e:
        ff.load_delta(base, other)
    assert found in str(e.value) and "other.safetensors" in str(e.value)
    assert f"finefreeze {ff.__version__} reads delta files of format 'finefreeze.delta/1' only" in str(e.value)
    assert f"Export it again with finefreeze {ff.__version__}" in str(e.value) and "delta export" in str(e.value)
    with pytest.raises(ff.DeltaError, match="finefreeze.delta/1"):
        ff.DeltaSwitch(base, {"task": other})
    assert same(snapshot(base), pristine)
    ff.load_delta(base, path)  # the file it was made from applies
    assert same(snapshot(base), tuned)


def test_a_delta_lacking_a_variable_s_check_is_refused(tmp_path):
    base, _, path = small_pair(tmp_path)
    pristine = snapshot(base)
    lacking = rewrite(path, tmp_path / "lacking.safetensors", meta=_without_frozen)
    with pytest.raises(ff.DeltaError, match=r"lacking\.safetensors.*variable .* is malformed \(KeyError: 'frozen'\)"):
        ff.load_delta(base, lacking)
    assert same(snapshot(base), pristine)


class FailingVariable(keras.Variable):
    """A variable whose writes fail, as a read-only store would."""

    def assign(self, value):
        raise RuntimeError("this store is read-only")


def test_a_failing_write_restores_what_was_written(tmp_path):
    a = keras.Variable(np.zeros(3, "float32"), name="a")
    b = FailingVariable(np.zeros(3, "float32"), name="b")
    frz = ff.Freezer([a, b], ff.Plan([ff.train("**")]))
    a.assign([1.0, 2.0, 3.0])
    frz.save_delta(tmp_path / "d.safetensors")
    a.assign([7.0, 8.0, 9.0])
    with pytest.raises(ff.DeltaError, match="writing 'b' failed.*restored"):
        ff.load_delta([a, b], tmp_path / "d.safetensors")
    assert np.array_equal(a.numpy(), np.array([7.0, 8.0, 9.0], "float32"))


def test_a_keras_model_given_as_the_delta_is_named_as_such(tmp_path):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
    model.save(tmp_path / "m.keras")
    with pytest.raises(ff.DeltaError, match=r"is a zip archive \(a .keras model\?\), not a delta"):
        ff.load_delta(model, tmp_path / "m.keras")
