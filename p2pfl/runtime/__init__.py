"""Runtimes carry out the effects that method behaviours yield (simulated or over sockets)."""
