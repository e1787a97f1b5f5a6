"""One-shot aggregation: every peer trains once and uploads once; an aggregator merges.

- :mod:`~p2pfl.methods.oneshot.placement`: where uploads go (a star's centre or a complete
  mesh), shared by every one-shot method, MA-Echo included;
- :mod:`~p2pfl.methods.oneshot.protocol`: the messages and phases of the one-shot merges
  (upload, validation vote, result) and their base class :class:`OneShot`;
- :mod:`~p2pfl.methods.oneshot.payload`: how an upload's model and statistics become
  messages, and back;
- :mod:`~p2pfl.methods.oneshot.lowrank`: the 9-bit low-rank code of K-FAC factors and Grams;
- :mod:`~p2pfl.methods.oneshot.statistics`: what a peer computes on its own data.
"""

from p2pfl.methods.oneshot.payload import Upload
from p2pfl.methods.oneshot.placement import UploadOnce
from p2pfl.methods.oneshot.protocol import OneShot, fedavg, shares

__all__ = ["OneShot", "Upload", "UploadOnce", "fedavg", "shares"]
