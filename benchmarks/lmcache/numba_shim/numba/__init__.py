"""Minimal stand-in for numba (used only when real numba is absent).

LMCache imports ``from numba import njit`` at module level for CacheGen
(compression) kernels and the multiprocess token hasher; neither is used by the
in-process CPU-offload path. Decorated functions run as plain Python.
"""
__version__ = "0.0.0+lmcache-shim"


def _passthrough(*args, **kwargs):
    if len(args) == 1 and callable(args[0]) and not kwargs:
        return args[0]
    return lambda f: f


njit = jit = vectorize = guvectorize = cfunc = generated_jit = _passthrough
prange = range


class _Types:
    def __getattr__(self, name):
        return object


types = _Types()
