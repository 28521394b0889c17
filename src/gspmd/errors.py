"""The one error users see for anything the partitioner cannot honour, and the warning
for an annotation that does nothing."""


class ShardingError(ValueError):
    """Bad annotation, unsupported op or unsatisfiable sharding.

    Messages say which value (and its shape), which mesh, why, and what to do.
    """


class UnpartitionedWarning(UserWarning):
    """A mesh_split ran outside gspmd.jit (eagerly or under plain jax.jit), where it
    does nothing. Shown once per call site."""
