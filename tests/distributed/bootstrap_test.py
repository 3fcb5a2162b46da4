"""`distributed.agent.bootstrap`: the agent process starts without importing JAX."""

from __future__ import annotations

import subprocess


def test_agent_process_does_not_import_jax():
    from mnemojax._src.distributed.agent.bootstrap import agent_command
    cmd = agent_command("--help")
    probe = cmd[2].replace("from mnemojax._src.distributed.agent.bootstrap import main; "
                           "sys.exit(main(sys.argv[1:]))",
                           "import mnemojax._src.distributed.agent.agent, "
                           "mnemojax._src.distributed.worker.agent_client; "
                           "sys.exit(10 + ('jax' in sys.modules))")
    assert probe != cmd[2]
    result = subprocess.run([cmd[0], "-c", probe], timeout=60, check=False)
    assert result.returncode == 10, "the agent imported jax"
