"""The network: who talks to whom (topology, peer profiles and their links), what crosses it
(messages, their wire format and codecs), what it costs (the ledger of every message, and the
analytic plans of `p2pfl cost`)."""
