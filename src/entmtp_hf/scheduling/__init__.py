"""Per-step choices: confidence features, tree policies and the entropy-adaptive halting rule."""
