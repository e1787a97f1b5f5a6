"""The foundation every layer may use: one-line config errors, keyword options bound to
signatures and the registries built on them, named random streams, safe YAML reading,
plug-in loading, and copies of tensors that cost nothing until written."""
