"""The one place where chunkmem names other libraries' internals.

Every private name of torch, Accelerate, transformers, PEFT, Lightning or Python itself that
chunkmem reads, calls, overrides or patches is here, one module per library, each as a small named
function, constant or class whose docstring says what it reads, why chunkmem needs it and on which
versions it was checked. When a library renames an internal, this package is the one to change;
``tests/unit/compat/test_compat.py`` fails when any other module of chunkmem names one.

The package imports nothing of chunkmem (it is the lowest layer) and nothing at import but what
its modules' users load anyway: a module for a trainer library is imported only by the
integration that needs that library, and ``torch._dynamo`` only when a compile is asked for.
"""
