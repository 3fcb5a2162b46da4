"""The per-host agent process (no JAX: it is started through `bootstrap.agent_command`,
which loads this package without ``mnemojax/__init__.py``). Nothing is imported here."""
