"""Multi-process recovery over ``jax.distributed`` (issue 3): launcher, per-host agents,
buddy replication, agreement, in-process re-initialisation.

Kept import-light on purpose: the agent process imports submodules of this package without
JAX (see `agent.agent_command`), so nothing is imported here.
"""
