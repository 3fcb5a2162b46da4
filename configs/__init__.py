"""Shipped job configs (TOML), installed as package data of `mnemojax.configs`.

Read them with `mnemojax._src.config.shipped_config(name)`; in the repo they are also
plain files (`--config configs/tiny.toml`)."""
