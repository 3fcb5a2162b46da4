"""Goodput simulator: projects measured recovery costs to 1k-128k accelerators.

Pure Python + numpy (+ matplotlib for the plot); it never imports JAX. Entry points:
`run_grid` (library) and ``mnemojax simulate`` (command line, see ``cli.py``).
"""
