"""The worker's side of the multi-process layer, what the resilient step uses: the session
(`session`), world recovery (`recovery`), membership of the JAX world (`coordination`),
snapshots in and out of arrays (`state_transfer`), and its clients of the agent
(`agent_client`) and of the coordinator (`coordinator_client`). Nothing is imported here.
"""
