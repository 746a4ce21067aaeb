"""The TF1 two-train-op recipe with plans: freeze the encoder in one op, the decoder in the other.

The classic answer builds two train ops, each `optimizer.minimize(loss,
var_list=[...])` leaving out one variable, with an Adam each so their
statistics stay apart. With plans the var lists come from rules (a typo is an
error, not a silently frozen layer), and the same two ops train to the same
bits. Then one op freezes single elements too, which var_list cannot express,
and verify() proves each op kept its frozen part.

Run: python examples/tf1_two_train_ops.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import finefreeze as ff  # noqa: E402

v1 = tf.compat.v1
rng = np.random.default_rng(0)
DATA = rng.normal(size=(32, 6)).astype("float32")
ENC0, DEC0 = rng.normal(size=(6, 3)).astype("float32"), rng.normal(size=(3, 6)).astype("float32")


def build():
    """A tiny autoencoder in TF1 style: variables in name scopes, a loss tensor."""
    with v1.variable_scope("encoder"):
        enc = v1.get_variable("w", initializer=ENC0)
    with v1.variable_scope("decoder"):
        dec = v1.get_variable("w", initializer=DEC0)
    loss = tf.reduce_mean(tf.square(tf.tanh(DATA @ enc) @ dec - DATA))
    return enc, dec, loss


def train(ops, variables, steps=12):
    """Alternate the two ops (op 0 twice, then op 1); return the variables after each step."""
    out = []
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for i in range(steps):
            sess.run(ops[int(i % 3 == 2)])
            out.append(sess.run(variables))
    return out


# The hand-written TF1 recipe: one optimizer per var_list.
with tf.Graph().as_default():
    enc, dec, loss = build()
    train_dec = v1.train.AdamOptimizer(0.05, name="adam_dec").minimize(loss, var_list=[dec])
    train_enc = v1.train.AdamOptimizer(0.01, name="adam_enc").minimize(loss, var_list=[enc])
    by_recipe = train([train_dec, train_enc], [enc, dec])

# The same with plans: each op's var_list and train op come from its Freezer.
with tf.Graph().as_default() as g:
    enc, dec, loss = build()
    freeze_enc = ff.tf1.Freezer(g, ff.Plan([ff.freeze("encoder/**")]))
    freeze_dec = ff.tf1.Freezer(g, ff.Plan([ff.freeze("decoder/**")]))
    print("op 1 trains", [v.name for v in freeze_enc.var_list], "- op 2 trains", [v.name for v in freeze_dec.var_list])
    train_dec = freeze_enc.minimize(v1.train.AdamOptimizer(0.05, name="adam_dec"), loss)
    train_enc = freeze_dec.minimize(v1.train.AdamOptimizer(0.01, name="adam_enc"), loss)
    by_plan = train([train_dec, train_enc], [enc, dec])
    slots = sorted(v.op.name for v in g.get_collection(v1.GraphKeys.GLOBAL_VARIABLES) if "adam" in v.op.name)
    print("optimizer slots (one Adam per op, slots only for what it trains):", slots)

same = all(np.array_equal(a, b) for step_a, step_b in zip(by_plan, by_recipe) for a, b in zip(step_a, step_b))
print("every step bit-identical to the hand-written recipe:", same)
assert same
assert slots == ["decoder/w/adam_dec", "decoder/w/adam_dec_1", "encoder/w/adam_enc", "encoder/w/adam_enc_1"]

# Beyond var_list: op 1 also keeps the decoder's first row fixed, element by element.
with tf.Graph().as_default() as g:
    enc, dec, loss = build()
    frz_1 = ff.tf1.Freezer(g, ff.Plan([ff.freeze("encoder/**"), ff.freeze("decoder/w[0]")]))
    op_1 = frz_1.minimize(v1.train.AdamOptimizer(0.05, name="adam_dec"), loss)
    frz_2 = ff.tf1.Freezer(g, ff.Plan([ff.freeze("decoder/**")]))
    op_2 = frz_2.minimize(v1.train.AdamOptimizer(0.01, name="adam_enc"), loss)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        frz_1.activate()  # fingerprint the frozen elements once they have values (the default session)
        for i in range(12):
            sess.run(op_2 if i % 3 == 2 else op_1)
            if i == 1:
                frz_1.verify()  # only op 1 ran so far: its frozen elements are bit-identical
        dec_now = sess.run(dec)
    print(frz_1.summary())
    assert np.array_equal(dec_now[0], DEC0[0]) and not np.array_equal(dec_now[1:], DEC0[1:])

print("OK: two train ops with plans match the two-optimizer var_list recipe bit for bit; element-level plans hold too")
