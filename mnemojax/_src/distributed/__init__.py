"""Multi-process recovery over ``jax.distributed``: launcher, per-host agents, buddy
replication, agreement, in-process re-initialisation. One subpackage per process role,
the modules they share at the top.

Shared (no JAX):
    wire            every message between the processes, one frozen class each
    transport       framing, request/reply over loopback TCP, the connection handshake
    auth            the per-job secret (``MNEMOJAX_JOB_SECRET``) and the handshake's proofs
    env             `WorldSpec`, `world_from_env` (``MNEMOJAX_*``, SLURM fallback)
    agreement       `Agreement`, `CopyInfo` and the coverage rule (which step to resume)
    shm             double-buffered snapshot slots in POSIX shared memory
    snapshot_codec  self-describing payload of one worker's shards; `select`, `HostBlocks` (numpy)
    jax_private     the only user of JAX's private distributed APIs, version-checked

``launcher/`` (the launcher process; jaxlib for the services only):
    launcher        `Launcher`: one job, its event log, exit status, cleanup
    options         `LaunchOptions`, `worker_env`
    control         `ControlServer`: agents' links and workers' requests on one port
    roster          `AgentRoster`: links, addresses, pids, exits, commands; the lock
    supervisor      `AgentSupervisor`: agent processes, process groups, shm sweep
    services        `ServiceHost`: one JAX coordination service per world generation
    arbiter         `Arbiter`: the agreement barrier, decision, eviction, new ring
    book            `AgreementBook`: the decision logic (pure)
    cli             ``mnemojax launch``
    scenario        `run_scenario`, `ProcessFault` (public in `mnemojax.testing`)

``agent/`` (one per host, never imports JAX):
    bootstrap       `agent_command` (starts it without JAX), ``main``, PDEATHSIG
    agent           `Agent`: its parts and main loop (commands, exits, watchdog)
    launcher_link   its link to the launcher: events out, commands in
    server          `AgentServer`: requests from its worker, peers and the launcher
    snapshots       `SnapshotHolder`: own slots, buddy replicas, a held copy, in budget
    replication     `Replicator`: pushes each new snapshot to the ring successor
    replica_store   `ReplicaStore`: the buddy copies (pure)
    watchdog        `HangWatchdog` (pure)
    worker_process  `WorkerProcess`: the worker child, under PDEATHSIG

``worker/`` (inside the training process; what the resilient step uses):
    session         `DistributedSession`, `initialize`, `current`
    recovery        `recover_world`, `WorldRecovery`: detach, agree, fetch, attach
    coordination    join/leave a JAX world, barriers (through `jax_private`)
    state_transfer  local shards out of arrays, agreed state back through ``put``
    agent_client    `AgentClient` (publish, phase), `fetch_snapshot`
    coordinator_client  `Coordinator` protocol, `LauncherCoordinator`

Kept import-light on purpose: the agent process imports submodules of this package without
JAX (see `agent.bootstrap.agent_command`), so nothing is imported here.
"""
