"""The launcher process: agents, coordination services, the agreement, and
``mnemojax launch`` / `scenario.run_scenario` on top. Nothing is imported here."""
