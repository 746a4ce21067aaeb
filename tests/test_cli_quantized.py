"""``finefreeze finetune --quantize``: a Keras-quantized base, float deltas beside its integers, on every backend.

A tiny Gemma task's preset (``causal_lms``) fine-tuned on an int8 base, then
``generate``, ``verify`` and ``delta apply`` on its files; the bundled text
model (a Keras ``MultiHeadAttention``) on an int8 base; an interrupted
quantized run resumed bit for bit.
"""

import json
import os
import signal

import keras
import numpy as np
import pytest

import causal_lms
import finefreeze as ff
from finefreeze._cli.commands import main
from finefreeze._cli.inputs import load_model
from finefreeze._cli.quantize import delta_quantization, quantize_as, quantized_kernels

SEQ = str(causal_lms.SEQ)
KERNELS = 2 * 7 + 1  # 7 projections in each of 2 decoder blocks, and the token table


def _finetune_args(root, out, epochs=3):
    return [
        "finetune", str(root / "preset"), "--data", str(root / "corpus.txt"), "--quantize", "int8",
        "--sequence-length", SEQ, "--epochs", str(epochs), "--lr", "1e-2", "--batch-size", "8", "-o", str(out),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A Gemma preset, a corpus and one ``--quantize int8`` finetune of it: ``(root, exit code, stdout)``."""
    root = tmp_path_factory.mktemp("quantized")
    causal_lms.make_preset(root / "preset", "gemma")
    (root / "corpus.txt").write_text("\n".join(causal_lms.CORPUS) + "\n")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(_finetune_args(root, root / "out"))
    return root, code, out.getvalue()


def _load(path):
    import warnings

    with warnings.catch_warnings():  # a KerasHub task compiles itself when built; Keras then skips the saved state
        warnings.filterwarnings("ignore", message="Skipping variable loading for optimizer")
        return keras.models.load_model(path, compile=False)


def _raw(v) -> bytes:
    return np.asarray(keras.ops.convert_to_numpy(v)).tobytes()


def test_the_base_is_quantized_and_its_integers_and_scales_stay_bit_identical(run):
    root, code, stdout = run
    assert code == 0, stdout
    assert f"quantized {KERNELS} layers to int8 (the plan's kernels train float deltas)" in stdout
    report = json.loads((root / "out" / "report.json").read_text())["finetune"]
    assert report["quantize"] == "int8" and report["verified"]
    assert report["metric"]["after"] < report["metric"]["before"]
    end = stdout.strip().splitlines()[-1]
    assert end.endswith(f"--delta {root / 'out' / 'delta.safetensors'} --max-length {SEQ}")
    assert "finefreeze generate" in end

    tuned = _load(root / "out" / "tuned.keras")
    kernels = quantized_kernels(tuned)
    assert len(kernels) == KERNELS and set(kernels.values()) == {"int8"}
    assert delta_quantization(str(root / "out" / "delta.safetensors")) == kernels
    base = load_model(str(root / "preset"), preset=True)
    quantize_as(base, kernels, "the preset")
    assert quantized_kernels(base) == kernels
    # the integers and scales of every quantized kernel: byte for byte those of the preset quantized alike
    quantized = [v for v in base.weights if v.dtype == "int8" or v.path.endswith("_scale")]
    assert len(quantized) >= 2 * KERNELS
    mine = {v.path: v for v in tuned.weights}
    for v in quantized:
        assert _raw(v) == _raw(mine[v.path]), v.path


def test_generate_takes_the_delta_with_the_preset_or_the_tuned_file(run, capsys):
    root, _, _ = run
    sample = json.loads((root / "out" / "report.json").read_text())["finetune"]["sample"]
    preset, tuned, delta = (str(root / p) for p in ("preset", "out/tuned.keras", "out/delta.safetensors"))

    def generate(*args) -> str:
        assert main(["generate", *args, sample["prompt"], "--max-length", SEQ]) == 0
        return capsys.readouterr().out.rstrip("\n")

    assert generate(preset) == sample["before"]
    assert generate(preset, "--delta", delta) == sample["after"] != sample["before"]
    assert generate(tuned, "--delta", delta) == sample["after"]


def test_verify_passes_and_delta_apply_export_and_generate_without_the_delta_are_refused(run, tmp_path, capsys):
    root, _, _ = run
    preset, tuned, delta = (str(root / p) for p in ("preset", "out/tuned.keras", "out/delta.safetensors"))
    assert main(["verify", preset, tuned]) == 0
    assert capsys.readouterr().out.startswith("OK: all 3,456 frozen elements")

    rebuilt, exported = tmp_path / "rebuilt.keras", tmp_path / "exported.safetensors"
    for argv, message in [
        (["delta", "apply", preset, delta, "-o", str(rebuilt)], "quantized to int8: its kernels' trained values"),
        (["generate", tuned, "the cat"], "pass the run's delta file, --delta delta.safetensors"),
        (
            ["delta", "export", tuned, "-o", str(exported)],
            "an export would write zeros; the run's delta file is delta.safetensors",
        ),
    ]:
        assert main(argv) == 2
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1, out.err
        assert out.err.startswith(f"finefreeze {argv[0]}") and message in out.err, out.err
    assert not rebuilt.exists() and not exported.exists()


def test_a_mode_keras_does_not_offer_is_refused_by_the_parser(run, capsys):
    root, _, _ = run
    argv = _finetune_args(root, root / "float8")
    argv[argv.index("int8")] = "float8"
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "argument --quantize: invalid choice: 'float8'" in capsys.readouterr().err
    assert not (root / "float8").exists()


def test_a_keras_model_with_multi_head_attention_keeps_it_float_and_its_files_load(tmp_path, capsys):
    from finefreeze._data.text_model import DEFAULT_PLAN, build_text_model, make_data

    build_text_model().save(tmp_path / "base.keras")
    (tmp_path / "plan.json").write_text(json.dumps(DEFAULT_PLAN))
    x, y = make_data(512, new_tokens=True, seed=3)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    args = ["--data", str(tmp_path / "data.npz"), "--plan", str(tmp_path / "plan.json"), "--epochs", "1"]
    out = tmp_path / "out"
    assert main(["finetune", str(tmp_path / "base.keras"), *args, "--quantize", "int8", "-o", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    said = [line for line in lines if "quantized" in line and "layers to int8" in line]
    left = "; left float: 1 trained in full; 4 inside MultiHeadAttention, which Keras cannot load back quantized"
    assert len(said) == 1 and said[0].endswith(left)  # the new head, and the attention's projections
    assert "ff.load_delta(keras.models.load_model(" in lines[-1]

    tuned = keras.models.load_model(out / "tuned.keras", compile=False)  # Keras cannot load a quantized MHA back
    kernels = quantized_kernels(tuned)  # the table (new rows train as a float delta) and the feed-forward layers
    assert "token_embedding/embeddings" in kernels and not any("attention" in p for p in kernels)
    assert main(["verify", str(tmp_path / "base.keras"), str(out / "tuned.keras")]) == 0
    capsys.readouterr()
    assert main(["delta", "apply", str(tmp_path / "base.keras"), str(out / "delta.safetensors")]) == 2
    err = capsys.readouterr().err  # no causal LM: generate is not where it runs
    assert f"Apply it where it runs: ff.load_delta(keras.models.load_model('{out / 'tuned.keras'}')" in err, err
    before = np.asarray(tuned.predict(x[:64], verbose=0))
    assert ff.load_delta(tuned, str(out / "delta.safetensors"))["elements"] > 0  # the new rows' float delta
    assert not np.array_equal(before, np.asarray(tuned.predict(x[:64], verbose=0)))


@pytest.mark.slow
def test_an_interrupted_quantized_run_resumes_to_the_uninterrupted_delta(run, tmp_path):
    from test_cli_outputs import wait_for
    from test_cli_signals import cli, epochs_saved, finish

    root, _, _ = run
    out = tmp_path / "out"
    args = _finetune_args(root, out, epochs=3)[1:]
    proc = cli("finetune", *args, "-q")
    wait_for(proc, lambda: epochs_saved(out) >= 1, "the first epoch")
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 143 and "rerun the same command with --resume" in err, err[-3000:]
    assert os.listdir(out) == [".finefreeze-resume"]

    code, _, err = finish(cli("finetune", *args, "-q", "--quantize", "int4", "--resume"))
    assert code == 2 and "another --quantize ('int8' then, 'int4' now)" in err, err[-3000:]
    code, _, err = finish(cli("finetune", *args, "-q", "--resume"))
    assert code == 0, err[-3000:]
    assert (out / "delta.safetensors").read_bytes() == (root / "out" / "delta.safetensors").read_bytes()
    assert json.loads((out / "report.json").read_text())["finetune"]["resumed_after_epoch"] >= 1


def test_an_int4_run_verifies_against_its_float_preset(run, tmp_path, capsys):
    root, _, _ = run
    argv = _finetune_args(root, tmp_path / "out", epochs=1)
    argv[argv.index("int8")] = "int4"
    assert main([*argv, "-q"]) == 0
    assert main(["verify", str(root / "preset"), str(tmp_path / "out" / "tuned.keras")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK: all 3,456 frozen elements")


def test_an_untied_llamas_new_token_rows_and_output_columns_train_on_an_int8_base_and_generate_takes_them(
    tmp_path, capsys
):
    causal_lms.make_preset(tmp_path / "preset", "llama")
    (tmp_path / "corpus.txt").write_text("\n".join(causal_lms.CORPUS) + "\n")
    vocab = causal_lms.task("llama", preprocessor=False).backbone.vocabulary_size
    plan = ff.Plan([
        ff.freeze("**"),
        ff.train(f"token_embedding/embeddings[{vocab - 4}:]"),
        ff.train(f"token_embedding/reverse_embeddings[:, {vocab - 4}:]"),
    ])  # fmt: skip
    plan.save(tmp_path / "plan.json")
    args = _finetune_args(tmp_path, tmp_path / "out", epochs=2) + ["--plan", str(tmp_path / "plan.json")]
    assert main(args) == 0
    capsys.readouterr()
    delta = str(tmp_path / "out" / "delta.safetensors")
    quantized = delta_quantization(delta)
    assert quantized["token_embedding/reverse_embeddings"] == quantized["token_embedding/embeddings"] == "int8"
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    trained = {v["path"] for v in report["variables"] if v["state"] == "partial"}
    assert trained == {"token_embedding/embeddings", "token_embedding/reverse_embeddings"}
    sample = report["finetune"]["sample"]
    assert main(["generate", str(tmp_path / "preset"), sample["prompt"], "--delta", delta, "--max-length", SEQ]) == 0
    assert capsys.readouterr().out.rstrip("\n") == sample["after"]
    assert main(["verify", str(tmp_path / "preset"), str(tmp_path / "out" / "tuned.keras")]) == 0
