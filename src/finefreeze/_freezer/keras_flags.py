"""Keras' own switch, ``base.trainable``, kept meaningful next to a Freezer.

A Freezer sets ``base.trainable = False`` on every nested model its plan
freezes whole (as Keras users do by hand), besides the variable flags.
Only nested models: a layer flag is saved with the model, and a loaded
model's switched-off layers are, for Keras and for plans, layers Keras does
not train; a backbone saved frozen loads frozen, as it does in plain Keras. So the
keras.io recipe ``base.trainable = True`` after a Freezer is a visible
change: Keras' setter unfreezes the layer's variables, and the next
``Freezer.wrap`` (the recompile that recipe asks for) honours it by adding a
``train(...)`` rule for that layer (``freeze(...)`` for a layer switched off)
and saying so with a ``FreezeWarning``. Without the layer flag the switch was
a no-op the plan silently overrode (Keras skips nothing, but the layer's own
flag never changed, so there was nothing to see).
"""

from __future__ import annotations

import re
import warnings

import keras

from finefreeze._errors import FreezeWarning
from finefreeze._keras.instances import instance_value, remove_instance_value, set_instance_value, set_tag, tag
from finefreeze._keras.layers import sublayers
from finefreeze._kinds import State
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import Rule, freeze, train
from finefreeze._resolve.blocks import layers_under as _walk
from finefreeze._resolve.resolve import FROZEN, UNTRAINED
from finefreeze._resolve.scopes import layer_scope
from finefreeze._resolve.targets import base_trainable, remember_base

__all__ = ["flag_changes", "honour_flags", "set_flags", "set_layer_flags", "warn_switched_off", "warn_switched_on"]

_SET = "_finefreeze_set_trainable"
_VAR_SET = "_finefreeze_set_flag"  # on a variable: the flag a Freezer set last
_CALL = "_finefreeze_inference_call"


def _walk_with_parents(root):
    """Layers under ``root`` outer before inner, and ``{id(layer): id(parent) or None}``."""
    seen, out, parent = set(), [], {}

    def go(node, up):
        for sub in sublayers(node):
            if id(sub) not in seen:
                seen.add(id(sub))
                out.append(sub)
                parent[id(sub)] = up
                go(sub, id(sub))

    go(root, None)
    return out, parent


def set_layer_flags(target, res) -> bool:
    """Set ``layer.trainable`` from the plan on layers frozen whole; return whether any changed.

    Runs before the BatchNormalization and variable flags are set (Keras'
    setter cascades into sublayers and variables, which those then correct).
    """
    if target.kind != "keras":
        return False
    layers, parent = _walk_with_parents(target.obj)
    trained = {id(x): 0 for x in layers}  # variables Keras trains, under each layer
    frozen = dict(trained)
    for s in res.states:
        if s.state != UNTRAINED and id(s.info.owner) in trained:
            trained[id(s.info.owner)] += 1
            frozen[id(s.info.owner)] += s.state == FROZEN
    for layer in reversed(layers):  # inner before outer: add up
        up = parent[id(layer)]
        if up is not None:
            trained[up] += trained[id(layer)]
            frozen[up] += frozen[id(layer)]
    changed = False
    for layer in layers:
        if not isinstance(layer, keras.Model):  # nested models only: see the module docstring
            continue
        whole = trained[id(layer)] and trained[id(layer)] == frozen[id(layer)]
        want = base_trainable(layer) and not whole
        if layer.trainable != want:
            layer.trainable, changed = want, True
        set_tag(layer, _SET, want)
    affine = res.plan.batchnorm == "affine"
    for layer in layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            changed |= inference_mode(layer, affine)
    for s in res.states:  # the cascade may have switched variables Keras did not train
        if s.state == UNTRAINED and s.info.is_keras and s.variable.trainable != s.info.base_trainable:
            s.variable.trainable = base_trainable(s.variable)
    return changed


def inference_mode(layer, on: bool) -> bool:
    """Make a BatchNormalization layer run in inference mode while it trains (``batchnorm="affine"``).

    Keras runs a trainable BatchNormalization in training mode whenever
    ``training`` is true; this layer's ``call`` is given ``training=False``
    instead (an attribute of the instance, removed when ``on`` is False;
    nothing of it is saved). Returns whether it changed.
    """
    has = instance_value(layer, _CALL, False)
    if on == has:
        return False
    if on:
        original = layer.call

        def call(*args, training=None, **kwargs):
            return original(*args, training=False, **kwargs)

        set_instance_value(layer, "call", call)
        set_instance_value(layer, _CALL, True)
    else:
        remove_instance_value(layer, "call")
        remove_instance_value(layer, _CALL)
    return True


def _selector(target, layer, res):
    """The scoped glob of a layer when it selects exactly the layer's variables, else the layer."""
    scope = layer_scope(target.obj, layer)
    if scope and not re.search(r"[*?\[\]]", scope):
        glob = scope + "/**"
        rule = train(glob)
        ids = {id(v) for v in layer.weights}
        hit = {id(s.info.variable) for s in res.states if rule.selector.matches(s.info, target)}
        if hit and hit == {i for i in ids if i in {id(s.info.variable) for s in res.states}}:
            return glob
    return layer


def flag_changes(target, res) -> list[tuple[str, Rule]]:
    """Layers whose ``trainable`` the user switched since the Freezer set it, as rules.

    Returns:
        ``[(description, rule)]``, outer layers first (a switched layer's
        sublayers follow it and are not listed again).
    """
    if target.kind != "keras":
        return []
    out, done = [], set()
    for layer in _walk(target.obj):
        if id(layer) in done or tag(layer, _SET, None) is None:
            continue
        was = tag(layer, _SET)
        if bool(layer.trainable) == was:
            continue
        done.update(id(x) for x in _walk(layer))
        sel = _selector(target, layer, res)
        rule = train(sel) if layer.trainable else freeze(sel)
        out.append((f"{layer.name}.trainable = {bool(layer.trainable)}", rule))
    return out


def honour_flags(frz, plan: Plan) -> Plan:
    """``plan`` with a rule for each ``layer.trainable`` switch made since ``frz`` set the flags (with a warning).

    ``wrap``, ``activate`` and ``update`` call it: a switch is never a silent no-op.
    """
    changes = flag_changes(frz._target, frz._res)
    if not changes:
        return plan
    what = "; ".join(f"{d}: the plan now ends with {rule!r}" for d, rule in changes)
    warnings.warn(
        f"Keras' trainable flag changed after the Freezer set it ({what}). The Freezer honours it "
        "(see history); to silence this, change the plan with Freezer.update instead.",
        FreezeWarning,
        stacklevel=3,
    )
    return Plan([*plan.rules, *(rule for _, rule in changes)], strict=plan.strict, batchnorm=plan.batchnorm)


def set_flags(target, res) -> bool:
    """Set the Keras flags of ``target``'s layers and variables from ``res``; return whether any changed."""
    t = target
    for layer in t.layers:
        if isinstance(layer, keras.layers.Layer):
            remember_base(layer)
    for vi in t.variables:
        if vi.is_keras:
            remember_base(vi.variable)
    changed = set_layer_flags(t, res)  # layers frozen whole: layer.trainable = False
    frozen_layers = {id(x) for x in res.frozen_layers}
    for layer in t.layers:
        if isinstance(layer, keras.layers.BatchNormalization):
            want = base_trainable(layer) and id(layer) not in frozen_layers
            if layer.trainable != want:
                layer.trainable, changed = want, True
    for s in res.states:
        if (
            s.info.is_keras and s.state != UNTRAINED and s.info.quantized is None
        ):  # a quantized kernel: its delta trains
            want = s.state != FROZEN
            if s.variable.trainable != want:
                s.variable.trainable, changed = want, True
            set_tag(s.variable, _VAR_SET, want)  # what a Freezer set last: warn_switched_on tells a user's switch
    return changed


def warn_switched_on(target, res) -> None:
    """Warn, and set the flags back, when Keras' flag is on again for variables the plan freezes whole.

    ``model.trainable = True`` (or a layer's, when that layer's flag was
    already on) after a Freezer turns every variable flag under it back on:
    nothing a layer flag records (:func:`flag_changes` sees no switch), and
    nothing would train, as the plan still freezes them. Said, not silently
    ignored; the flags go back to the plan's so Keras computes no gradient
    for them. A flag another Freezer of the model turned on (two plans over
    shared layers, as in a GAN) is not a switch: each variable remembers
    the flag a Freezer set last. (On TensorFlow, Keras 3.15's setter does
    not reach the variables' flags at all: there nothing changes to say.)
    """
    on = [
        s.path
        for s in res.states
        if s.state == FROZEN
        and s.info.is_keras
        and s.variable.trainable
        and tag(s.variable, _VAR_SET, True) is False  # a Freezer switched it off last, not on (another plan)
    ]
    if not on:
        return
    set_flags(target, res)
    shown = ", ".join(on[:3]) + (f" and {len(on) - 3} more" if len(on) > 3 else "")
    warnings.warn(
        f"Keras' trainable flag was turned back on for {len(on)} variable(s) the plan freezes ({shown}), e.g. "
        "by model.trainable = True after the Freezer: the plan keeps them frozen, bit for bit, and the flags "
        "are set back. To train them, change the plan: frz.update(frz.plan.train('**')) (or a narrower selector).",
        FreezeWarning,
        stacklevel=3,
    )


def warn_switched_off(res) -> None:
    """Warn when Keras will not train variables the plan trains (a ``layer.trainable = False`` of the user's)."""
    off = [
        s.path
        for s in res.states
        if s.state in (State.TRAINABLE, State.PARTIAL)
        and s.info.is_keras
        and not s.variable.trainable
        # the layer itself switched off: not the variable flags another Freezer of this model set
        and getattr(s.info.owner, "trainable", True) is False
    ]
    if off:
        shown = ", ".join(off[:3]) + (f" and {len(off) - 3} more" if len(off) > 3 else "")
        warnings.warn(
            f"the plan trains {shown}, but Keras' trainable flag is off for them (a layer.trainable = False "
            "set after the Freezer?): Keras computes no gradient for them, so they will not train. Put it "
            "in the plan (frz.update(frz.plan.freeze(...))) or set the flag back.",
            FreezeWarning,
            stacklevel=3,
        )
