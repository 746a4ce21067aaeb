"""Float deltas a file puts into a quantized model (``load_delta``, ``DeltaSwitch``): the model's, no Freezer's.

A delta file trained on a quantized base holds, for each quantized kernel,
the flat indices and float values of its delta (``_slices.quantized``).
Applying it needs the layer's delta beside the integers: :func:`hold_delta`
makes it (or widens the one in place to hold more elements, its values
carried over), and the file's values are then written into it, element by
element, as into any variable.
"""

from __future__ import annotations

import keras
import numpy as np

from finefreeze._errors import PlanError
from finefreeze._keras.instances import instance_value
from finefreeze._keras.quantized import is_quantized
from finefreeze._slices.calls import _give_call, _take_call
from finefreeze._slices.choose import choose, kernel_shape, mark_name, mark_of
from finefreeze._slices.quantized import carry, delta_kept

__all__ = ["delta_elements", "delta_values", "foreign_delta", "hold_delta", "refuse_requantized", "retrace"]


def refuse_requantized(res) -> None:
    """Raise when a layer was quantized after ``res`` was resolved: its planned float kernel left the model.

    Raises:
        PlanError: naming the kernel, with the fix (make the Freezer after ``quantize()``).
    """
    for s in res.states:
        layer = s.info.owner
        if s.info.quantized is None and s.info.is_keras and is_quantized(layer) is not None:
            if not any(w is s.variable for w in layer.weights):
                raise PlanError(
                    f"{s.path!r} was quantized ({is_quantized(layer)}) after this Freezer was made: the float kernel "
                    "it planned is no longer the model's, so nothing would train. Make the Freezer after "
                    "quantize() (the same plan applies to the quantized kernel)."
                )


def foreign_delta(layer, variable, trained: np.ndarray) -> bool:
    """Whether a live Freezer trains a delta of this quantized kernel that lacks some of ``trained``.

    A file cannot widen that delta: the Freezer's optimizer holds its state.
    """
    mark = mark_of(layer, variable)
    if mark is None or not mark.quantized or mark.holder is None:
        return False
    owner = mark.owner()
    return owner is not None and owner is not _FILES and not np.isin(trained, mark.index).all()


def retrace(model) -> None:
    """Make ``model``'s compiled steps (train, test, predict) again at their next use: a layer's call changed.

    A quantized kernel's delta changes what the model computes, so a
    ``predict`` traced before it came (TensorFlow's graph) must not run on.
    """
    import keras

    if not isinstance(model, keras.Model):
        return
    for kind in ("train", "test", "predict"):
        if getattr(model, f"{kind}_function", None) is not None:
            getattr(model, f"make_{kind}_function")(force=True)


class _Files:
    """The owner of deltas a file put into a quantized model (``load_delta``, ``DeltaSwitch``), not a Freezer."""


_FILES = _Files()


def delta_elements(layer, variable) -> np.ndarray | None:
    """The sorted flat indices a quantized kernel's float delta holds, or None (it has none)."""
    mark = mark_of(layer, variable)
    if mark is None or not mark.quantized or mark.holder is None:
        return None
    return mark.index


def delta_values(layer, variable) -> tuple[np.ndarray, np.ndarray] | None:
    """A quantized kernel's float delta as it is now, ``(sorted flat indices, values)``, or None (it has none)."""
    index = delta_elements(layer, variable)
    if index is None:
        return None
    return index, np.asarray(keras.ops.convert_to_numpy(mark_of(layer, variable).standin))


def hold_delta(layer, variable, trained: np.ndarray):
    """The float delta of a quantized kernel, holding at least the flat indices ``trained``; made or widened.

    A delta in place that holds them is kept; one that does not is replaced
    by one holding both (its values carried over). A file's delta is the
    model's: no Freezer owns it.

    Returns:
        The stand-in variable of the delta.
    """
    have = delta_elements(layer, variable)
    if have is not None and np.isin(trained, have, assume_unique=True).all():
        return mark_of(layer, variable).standin
    union = trained if have is None else np.union1d(have, trained)
    frozen = np.ones(kernel_shape(layer, variable), bool)
    frozen.reshape(-1)[union] = False
    ks, _ = choose(layer, variable, frozen, "sliced")
    name = mark_name(layer, variable)
    kept = delta_kept(layer, name, (layer, ks, variable, True, True, frozen))
    mark = instance_value(layer, name, None)
    if mark is not None:
        _take_call(layer, mark)
    _give_call(layer, ks, variable, True, True, frozen, owner=_FILES)
    carry(layer, name, kept)
    return mark_of(layer, variable).standin
