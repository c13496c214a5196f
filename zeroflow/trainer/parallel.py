"""The mesh and the ``ZeroPlan`` of a config's ``parallel`` keys: the one place a trainer turns
them into an engine plan, so no trainer can drop a setting."""

from __future__ import annotations

from zeroflow.backend.mesh import make_mesh
from zeroflow.config.io import CONFIG_KEYS
from zeroflow.config.schema import ParallelConfig
from zeroflow.engine.hosts import host_split
from zeroflow.engine.plan import ZeroPlan
from zeroflow.engine.plan_rules import hierarchical_hosts_problem


def mesh_of(par: ParallelConfig, devices=None):
    """The mesh ``parallel.data``, ``parallel.context`` and ``parallel.model`` ask for."""
    return make_mesh(data=par.data, context=par.context, model=par.model, devices=devices)


def plan_of(par: ParallelConfig, mesh, *, tensor_rules=(), traits=None) -> ZeroPlan:
    """Every plan setting of ``par`` (``ParallelConfig.plan_settings``) on ``mesh``.
    ``tensor_rules``: how the model splits over the ``model`` axis; ``traits``: the backend
    the step is shaped for when it is not the mesh's own."""
    if par.hierarchical:  # the one rule the mesh decides, spelled with the config's keys
        hosts = host_split(mesh, par.hosts or None).hosts
        problem = hierarchical_hosts_problem(True, hosts, CONFIG_KEYS)
        if problem:
            raise ValueError(problem)
    return ZeroPlan(mesh, tensor_rules=tensor_rules, traits=traits, **par.plan_settings())
