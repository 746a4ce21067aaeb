"""Every Keras optimizer configuration the conformance tests run over.

Adding an optimizer is one line. ``test_every_keras_optimizer_is_covered``
fails when the installed Keras ships a class that is not listed here; a
class an older Keras does not ship yet is left out there.
"""

import keras

opt = keras.optimizers

OPTIMIZERS = {
    "sgd": lambda: opt.SGD(0.1),
    "sgd_momentum": lambda: opt.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: opt.SGD(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: opt.Adam(0.05),
    "adam_amsgrad": lambda: opt.Adam(0.05, amsgrad=True),
    "adam_weight_decay": lambda: opt.Adam(0.05, weight_decay=0.1),
    "adamw": lambda: opt.AdamW(0.05, weight_decay=0.1),
    "adam_ema": lambda: opt.Adam(0.05, use_ema=True, ema_overwrite_frequency=2),
    "adamw_ema": lambda: opt.AdamW(0.05, weight_decay=0.1, use_ema=True, ema_overwrite_frequency=3),
    "adam_clipnorm": lambda: opt.Adam(0.05, clipnorm=0.01),
    "adam_global_clipnorm": lambda: opt.Adam(0.05, global_clipnorm=0.01),
    "adam_clipvalue": lambda: opt.Adam(0.05, clipvalue=0.001),
    "adam_accumulation": lambda: opt.Adam(0.05, gradient_accumulation_steps=2),
    "rmsprop": lambda: opt.RMSprop(0.05),
    "rmsprop_momentum_centered": lambda: opt.RMSprop(0.05, momentum=0.9, centered=True),
    "adagrad": lambda: opt.Adagrad(0.5),
    "adadelta": lambda: opt.Adadelta(1.0),
    "adamax": lambda: opt.Adamax(0.05),
    "nadam": lambda: opt.Nadam(0.05),
    "ftrl": lambda: opt.Ftrl(0.5, l1_regularization_strength=0.01),
    "lion": lambda: opt.Lion(0.05),
    "adafactor": lambda: opt.Adafactor(0.5),
    "lamb": lambda: opt.Lamb(0.05),
    "muon": lambda: opt.Muon(0.05),
    "schedule_free_adamw": lambda: opt.ScheduleFreeAdamW(0.05),
    "multi_optimizer": lambda: opt.MultiOptimizer(
        opt.OptimizerMap(opt.Adam(0.05), {".*bias": opt.SGD(0.1, momentum=0.9)})
    ),
}
#: the class each configuration needs, where an older Keras (pyproject's lowest) may not have it
NEEDS = {"muon": "Muon", "schedule_free_adamw": "ScheduleFreeAdamW", "multi_optimizer": "MultiOptimizer"}
OPTIMIZERS = {k: f for k, f in OPTIMIZERS.items() if hasattr(opt, NEEDS.get(k, "Optimizer"))}

# Classes that are wrappers, not optimizers of their own.
WRAPPERS = {"LossScaleOptimizer", "Optimizer"}
