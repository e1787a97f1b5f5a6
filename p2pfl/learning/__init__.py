"""Local work: model builders, state arithmetic, training and scoring (one peer at a time or
batched), curvature statistics and position-aware neurons."""
