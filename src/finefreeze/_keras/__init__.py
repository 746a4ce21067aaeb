"""The one seam between finefreeze and Keras' internals.

Every use of a Keras private name, every ``keras.src`` import and every
attribute finefreeze sets on an object it does not own (a layer's own
``call``, an optimizer's ``update_step``, a mark on a variable) lives here,
behind a named function whose docstring says which Keras behaviour it relies
on. ``tests/test_keras_seam.py`` holds one contract test per function: when
a Keras release changes that behaviour, the test names the function, instead
of frozen elements drifting silently. Nothing else in finefreeze touches a
Keras private name (``tests/test_layering.py`` counts them).

- :mod:`.optimizers`: an optimizer's variable lists, keys, weight-decay
  cache, step count and per-variable update;
- :mod:`.layers`: a layer's sub-layers and own weights, its graph, its
  kernel attributes, a convolution's causal padding;
- :mod:`.instances`: attributes set on instances (a layer's ``call``, marks),
  the scopes and seeds Keras keeps in its global state, and variables made
  outside the step Keras' TensorFlow trainer traces.
"""
