"""nnx_zoo.sharding: logical axis names -> mesh shardings.

Model code annotates every Variable with logical names (``nnx.Param(v, out_sharding=("embed", "mlp"))``) and
every activation it lays out with ``shard(x, names)``; a rule set (data, chosen by name) maps names to the mesh
axes of ``make_mesh``; ``logical_to_mesh_axes`` is the one resolver. A family declares a name of its own with
``declare_axis(name, like=shared_name, doc=...)`` in its folder; every rule set places it like ``like``.
This package imports nothing else of nnx_zoo.
"""

from nnx_zoo.sharding.axes import LOGICAL_AXES, MESH_AXES, STACK_AXES, declare_axis, declared_axes, describe
from nnx_zoo.sharding.constrain import (
    activation_spec,
    current_allow_partial,
    current_rules,
    record_shardings,
    restore_sharding,
    shard,
    sharding_of,
    use_rules,
)
from nnx_zoo.sharding.create import (
    abstract_module,
    create_sharded,
    create_variables,
    iter_variables,
    logical_names,
    state_shardings,
    variable_spec,
)
from nnx_zoo.sharding.mesh import (
    make_abstract_mesh,
    make_mesh,
    parse_mesh,
    reserve_cpu_workers,
    shard_mode_of,
    xla_cpu_workers,
)
from nnx_zoo.sharding.report import ShardingReport, sharding_report
from nnx_zoo.sharding.resolve import ShardingError, axes_tuple, logical_to_mesh_axes, named_sharding
from nnx_zoo.sharding.rules import RULE_SETS, Rules, context_axes, expand_rules, get_rules, validate_rules

__all__ = [
    "activation_spec",
    "axes_tuple",
    "current_allow_partial",
    "LOGICAL_AXES",
    "MESH_AXES",
    "RULE_SETS",
    "STACK_AXES",
    "Rules",
    "ShardingError",
    "ShardingReport",
    "abstract_module",
    "context_axes",
    "create_sharded",
    "create_variables",
    "expand_rules",
    "current_rules",
    "declare_axis",
    "declared_axes",
    "describe",
    "get_rules",
    "iter_variables",
    "logical_names",
    "logical_to_mesh_axes",
    "make_abstract_mesh",
    "make_mesh",
    "reserve_cpu_workers",
    "xla_cpu_workers",
    "named_sharding",
    "parse_mesh",
    "record_shardings",
    "restore_sharding",
    "shard",
    "shard_mode_of",
    "sharding_of",
    "sharding_report",
    "state_shardings",
    "use_rules",
    "validate_rules",
    "variable_spec",
]
