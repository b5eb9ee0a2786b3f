"""The record of what tigon patched and its undoing: attributes set on shared owners (classes,
modules) and on instances (``_InstancePatch``), ``unpatch``."""

from __future__ import annotations

import copy
import inspect
import types
import warnings
import weakref

from torch import nn

from tigon.patching.options import PatchReport

# What happens to a patched model:
# - ``copy.deepcopy`` gives a patched copy, which ``unpatch()`` unpatches too.
# - Pickling (``torch.save(model)``) stores it unpatched: it loads with HF's forwards and a
#   warning saying so (patch it again after loading). State dicts are unaffected by patching.
# - ``unpatch()`` undoes every patch (classes, module functions, every patched instance and its
#   copies); ``unpatch(model)`` the instance patches inside ``model``; ``with patched(...)``
#   exactly the patches its block made. Nothing is left on the modules afterwards.

_MISSING = object()
# Shared owners (classes, modules): (id(owner), name) -> (owner, name, value before tigon).
_SHARED_ORIGINALS: dict[tuple[int, str], tuple[object, str, object]] = {}
# Instances with an _InstancePatch in their __dict__ (weakly: a patched model can be freed).
_PATCHED_INSTANCES: weakref.WeakSet = weakref.WeakSet()


def _warn_loaded_unpatched(name, before):
    warnings.warn("tigon: this model was pickled while patched by tigon and loads unpatched (HF's forwards); "
                  "call tigon.patch(model) again after loading", stacklevel=2)
    return before


class _InstancePatch:
    """One module's own ``forward`` (or other attribute) set by tigon: calls ``fn(module, ...)``
    and remembers what the module's __dict__ held before. It refers to the module weakly (no
    reference cycle), follows it into deep copies (the copy is patched, and known to
    ``unpatch``), and pickles as what was there before (loading gives an unpatched module)."""

    __slots__ = ("fn", "name", "before", "_owner", "__weakref__")

    def __init__(self, fn, owner, name, before):
        self.fn, self.name, self.before = fn, name, before
        self._owner = weakref.ref(owner)
        _PATCHED_INSTANCES.add(owner)

    @property
    def owner(self):
        return self._owner()

    def __call__(self, *args, **kwargs):
        return self.fn(self._owner(), *args, **kwargs)

    def __deepcopy__(self, memo):
        owner = self._owner()
        new_owner = memo.get(id(owner), owner)
        return _InstancePatch(self.fn, new_owner, self.name, copy.deepcopy(self.before, memo))

    def __reduce__(self):
        if self.before is _MISSING:
            owner = self._owner()
            # What the module did before tigon: the class's own attribute, bound to it.
            return _warn_loaded_unpatched, (self.name, types.MethodType(getattr(type(owner), self.name), owner))
        return _warn_loaded_unpatched, (self.name, self.before)

    @property
    def _tigon(self):
        return getattr(self.fn, "_tigon", "tigon")

    @property
    def __signature__(self):
        """fn's signature without its first parameter, as a bound method's (HF's Trainer reads
        ``model.forward``'s parameters to pick the batch's columns)."""
        signature = inspect.signature(self.fn)
        return signature.replace(parameters=list(signature.parameters.values())[1:])


def _hooked_name(inst, name):
    """accelerate's hooks (device_map with offload / several devices) wrap ``forward`` and call
    ``_old_forward``: patch that one, so the hook keeps running."""
    if name == "forward" and "_old_forward" in vars(inst) and hasattr(inst, "_hf_hook"):
        return "_old_forward"
    return name


def _set_shared(owner, name, value, undo):
    key = (id(owner), name)
    before = vars(owner).get(name, _MISSING)
    if key not in _SHARED_ORIGINALS:
        _SHARED_ORIGINALS[key] = (owner, name, before)
    undo.append((owner, name, before))
    setattr(owner, name, value)


def set_instance_attribute(inst, name: str, fn, report: PatchReport) -> None:
    """``inst.<name>`` set to call ``fn(inst, ...)``, recorded in ``report`` for unpatch (the seam
    through which tigon.planning installs checkpointing on a patched model)."""
    _set_instance(inst, name, fn, report.undo)


def _set_instance(inst, name, fn, undo):
    name = _hooked_name(inst, name)
    own = vars(inst)
    before = own.get(name, _MISSING)
    original = before.before if isinstance(before, _InstancePatch) else before
    undo.append((inst, name, before))
    own[name] = _InstancePatch(fn, inst, name, original)


def _restore(owner, name, value):
    own = vars(owner)
    if value is _MISSING:
        if name in own:
            if isinstance(owner, (type, types.ModuleType)):
                delattr(owner, name)
            else:
                del own[name]
    elif isinstance(owner, (type, types.ModuleType)):
        setattr(owner, name, value)
    else:
        own[name] = value


def _unpatch_instance(inst) -> int:
    count = 0
    for name, value in list(vars(inst).items()):
        if isinstance(value, _InstancePatch):
            _restore(inst, name, value.before)
            count += 1
    _PATCHED_INSTANCES.discard(inst)
    return count


def unpatch(model: nn.Module | None = None) -> int:
    """Undo tigon's patches: all of them (classes, module functions, every patched instance and
    its deep copies), or with ``model`` the instance patches of the modules inside it (the
    module-level dispatchers stay: they only act inside patched models). Returns how many
    attributes were restored."""
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        return sum(_unpatch_instance(m) for m in model.modules())
    count = sum(_unpatch_instance(m) for m in list(_PATCHED_INSTANCES))
    for owner, name, before in reversed(list(_SHARED_ORIGINALS.values())):
        _restore(owner, name, before)
        count += 1
    _SHARED_ORIGINALS.clear()
    return count


def _undo(undo) -> None:
    """Undo exactly the changes recorded in ``undo`` (one patch call's), latest first."""
    for owner, name, before in reversed(undo):
        _restore(owner, name, before)
        if isinstance(owner, (type, types.ModuleType)):
            key = (id(owner), name)
            if key in _SHARED_ORIGINALS and _SHARED_ORIGINALS[key][2] is before:
                del _SHARED_ORIGINALS[key]
        elif not any(isinstance(v, _InstancePatch) for v in vars(owner).values()):
            _PATCHED_INSTANCES.discard(owner)


def _instances(model: nn.Module, cls: type) -> list[nn.Module]:
    return [m for m in model.modules() if type(m) is cls]


def _forward_before_tigon(inst):
    """What ``inst.forward`` ran before any tigon instance patch, as a function of (self, ...)."""
    own = vars(inst).get(_hooked_name(inst, "forward"), _MISSING)
    if isinstance(own, _InstancePatch):
        own = own.before
    if own is _MISSING:
        return type(inst).forward
    return lambda _self, *args, **kwargs: own(*args, **kwargs)
