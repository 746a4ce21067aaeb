"""``finefreeze finetune``, ``verify``, ``delta apply``, ``inspect`` and ``generate`` on a KerasHub causal LM's preset.

A tiny Gemma task (``causal_lms``) saved with ``save_to_preset``, a plain
text corpus and a JSONL one of prompts and responses; every backend (off
TensorFlow, KerasHub's tokenizer runs on the ``sentencepiece`` package).
"""

import json
import warnings

import keras
import numpy as np
import pytest

import causal_lms
from finefreeze._cli.commands import main

SEQ = str(causal_lms.SEQ)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Gemma preset, a .txt corpus and one default-plan finetune of it: ``(root, end line)``."""
    root = tmp_path_factory.mktemp("causal")
    causal_lms.make_preset(root / "preset", "gemma")
    (root / "corpus.txt").write_text("\n\n".join(causal_lms.CORPUS) + "\n")  # blank lines are no examples
    args = ["finetune", str(root / "preset"), "--data", str(root / "corpus.txt"), "-o", str(root / "out")]
    code = main([*args, "--sequence-length", SEQ, "--epochs", "3", "--lr", "1e-2", "--batch-size", "8", "-q"])
    return root, code


def _line(capsys) -> str:
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_finetune_lowers_the_validation_perplexity_and_reports_greedy_text(run, capsys):
    root, code = run
    assert code == 0
    report = json.loads((root / "out" / "report.json").read_text())["finetune"]
    metric, sample = report["metric"], report["sample"]
    assert metric["name"] == "val_perplexity" and metric["after"] < metric["before"]
    assert report["verified"] and report["base"]["task"] == "CausalLM" and report["base"]["sequence_length"] == 16
    first_val = causal_lms.CORPUS[-(len(causal_lms.CORPUS) // 10)]  # the last 10 % validate
    assert sample["prompt"] == " ".join(first_val.split()[:4]) and sample["max_length"] == 16
    assert sample["before"].startswith(sample["prompt"]) and sample["after"].startswith(sample["prompt"])
    totals = json.loads((root / "out" / "report.json").read_text())["totals"]
    # the default plan: one column (1 %, at least one) of each of the 14 kernels, and the 5 norms in full
    assert totals["trainable_elements"] == 2 * (2 * 16 + 16 + 16 + 2 * 8 + 16 + 16 + 16) + 5 * 16


def test_verify_delta_apply_and_inspect_take_the_preset(run, tmp_path, capsys):
    root, _ = run
    preset, tuned, delta = root / "preset", root / "out" / "tuned.keras", root / "out" / "delta.safetensors"
    assert main(["verify", str(preset), str(tuned)]) == 0
    assert _line(capsys).startswith("OK: all 3,456 frozen elements")
    rebuilt = tmp_path / "rebuilt.keras"
    assert main(["delta", "apply", str(preset), str(delta), "-o", str(rebuilt)]) == 0
    with warnings.catch_warnings():  # a KerasHub task compiles itself when built; Keras then skips the saved state
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        a, b = (keras.models.load_model(p, compile=False) for p in (tuned, rebuilt))
    assert [v.path for v in a.weights] == [v.path for v in b.weights]
    for v, w in zip(a.weights, b.weights):
        assert np.array_equal(keras.ops.convert_to_numpy(v), keras.ops.convert_to_numpy(w)), v.path
    assert b.preprocessor.sequence_length == a.preprocessor.sequence_length == 16
    assert main(["verify", str(preset), str(rebuilt)]) == 0
    assert main(["inspect", str(preset), "--layers-only"]) == 0
    assert "decoder_block_1" in capsys.readouterr().out
    assert main(["inspect", str(tuned), "--layers-only"]) == 0
    assert "Frozen elements:    3,456" in capsys.readouterr().out


def test_generate_from_the_preset_with_and_without_the_delta(run, capsys):
    root, _ = run
    sample = json.loads((root / "out" / "report.json").read_text())["finetune"]["sample"]
    preset, prompt = str(root / "preset"), sample["prompt"]

    def generate(*args) -> str:
        assert main(["generate", *args, "--max-length", SEQ]) == 0
        return capsys.readouterr().out.rstrip("\n")

    assert generate(preset, prompt) == sample["before"]
    tuned = generate(str(root / "out" / "tuned.keras"), prompt)
    assert tuned == sample["after"] != sample["before"]
    assert generate(preset, prompt, "--delta", str(root / "out" / "delta.safetensors")) == tuned


@pytest.mark.slow
def test_prompts_and_responses_train_on_the_responses_with_select(tmp_path, capsys):
    preset = causal_lms.make_preset(tmp_path / "preset", "gemma")
    lines = [line.split() for line in causal_lms.CORPUS]
    rows = [{"prompt": " ".join(w[:3]), "response": " " + " ".join(w[3:])} for w in lines]
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["finetune", preset, "--data", str(tmp_path / "qa.jsonl"), "-o", str(tmp_path / "out"), "-q"]
    assert main([*args, "--sequence-length", SEQ, "--epochs", "1", "--select", "fisher", "--budget", "0.05"]) == 0
    assert "val_perplexity" in _line(capsys)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["finetune"]["sample"]["prompt"] == rows[-(len(rows) // 10)]["prompt"]
    totals = report["totals"]
    # docs/llm.md's recipe: 5 % of every element but the token table's, spread over the kinds of variable
    table = next(v for v in report["variables"] if v["path"] == "token_embedding/embeddings")
    total = totals["trainable_elements"] + totals["frozen_elements"]
    assert table["state"] == "frozen"
    assert totals["trainable_elements"] == round(0.05 * (total - 40 * 16))


def test_the_loss_counts_the_responses_tokens_only(tmp_path):
    from finefreeze._cli.causal import causal_task

    preset = causal_lms.make_preset(tmp_path / "preset", "gemma")
    rows = [{"prompt": "the cat", "response": " sat on the mat"}, {"text": "a dog ran"}] * 5
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model, (x, y, w), val = causal_task(preset, str(tmp_path / "mixed.jsonl"), sequence_length=16)
    assert model.preprocessor is None and len(val[1]) == 1 and len(y) == 9
    tokenizer = model._finefreeze_preprocessor.tokenizer

    def tokens(text: str) -> int:
        return len(keras.ops.convert_to_numpy(tokenizer(text)))

    # the targets are the tokens after [bos], then [eos], then padding; a prompt's tokens and the padding weigh 0
    prompt, whole = tokens("the cat"), tokens("the cat sat on the mat")
    assert np.array_equal(np.flatnonzero(w[0]), np.arange(prompt, whole + 1)) and set(np.unique(w)) == {0, 1}
    assert np.array_equal(np.flatnonzero(w[1]), np.arange(tokens("a dog ran") + 1))


@pytest.mark.parametrize(
    "case, message",
    [
        ("csv corpus", "give a corpus: a .txt file"),
        ("jsonl without text", "line 1: give an object with a string 'text', or strings 'prompt' and 'response'"),
        ("one line", "has 1 examples; give at least 2"),
        ("damaged delta", "delta"),
        ("delta of another base", "frozen"),
        ("preset without a task", "holds no causal language model"),
        ("missing preset", "does not exist"),
        ("empty prompt", "the prompt is empty"),
        ("prompt longer than --max-length", "leaves none to generate (the prompt counts); raise --max-length above"),
        ("a corpus for a backbone", "a .txt corpus trains a KerasHub causal LM"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(run, case, message, tmp_path, capsys):
    root, _ = run
    preset, delta = str(root / "preset"), root / "out" / "delta.safetensors"
    finetune = ["finetune", preset, "-o", str(tmp_path / "out"), "--sequence-length", SEQ, "--data"]
    if case == "csv corpus":
        (tmp_path / "c.csv").write_text("text,label\na,0\nb,1\n")
        argv = [*finetune, str(tmp_path / "c.csv")]
    elif case == "jsonl without text":
        (tmp_path / "c.jsonl").write_text('{"question": "a"}\n{"text": "b"}\n')
        argv = [*finetune, str(tmp_path / "c.jsonl")]
    elif case == "one line":
        (tmp_path / "c.txt").write_text("only one line\n\n")
        argv = [*finetune, str(tmp_path / "c.txt")]
    elif case == "damaged delta":
        data = bytearray(delta.read_bytes())
        data[len(data) // 2] ^= 0xFF
        (tmp_path / "d.safetensors").write_bytes(bytes(data))
        argv = ["generate", preset, "the cat", "--delta", str(tmp_path / "d.safetensors")]
    elif case == "delta of another base":
        other = causal_lms.make_preset(tmp_path / "other", "gemma", seed=1)
        argv = ["generate", other, "the cat", "--delta", str(delta)]
    elif case == "preset without a task":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            tuned = keras.models.load_model(root / "out" / "tuned.keras", compile=False)
        tuned.backbone.save_to_preset(str(tmp_path / "backbone"))
        argv = ["generate", str(tmp_path / "backbone"), "the cat"]
    elif case == "empty prompt":
        argv = ["generate", preset, "  "]
    elif case == "prompt longer than --max-length":
        argv = ["generate", preset, "--max-length", "3", "the cat sat on the mat"]
    elif case == "a corpus for a backbone":
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
            tuned = keras.models.load_model(root / "out" / "tuned.keras", compile=False)
        tuned.backbone.save_to_preset(str(tmp_path / "backbone"))
        (tmp_path / "c.txt").write_text("a b c\nd e f\n")
        argv = ["finetune", str(tmp_path / "backbone"), "-o", str(tmp_path / "out"), "--data", str(tmp_path / "c.txt")]
    else:
        argv = ["generate", str(tmp_path / "nowhere"), "the cat"]
    capsys.readouterr()
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
    assert out.err.startswith(f"finefreeze {argv[0]}: error: ") and message in out.err, out.err
    assert not (tmp_path / "out").exists()


@pytest.mark.backends("tensorflow", reason="the BERT classifier's WordPiece tokenizer runs on tf.text")
def test_generate_refuses_a_classifier_preset(tmp_path, capsys):
    from test_kerashub import NEW, VOCAB, classifier

    classifier(VOCAB + NEW).save_to_preset(str(tmp_path / "classifier"))
    assert main(["generate", str(tmp_path / "classifier"), "the cat"]) == 2
    err = capsys.readouterr().err
    assert "holds no causal language model" in err and len(err.strip().splitlines()) == 1


def test_generate_takes_one_delta(run, capsys):
    root, _ = run
    delta = str(root / "out" / "delta.safetensors")
    with pytest.raises(SystemExit) as e:
        main(["generate", str(root / "preset"), "--delta", delta, "--delta", delta, "the cat"])
    assert e.value.code == 2 and "--delta is given twice" in capsys.readouterr().err
