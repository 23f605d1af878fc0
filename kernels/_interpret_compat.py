"""Let interpreted kernels (``TRITON_INTERPRET=1``) use loaded scalars as ``range`` bounds
under numpy >= 2.4.

The triton 3.6 interpreter keeps a scalar loaded from memory as a 1-element array and
converts it with ``int(array)``, which numpy 2.4 refuses for arrays with ndim > 0, so
``for n0 in range(start, end, BLOCK_N)`` fails there. Compiled kernels are unaffected.
"""
import numpy as np


def patch() -> None:
    try:
        int(np.zeros(1))
        return  # this numpy still converts 1-element arrays
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_attn_backends_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._attn_backends_patched = True
    interpreter._patch_lang_tensor = patched
