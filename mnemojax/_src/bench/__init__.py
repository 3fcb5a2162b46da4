"""`mnemojax bench` and `mnemojax report`: mnemojax against the classical restart baseline.

Modules: `config` (presets, validated TOML), `interval` (Young/Daly checkpoint interval),
`baseline_worker` (the classical job, run as a real subprocess), `baseline` (its
orchestrator: kills, detection, relaunch), `runs` (the in-process mnemojax runs),
`driver` (one bench invocation), `summary` (figures and the table), `plots`, `report`
(offline goodput accounting of any JSONL event log) and the two CLI modules.

Nothing is imported here: `mnemojax report` must not pay for JAX.
"""
