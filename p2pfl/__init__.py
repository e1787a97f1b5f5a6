"""p2pfl: a peer-to-peer federated-learning simulator.

Methods are written once as peer behaviours (:mod:`p2pfl.methods.effects`); runtimes
(:mod:`p2pfl.runtime`) run them on a simulated network or over sockets.
"""

__version__ = "0.1.0"
