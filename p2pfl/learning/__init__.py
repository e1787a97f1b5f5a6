"""Local work: model builders, state arithmetic, training and scoring (one peer at a time or
batched), curvature statistics and position-aware neurons."""

from p2pfl.learning import sequence  # noqa: F401  (registers char_lstm, char_transformer)
