"""The patcher's error, raised by every module of tigon.patching."""


class TigonPatchError(RuntimeError):
    """A patch cannot be applied as asked (missing HF piece, unsupported activation, ...)."""
