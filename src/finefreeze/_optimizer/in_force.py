"""Whether the plan a ``FreezingOptimizer`` enforces is the one the model's Keras flags follow.

Several Freezers may share a model (a GAN's two halves), and ``fit`` hands
the optimizer the model's trainable variables: those of the Freezer created
or activated last. An optimizer whose plan is not the one in force would
silently skip what its plan trains, so it warns (``FreezeWarning``), naming
``activate()``: when it is built (the start of the first ``fit``) and when a
new trace hands it another list. The plan is not put in force for the user:
inside ``fit`` the step is already being traced with the flags it has, and
which of several plans should train is the user's call.
"""

from __future__ import annotations

import warnings

from finefreeze._backends.chosen import trainer_pairs_by_position
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._resolve.resolve import PARTIAL, TRAINABLE
from finefreeze._resolve.standins import is_standin, kernel_of
from finefreeze._resolve.targets import var_path

__all__ = [
    "check_at_build",
    "check_stateless",
    "not_built_on",
    "plan_freezes",
    "trains_outside",
    "warn_not_in_force",
    "warn_unbound",
]


def trains_outside(state, var_list) -> list[str]:
    """Paths the plan of ``state`` (an optimizer's ``Enforcement``) trains that are not in ``var_list``."""
    res = state.resolution
    if res is None:
        return []
    given = {id(v) for v in var_list} | {id(getattr(v, "value", v)) for v in var_list}
    given |= {id(kernel_of(v)) for v in var_list if kernel_of(v) is not None}  # a quantized kernel: its delta
    return [s.path for s in res.trainable_states if id(s.variable) not in given and id(s.info.raw) not in given]


def check_at_build(state, var_list, frz) -> None:
    """At build: warn when ``var_list`` leaves out what the plan trains; refuse it where training cannot run.

    Keras' JAX trainer pairs the gradients of the model's trainable
    variables with the list the optimizer was built on, so there the
    mismatch would end in a raw ``ValueError`` at the first step: it is a
    ``PlanError`` now, with the fix.

    Raises:
        PlanError: on JAX, the plan is not the one in force.
    """
    if _foreign(state, var_list):
        return  # another model's variables: the layout refuses them, with its own message
    missing = trains_outside(state, var_list)
    if missing and trainer_pairs_by_position() and frz is not None:
        raise PlanError(_message(frz, missing, "would not train"))
    by_fit = trainer_pairs_by_position() and _by_fit(frz, var_list)
    extra = [var_path(v) for v in var_list if plan_freezes(state, v)] if by_fit else []
    if extra:  # Keras' JAX trainer would pair them with optimizer variables that do not exist
        raise PlanError(
            _message(
                frz, extra, "would reach Keras' JAX trainer with no optimizer variables to pair with", "it freezes"
            )
        )
    warn_not_in_force(state, var_list, frz)


def _by_fit(frz, var_list) -> bool:
    """Whether ``var_list`` is what ``fit`` builds on: the trainable variables of the Freezer's model.

    A custom loop may hand every variable, frozen ones included (they are skipped).
    """
    model = getattr(getattr(frz, "_target", None), "obj", None)
    trainable = getattr(model, "trainable_variables", None) if hasattr(model, "make_train_function") else None
    return trainable is not None and {id(v) for v in var_list} == {id(v) for v in trainable}


def _which(frz) -> str:
    """`` (plan <first rule>, ...)``: which Freezer's plan an error means."""
    return f" (plan {frz.plan.rules[0]!r}, ...)" if frz is not None and frz.plan.rules else ""


def _foreign(state, var_list) -> bool:
    """Whether ``var_list`` holds a variable the plan of ``state`` was not resolved against (another model's)."""
    res = state.resolution
    return res is not None and any(res.lookup(v) is None and not is_standin(v) for v in var_list)


def _message(frz, missing, consequence: str, what: str = "it trains") -> str:
    which = _which(frz)
    more = ", ..." if len(missing) > 3 else ""
    among = "are not among" if what == "it trains" else "are among"
    return (
        f"the plan this optimizer enforces is not the one in force: {len(missing)} variable(s) {what} "
        f"{among} the variables training hands it ({', '.join(missing[:3])}{more}), so they {consequence}. "
        "The model's Keras flags changed since it was compiled: another Freezer was created or activated "
        f"after this optimizer's (call .activate() on this optimizer's Freezer{which} before fit), or "
        "model.trainable / layer.trainable was set (change the plan with Freezer.update instead, or compile "
        "again: the next wrap says what the flag changed)."
    )


def _switch_message(switched: list[str]) -> str:
    return (
        f"Keras' trainable flag changed after the Freezer set it ({'; '.join(switched)}), and the compiled step "
        "runs on: the plan in force still decides, so nothing it freezes trains. Compile again with "
        "frz.wrap(...) (the Freezer then adds the switch to its plan, with a warning) or change the plan with "
        "frz.update(...)."
    )


def warn_not_in_force(state, var_list, frz) -> None:
    """Warn once when ``var_list`` (what training hands the optimizer) leaves out variables its plan trains."""
    if state.warned("not in force") or not state.newly_checked(var_list):
        return  # PyTorch's eager trainer hands the same list at every step: checked once
    switched = frz._switched() if frz is not None else []
    if switched and state.first_time("switched"):
        warnings.warn(_switch_message(switched), FreezeWarning, stacklevel=4)
        return
    if _foreign(state, var_list):
        return
    missing = trains_outside(state, var_list)
    if not missing or not state.first_time("not in force"):
        return
    warnings.warn(
        _message(frz, missing, "would not train"),
        FreezeWarning,
        stacklevel=4,
    )


def check_stateless(built: list | None, trainable_variables, frz) -> None:
    """Refuse a step of Keras' JAX trainer handing ``opt`` other variables than it was built on (count or shapes).

    The flags were switched to another Freezer's plan after the build
    (``activate()`` of another Freezer): Keras would raise a bare
    ``ValueError``; this names the fix.

    Raises:
        PlanError: the plan this optimizer was built on is not the one in force.
    """
    if built is None:
        return
    if [tuple(v.shape) for v in trainable_variables] != [tuple(v.shape) for v in built]:
        if frz is None and len(trainable_variables) < len(built):  # its stand-ins went with the Freezer
            raise PlanError(
                f"this optimizer was built on {len(built)} variables, the stand-ins of its sliced kernels among "
                f"them, and its Freezer is gone with them: training hands it {len(trainable_variables)}. Keep "
                "the Freezer referenced while the model trains, or call ff.Freezer.of(model) to bind a new one "
                "to this optimizer before fit."
            )
        if frz is not None and frz._switched():
            raise PlanError(_switch_message(frz._switched()))
        if frz is not None:  # the model's variables neither built on nor seen by the Freezer: made after it
            known = {id(v) for v in built} | {id(vi.variable) for vi in frz._res.target.variables}
            current = getattr(frz._res.target.obj, "trainable_variables", None) or ()
            new = [v.path for v in current if id(v) not in known]  # (the step hands values, not variables)
            if new:
                raise PlanError(
                    f"the model now trains {len(new)} variables this optimizer's Freezer never saw ({', '.join(new[:3])}"
                    f"{', ...' if len(new) > 3 else ''}): the model made them after the Freezer (model.quantize() "
                    "after it, a layer built later). Make the Freezer once the model is complete, then compile."
                )
        which = _which(frz)
        raise PlanError(
            f"the plan this optimizer enforces is not the one in force: training hands it "
            f"{len(trainable_variables)} variables, and it was built on {len(built)} "
            "(the model's Keras flags changed since: another Freezer was activated after this optimizer was "
            f"built, so call .activate() on this optimizer's Freezer{which} before fit; or model.trainable / "
            "layer.trainable was set, so change the plan with Freezer.update instead, or compile again: the "
            "next wrap says what the flag changed)."
        )


def warn_unbound(state, saved_gradients: dict | None, frz) -> None:
    """Warn once when a loaded model trains without its Freezer while the saved run sliced its kernels.

    Without ``Freezer.of(model)`` no layer computes a slice's own gradient: the
    frozen elements stay exact, the trained ones take the dense gradient and
    differ from the saved run's by float rounding.
    """
    saved = saved_gradients or {}
    mode = saved.get("mode", "dense")
    if frz is not None or not saved.get("sliced") or not state.first_time("unbound"):
        return  # bound, or the saved run sliced nothing, or warned
    warnings.warn(
        f"this model was saved training with gradients={mode!r}, and trains now without its Freezer: its "
        "kernels take the dense gradient (frozen elements stay exact; trained ones differ from the saved run "
        "by float rounding). Call ff.Freezer.of(model) after load_model and before fit to resume as it ran.",
        FreezeWarning,
        stacklevel=4,
    )


def not_built_on(state, v) -> PlanError:
    """The error for a gradient of ``v``, a variable the optimizer of ``state`` was not built on."""
    if state.resolution is not None and state.resolution.lookup(v) is not None:  # trains: plan_freezes is False
        return PlanError(
            f"FreezingOptimizer got a gradient for {var_path(v)!r}, which its plan trains but it was "
            "not built on: it was built while another Freezer's plan was in force (Keras flags follow "
            "the Freezer created or activated last). Call .activate() on this optimizer's Freezer."
        )
    return PlanError(
        f"FreezingOptimizer got a gradient for {var_path(v)!r}, a variable it was not built on "
        "(its plan was resolved against another model, or the model gained variables since). "
        "Compile each model with an optimizer from its own Freezer, created after the model "
        "is built: ff.Freezer(model, plan).wrap(...)."
    )


def plan_freezes(state, v) -> bool:
    """Whether the plan of ``state`` knows ``v`` and freezes it whole."""
    st = state.resolution.lookup(v) if state.resolution is not None else None
    return st is not None and st.state not in (TRAINABLE, PARTIAL)
