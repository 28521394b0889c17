"""The one error users see for anything the partitioner cannot honour."""


class ShardingError(ValueError):
    """Bad annotation, unsupported op or unsatisfiable sharding.

    Messages say which value (and its shape), which mesh, why, and what to do.
    """
