"""Every Keras optimizer configuration the conformance tests run over.

Adding an optimizer is one line. ``test_every_keras_optimizer_is_covered``
fails when the installed Keras ships a class that is not listed here.
"""

import keras

O = keras.optimizers

OPTIMIZERS = {
    "sgd": lambda: O.SGD(0.1),
    "sgd_momentum": lambda: O.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: O.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: O.Adam(0.05),
    "adam_amsgrad": lambda: O.Adam(0.05, amsgrad=True),
    "adam_weight_decay": lambda: O.Adam(0.05, weight_decay=0.1),
    "adamw": lambda: O.AdamW(0.05, weight_decay=0.1),
    "adam_ema": lambda: O.Adam(0.05, use_ema=True, ema_overwrite_frequency=2),
    "adamw_ema": lambda: O.AdamW(0.05, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3),
    "adam_clipnorm": lambda: O.Adam(0.05, clipnorm=0.01),
    "adam_global_clipnorm": lambda: O.Adam(0.05, global_clipnorm=0.01),
    "adam_clipvalue": lambda: O.Adam(0.05, clipvalue=0.001),
    "adam_accumulation": lambda: O.Adam(0.05, gradient_accumulation_steps=2),
    "rmsprop": lambda: O.RMSprop(0.05),
    "rmsprop_momentum_centered": lambda: O.RMSprop(0.05, momentum=0.9, centered=True),
    "adagrad": lambda: O.Adagrad(0.5),
    "adadelta": lambda: O.Adadelta(1.0),
    "adamax": lambda: O.Adamax(0.05),
    "nadam": lambda: O.Nadam(0.05),
    "ftrl": lambda: O.Ftrl(0.5, l1_regularization_strength=0.01),
    "lion": lambda: O.Lion(0.05),
    "adafactor": lambda: O.Adafactor(0.5),
    "lamb": lambda: O.Lamb(0.05),
    "muon": lambda: O.Muon(0.05),
    "schedule_free_adamw": lambda: O.ScheduleFreeAdamW(0.05),
    "multi_optimizer": lambda: O.MultiOptimizer(
        O.OptimizerMap(O.Adam(0.05), {".*bias": O.SGD(0.1, momentum=0.9)})
    ),
}

# Classes that are wrappers, not optimizers of their own.
WRAPPERS = {"LossScaleOptimizer", "Optimizer"}
