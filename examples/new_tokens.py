"""Add new tokens to a transformer's vocabulary; train only their embedding rows and the head.

Uses the bundled text model (token + position embedding, a transformer block,
a head). Run: python examples/new_tokens.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402
from finefreeze._data.text_model import VOCAB, extend_vocabulary, make_data, pretrained_text_model  # noqa: E402

model = pretrained_text_model(epochs=1, n=1024)  # 512 pretrained tokens, then 32 new rows
emb = model.get_layer("token_embedding").embeddings
print("embedding", tuple(emb.shape), "pretrained rows:", VOCAB)
plan = ff.Plan([ff.freeze("**"), ff.train(f"token_embedding/embeddings[{VOCAB}:]"), ff.train("head/**")])
frz = ff.Freezer(model, plan)
print(frz.summary(variables=False))
before = emb.numpy().copy()
model.compile(
    optimizer=frz.wrap(keras.optimizers.AdamW(5e-3)),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
x, y = make_data(1024, new_tokens=True)
xv, yv = make_data(256, new_tokens=True, seed=1)
acc0 = model.evaluate(xv, yv, verbose=0)[1]
model.fit(x, y, batch_size=64, epochs=3, verbose=0)
acc1 = model.evaluate(xv, yv, verbose=0)[1]
print(f"validation accuracy on sequences that need the new tokens: {acc0:.2f} -> {acc1:.2f}")
frz.verify()
assert np.array_equal(emb.numpy()[:VOCAB], before[:VOCAB])
assert not np.array_equal(emb.numpy()[VOCAB:], before[VOCAB:])
assert acc1 > acc0 + 0.3
assert extend_vocabulary  # the helper that grew the embedding, for your own models
print("OK: pretrained rows bit-identical, new rows learned")
