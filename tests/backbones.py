"""Small real architectures for tests: keras.applications models built without weights, and a
backbone written the way KerasHub writes its backbones (a Functional model of transformer
layers named ``transformer_layer_0..N`` over token + position embeddings)."""

import keras


class TransformerEncoder(keras.layers.Layer):
    """A post-norm transformer encoder layer with its sublayers built in ``build`` (KerasHub's way)."""

    def __init__(self, intermediate_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.intermediate_dim, self.num_heads = intermediate_dim, num_heads

    def build(self, input_shape):
        d = input_shape[-1]
        self._self_attention_layer = keras.layers.MultiHeadAttention(
            self.num_heads, d // self.num_heads, name="self_attention_layer"
        )
        self._self_attention_layer.build(input_shape, input_shape)
        self._self_attention_layer_norm = keras.layers.LayerNormalization(name="self_attention_layer_norm")
        self._self_attention_layer_norm.build(input_shape)
        self._feedforward_intermediate_dense = keras.layers.Dense(
            self.intermediate_dim, activation="gelu", name="feedforward_intermediate_dense"
        )
        self._feedforward_intermediate_dense.build(input_shape)
        self._feedforward_output_dense = keras.layers.Dense(d, name="feedforward_output_dense")
        self._feedforward_output_dense.build((*input_shape[:-1], self.intermediate_dim))
        self._feedforward_layer_norm = keras.layers.LayerNormalization(name="feedforward_layer_norm")
        self._feedforward_layer_norm.build(input_shape)
        self.built = True

    def call(self, x):
        x = self._self_attention_layer_norm(x + self._self_attention_layer(x, x))
        h = self._feedforward_output_dense(self._feedforward_intermediate_dense(x))
        return self._feedforward_layer_norm(x + h)


class PositionEmbedding(keras.layers.Layer):
    """Learned position embeddings added to a sequence (KerasHub's ``PositionEmbedding``)."""

    def build(self, input_shape):
        self.position_embeddings = self.add_weight(shape=tuple(input_shape[1:]), name="embeddings")

    def call(self, x):
        return x + self.position_embeddings[None]


def transformer_backbone(vocab=50, length=8, dim=16, layers=3, name="bert_backbone"):
    """Token + position embeddings, ``layers`` encoder layers, a pooled output (KerasHub-style names)."""
    tokens = keras.Input((length,), dtype="int32", name="token_ids")
    x = keras.layers.Embedding(vocab, dim, name="token_embedding")(tokens)
    x = PositionEmbedding(name="position_embedding")(x)
    x = keras.layers.LayerNormalization(name="embeddings_layer_norm")(x)
    for i in range(layers):
        x = TransformerEncoder(2 * dim, 2, name=f"transformer_layer_{i}")(x)
    pooled = keras.layers.Dense(dim, activation="tanh", name="pooled_dense")(x[:, 0])
    return keras.Model(tokens, pooled, name=name)


def mobilenet(name_head="head"):
    """The keras.io guide pattern: a MobileNetV2 backbone (alpha 0.35, 32x32) called inside a new model."""
    base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, include_top=False, weights=None)
    inputs = keras.Input((32, 32, 3))
    x = base(inputs, training=False)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(1, name=name_head)(x)
    return keras.Model(inputs, outputs, name="classifier"), base
