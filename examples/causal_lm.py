"""A KerasHub causal LM end to end: new tokens, 1 % of the attention columns, a selected sparse plan, LoRA + sparse.

A small Gemma-shaped ``GemmaCausalLM`` (random weights from a config, a
sentencepiece tokenizer trained here: no download) is given two new tokens
and saved as a preset folder, the shared base. Three tasks fine-tune it
through the task's own ``compile`` / ``fit`` on strings, each under another
plan, and each writes a small delta. One base in memory then serves the
three with ``ff.DeltaSwitch``: with a greedy sampler, ``generate()`` answers
each prompt with exactly the text of that task's own fine-tuned model; so
does the command line, ``finefreeze generate BASE --delta TASK "prompt"``.
Last, LoRA adapters and sparse base elements train together.
"""

import io
import os
import subprocess
import sys
import tempfile

import keras
import keras_hub
import sentencepiece as spm

import finefreeze as ff

CORPUS = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song at dawn",
    "we like to read old books",
    "the sun rose over the hills",
    "rain fell on the quiet town",
]
TASKS = {  # three tasks: what each should learn to say
    "rows": ["<user> the cat sat <bot> on the mat"] * 8,
    "columns": ["the sun rose over the town"] * 8,
    "selected": ["a dog sang a song in the rain"] * 8,
}
PROMPTS = {"rows": "<user> the cat", "columns": "the sun", "selected": "a dog"}
folder = tempfile.mkdtemp()

# --- the pretrained base: a tokenizer trained here, random weights, two new tokens, saved as a preset
proto = io.BytesIO()
spm.SentencePieceTrainer.train(
    sentence_iterator=iter(CORPUS * 8), model_writer=proto, vocab_size=40, model_type="unigram",
    hard_vocab_limit=False, pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
    bos_piece="<bos>", unk_piece="<unk>", minloglevel=2, num_threads=1,
)  # fmt: skip
tokenizer = keras_hub.models.GemmaTokenizer(proto=proto.getvalue())
keras.utils.set_random_seed(0)
backbone = keras_hub.models.GemmaBackbone(
    vocabulary_size=tokenizer.vocabulary_size(), num_layers=2, hidden_dim=64, intermediate_dim=128,
    num_query_heads=4, num_key_value_heads=1, head_dim=16,
)  # fmt: skip
lm = keras_hub.models.GemmaCausalLM(backbone, keras_hub.models.GemmaCausalLMPreprocessor(tokenizer, sequence_length=12))
old = lm.backbone.vocabulary_size
lm = ff.add_tokens(lm, ["<user>", "<bot>"])  # rows old, old + 1 of the tied table: the mean of the others
lm.save_to_preset(os.path.join(folder, "base"))
table = "token_embedding/embeddings"


def load_base():
    base = keras_hub.models.CausalLM.from_preset(os.path.join(folder, "base"))
    base.compile(sampler="greedy")
    return base


base = load_base()
before = {name: base.generate(prompt, max_length=10) for name, prompt in PROMPTS.items()}

# --- three fine-tunes of the same base, three plans, three deltas
plans = {
    "rows": lambda m: ff.Plan([ff.freeze("**"), ff.train(f"{table}[{old}:]")]),  # the new tokens' rows only
    "columns": lambda m: ff.Plan([ff.freeze("**"), ff.train("**/attention/**/kernel", columns="1%")]),
    # the 5 % of the decoder's elements with the largest Fisher score, spread over every kind of projection
    "selected": lambda m: ff.select(
        m, TASKS["selected"], budget=0.05, exclude=f"**/{table}", spread="kind", options={"verbose": 0}
    ),
}
tuned = {}
for name, make_plan in plans.items():
    model = load_base()
    frz = ff.Freezer(model, make_plan(model))
    model.compile(optimizer=frz.wrap(keras.optimizers.Adam(3e-2)), sampler="greedy")  # the task's own loss
    model.fit(TASKS[name], batch_size=4, epochs=12, verbose=0)
    frz.verify()  # every frozen element bit-identical to the base
    info = frz.save_delta(os.path.join(folder, f"{name}.safetensors"))
    tuned[name] = model
    trained = frz.report()["totals"]["trainable_elements"]
    print(f"{name:8s}: {trained:5,} elements trained, delta {info['bytes'] / 1024:.1f} KiB; "
          f"{before[name]!r} before, {model.generate(PROMPTS[name], max_length=10)!r} after")  # fmt: skip

# --- one base serves the three tasks: switch the deltas in place, generate
served = load_base()
switch = ff.DeltaSwitch(served, {name: os.path.join(folder, f"{name}.safetensors") for name in plans})
for name, prompt in [("selected", "a dog"), ("rows", "<user> the cat"), (None, "the sun"), ("columns", "the sun")]:
    switch.use(name)
    got = served.generate(prompt, max_length=10)
    want = before["columns"] if name is None else tuned[name].generate(prompt, max_length=10)
    assert got == want, (name, got, want)
print("DeltaSwitch: each task answers as its own fine-tuned model, the base as the base")

# --- the same through the command line
command = [sys.executable, "-m", "finefreeze", "generate", os.path.join(folder, "base"), "--max-length", "10"]
said = subprocess.run(
    command + ["--delta", os.path.join(folder, "selected.safetensors"), "a dog"], capture_output=True, text=True
)
assert said.returncode == 0, said.stderr
assert said.stdout.strip() == tuned["selected"].generate("a dog", max_length=10), said.stdout
print(f"finefreeze generate base --delta selected.safetensors 'a dog': {said.stdout.strip()!r}")

# --- LoRA adapters and sparse base elements, trained together
model = load_base()
model.backbone.enable_lora(4)
plan = ff.select(model, budget=0.01, score="random", include="**/lora_kernel_*", exclude=f"**/{table}", spread="kind")
frz = ff.Freezer(model, plan)
model.compile(optimizer=frz.wrap(keras.optimizers.Adam(1e-2)), sampler="greedy")
model.fit(TASKS["columns"], batch_size=4, epochs=2, verbose=0)
frz.verify()
assert frz.report()["totals"]["trainable_elements"] > 0
print(f"LoRA + sparse: {frz.report()['totals']['trainable_elements']:,} elements trained, verified")
print("OK: new rows, 1 % columns, selected elements and LoRA + sparse trained exactly; three deltas served")
